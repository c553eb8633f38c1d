"""Input checks of the public sizing helpers and of `KVCacheRegistration`'s arguments, and the
host pool's pinning when it fails part way."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from helpers import FakeCudart
from kvtier.transfer import HostPool, KVCacheRegistration, KVTensor


def _reg() -> KVCacheRegistration:
    return KVCacheRegistration([KVTensor(torch.zeros(2, 4, 4, 2, 16), "flash")])


@pytest.mark.parametrize("bpc", [0, -3, np.int64(0)])
def test_slot_bytes_for_refuses_non_positive_blocks_per_chunk(bpc: object) -> None:
    with pytest.raises(ValueError, match=r"blocks_per_chunk=.*must be a positive int"):
        HostPool.slot_bytes_for(_reg(), bpc)  # type: ignore[arg-type]


def test_slot_bytes_for_does_not_wrap_a_numpy_integer() -> None:
    reg = _reg()
    # np.int64(2**60) * 1024 wrapped around to 0 in numpy arithmetic.
    assert HostPool.slot_bytes_for(reg, np.int64(2**60)) == 2**60 * reg.max_page_bytes  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "call",
    [
        lambda: HostPool.slot_bytes_for(None, 1),  # type: ignore[arg-type]
        lambda: HostPool.slots_for_budget(None, 1, 1 << 20),  # type: ignore[arg-type]
    ],
)
def test_sizing_helpers_refuse_a_non_registration(call: object) -> None:
    with pytest.raises(TypeError, match="registration must be a KVCacheRegistration, got NoneType"):
        call()  # type: ignore[operator]


@pytest.mark.parametrize(
    "arg", [KVTensor(torch.zeros(2, 4, 4, 2, 16), "flash"), torch.zeros(2, 4), 3]
)
def test_registration_refuses_a_lone_tensor(arg: object) -> None:
    with pytest.raises(TypeError, match=f"sequence of KVTensor, got {type(arg).__name__}"):
        KVCacheRegistration(arg)  # type: ignore[arg-type]


def test_unhashable_group_is_an_unknown_group() -> None:
    with pytest.raises(ValueError, match=r"group=\[0\] is not registered; groups are \[0\]"):
        _reg().page_bytes([0])  # type: ignore[arg-type]


@pytest.mark.skipif(not hasattr(mmap, "MADV_DONTFORK"), reason="needs MADV_DONTFORK")
def test_a_pin_that_fails_after_registering_unregisters(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool falls back to pageable memory, which nothing unregisters later: the range
    registered before the failure must be unregistered on the spot."""
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(mmap, "MADV_DONTFORK", 0x7FFF)  # an advice madvise refuses (EINVAL)
    with pytest.warns(RuntimeWarning, match="could not pin the 1024-byte host pool"):
        pool = HostPool(_reg(), 1, num_slots=1, pin=True)
    assert not pool.pinned
    assert cudart.registered == [pool.address]
    assert cudart.unregistered == [pool.address]
    pool.close()
    assert cudart.unregistered == [pool.address]  # once, not again at close
