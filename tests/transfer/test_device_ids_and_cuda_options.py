"""Argument types the transfer API took elsewhere and refused here: the CUDA worker's
`coalesce_depth` and `stage_bytes` as numpy integers or 0-d integer tensors (refused as "not
valid", where every other size takes them through `checked_int`), and ids held in device
memory (a CUDA tensor: numpy cannot read it, so a submit raised torch's TypeError, and `wait`
read it one id, and one device sync, at a time).

No GPU is needed: `_OnDevice` is a CPU tensor that answers where kvtier looks as a CUDA tensor
does (not on the CPU, no numpy view, `.cpu()` gives a host copy). The CUDA worker itself runs
over c/fake_cuda.c, as in test_cuda_grid_limits.py."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, ClassVar, cast

import numpy as np
import pytest
import torch

from helpers import run_over_fake_cuda
from kvtier.transfer import HostPool, KVCacheRegistration, native
from kvtier.transfer.cpu_worker import CPUTransferWorker
from kvtier.transfer.cuda_worker import CUDATransferWorker, check_cuda_options
from kvtier.transfer.factory import make_transfer_worker
from kvtier.transfer.native_worker import NativeCPUTransferWorker
from kvtier.transfer.testing import assert_block_equals, make_layout, snapshot
from kvtier.transfer.worker import TransferWorker


class _OnDevice(torch.Tensor):
    """Ids as a CUDA tensor presents them; counts the host reads of one id and of them all."""

    reads: ClassVar[dict[str, int]] = {"one": 0, "all": 0}

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the "
            "tensor to host memory first."
        )

    def __index__(self) -> int:
        _OnDevice.reads["one"] += 1  # on a GPU: a copy to the host and a device sync each
        return super().__index__()

    def cpu(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        _OnDevice.reads["all"] += 1
        return self.as_subclass(torch.Tensor).clone()


def on_device(ids: list[int]) -> Any:
    """`ids` as a stand-in CUDA tensor."""
    return torch.tensor(ids).as_subclass(_OnDevice)


def _setup() -> tuple[KVCacheRegistration, HostPool]:
    reg = KVCacheRegistration(make_layout("flash", torch.float16))
    return reg, HostPool(reg, 1, num_slots=4)


@pytest.mark.parametrize("depth", [np.int64(2), np.uint8(2), torch.tensor(2)])
def test_the_cuda_worker_takes_an_integer_scalar_coalesce_depth(depth: object) -> None:
    assert check_cuda_options("auto", None, depth) == 2
    assert type(check_cuda_options("auto", None, depth)) is int
    reg, pool = _setup()
    # Past the option checks, as far as the device check.
    with pytest.raises(ValueError, match="needs KV tensors on a CUDA device"):
        CUDATransferWorker(reg, pool, coalesce_depth=cast(Any, depth))
    with make_transfer_worker(reg, pool, "cpu", coalesce_depth=depth) as w:
        w.submit_store(1, [0], [0])
        w.wait([1])
        assert [r.success for r in w.get_finished()] == [True]


@pytest.mark.parametrize("depth", [torch.tensor(True), np.int64(9), torch.tensor([2])])
def test_an_integer_scalar_coalesce_depth_is_still_range_checked(depth: object) -> None:
    reg, pool = _setup()
    with pytest.raises(ValueError, match=r"coalesce_depth=.* is not valid.*0 .off. to 8"):
        CUDATransferWorker(reg, pool, coalesce_depth=cast(Any, depth))


@pytest.mark.parametrize("stage", [True, 0, -1, 2.0, "1M", torch.tensor(True), np.int64(0)])
def test_the_cuda_worker_refuses_a_bad_stage_bytes_itself(stage: object) -> None:
    # Only the factory checked it: built directly, the worker took True (or 0) as 1 byte.
    reg, pool = _setup()
    with pytest.raises(ValueError, match=r"stage_bytes=.* must be a positive int"):
        CUDATransferWorker(reg, pool, stage_bytes=cast(Any, stage))


@pytest.mark.parametrize("stage", [np.int64(1 << 20), torch.tensor(1 << 20)])
def test_the_cuda_worker_takes_an_integer_scalar_stage_bytes(stage: object) -> None:
    reg, pool = _setup()
    with pytest.raises(ValueError, match="needs KV tensors on a CUDA device"):
        CUDATransferWorker(reg, pool, stage_bytes=cast(Any, stage))


@pytest.mark.parametrize("worker", ["python", "native"])
def test_submits_take_ids_in_device_memory(worker: str) -> None:
    kvs = make_layout("flash", torch.float16)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 2, num_slots=4)
    before = snapshot(kvs)
    w: TransferWorker
    if worker == "native":
        if native.library() is None:
            pytest.skip("no compiled copy engine here")
        w = NativeCPUTransferWorker(reg, pool)
    else:
        w = CPUTransferWorker(reg, pool)
    with w:
        w.submit_store(1, on_device([0, 1, 2, 3]), on_device([2, 0]))
        w.wait([1])
        w.submit_load(2, on_device([0]), on_device([9, 8]), skip_blocks=0)
        w.wait([2])
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True), (2, True)]
    assert_block_equals(kvs, 9, before[2])
    assert_block_equals(kvs, 8, before[3])


def test_wait_reads_ids_in_device_memory_in_one_copy() -> None:
    gate = threading.Event()
    reg, pool = _setup()
    with CPUTransferWorker(reg, pool, fault_injector=lambda j, d: gate.wait(30)) as w:
        w.submit_store(1, [0], [0])
        w.submit_store(2, [1], [1])
        _OnDevice.reads.update(one=0, all=0)
        threading.Timer(0.05, gate.set).start()
        w.wait(on_device([1, 2]))
        assert _OnDevice.reads == {"one": 0, "all": 1}
        # It waited: both results are there without polling again.
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True), (2, True)]


CHILD = r"""
import sys

sys.path.insert(0, sys.argv[1])  # this file's folder
import numpy as np
import torch
from worker_check import fake_cuda_worker
from test_device_ids_and_cuda_options import on_device
from kvtier.transfer.testing import assert_block_equals, snapshot

w, kvs = fake_cuda_worker(1, 4, coalesce_depth=torch.tensor(2), stage_bytes=np.int64(1 << 20))
before = snapshot(kvs)
assert w.copy_path == "compiled" and w.coalesce_depth == 2 and type(w.coalesce_depth) is int
w.submit_store(1, on_device([3, 5]), on_device([0, 1]))
w.wait(on_device([1]))
w.submit_load(2, on_device([1]), on_device([7]))
w.wait(on_device([2]))
got = [(r.job_id, r.success) for r in w.get_finished()]
w.shutdown()
assert got == [(1, True), (2, True)], got
assert_block_equals(kvs, 7, before[5])
w.pool.pinned = False
print("ok")
"""


def test_the_compiled_cuda_worker_takes_scalar_options_and_device_ids(tmp_path: Path) -> None:
    assert run_over_fake_cuda(tmp_path, CHILD, str(Path(__file__).parent)).strip() == "ok"


@pytest.mark.parametrize("backend", ["cpu", "python"])
@pytest.mark.parametrize("stage", [np.int64(1 << 16), torch.tensor(1 << 16)])
def test_the_factory_takes_an_integer_scalar_stage_bytes(
    backend: str, stage: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The factory's own check refused these before any backend saw them.
    if backend == "python":
        monkeypatch.setattr("kvtier.transfer.factory.library", lambda: None)
    reg, pool = _setup()
    with make_transfer_worker(reg, pool, "cpu", stage_bytes=cast(Any, stage)) as w:
        w.submit_store(1, [0], [0])
        w.wait([1])
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
    with pytest.raises(ValueError, match=r"stage_bytes=.* must be a positive int"):
        make_transfer_worker(reg, pool, "cpu", stage_bytes=cast(Any, np.int64(0)))
