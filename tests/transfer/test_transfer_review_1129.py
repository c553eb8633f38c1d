"""Review of the CPU transfer path: KV tensors whose elements do not lie one `element_size()`
each in one strided storage (packed quantized dtypes, sparse, MKL-DNN and nested tensors) are
refused by name when registered, before any copier can address bytes outside them."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch

from helpers import small_worker
from kvtier.transfer import KVCacheRegistration, KVTensor


def _packed(dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensor creation is deprecated in torch
        return torch.quantize_per_tensor(torch.zeros(64, 2, 16), 0.1, 0, dtype)


@pytest.mark.parametrize("dtype", [torch.quint4x2, torch.quint2x4])
def test_a_packed_dtype_whose_blocks_reach_past_its_storage_is_refused(dtype: torch.dtype) -> None:
    q = _packed(dtype)
    # One byte per element by element_size(), fewer in the storage: block 63's page lay past
    # its end, and the compiled worker copied it (out of bounds) and reported success.
    assert q.element_size() * q.numel() > q.untyped_storage().nbytes()
    with pytest.raises(ValueError, match=rf"dtype {dtype}.*storage holds") as info:
        KVTensor(q, "mla")
    assert "packs several elements per byte" in str(info.value)
    # One byte per element in storage (qint8), and a view ending at its storage's last byte,
    # still fit.
    kvs = [KVTensor(_packed(torch.qint8), "mla"), KVTensor(torch.zeros(80, 2, 16)[16:], "mla")]
    assert KVCacheRegistration(kvs).page_bytes() == 32 + 128


_NOT_STRIDED: dict[str, Callable[[], torch.Tensor]] = {
    "sparse": lambda: torch.zeros(4, 2, 3).to_sparse(),
    "sparse_csr": lambda: torch.zeros(4, 6).to_sparse_csr(),
    "mkldnn": lambda: torch.zeros(4, 2, 3).to_mkldnn(),
    "nested": lambda: torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(2, 3)]),
}


@pytest.mark.parametrize("kind", sorted(_NOT_STRIDED))
def test_a_tensor_that_is_not_strided_is_refused_by_its_layout(kind: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype in torch
        tensor = _NOT_STRIDED[kind]()
    # Before: a sparse tensor was "not densely packed" with strides (0, 0, 0), a nested one
    # a RuntimeError "Internal error ... Please file an issue" from torch.
    with pytest.raises(ValueError, match=r"needs a dense \(torch\.strided\) tensor"):
        KVTensor(tensor, 0)


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
@pytest.mark.parametrize("bad", ["12", b"12", 5], ids=["str", "bytes", "int"])
def test_wait_names_ids_that_are_not_an_iterable_of_ids(native: bool, bad: object) -> None:
    """`wait("12")` read the ids '1' and '2' and named '1' as the bad value; `wait(5)` failed
    on a bare "'int' object is not iterable"."""
    transfer = small_worker(native)
    try:
        transfer.submit_store(1, [0], [0])
        with pytest.raises(TypeError, match=rf"job_ids={bad!r} is a {type(bad).__name__}; "):
            transfer.wait(bad)  # type: ignore[arg-type]
        transfer.wait([1])  # still usable
        assert [(r.job_id, r.success) for r in transfer.get_finished()] == [(1, True)]
    finally:
        transfer.shutdown()
