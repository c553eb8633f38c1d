"""The CUDA worker under an interrupt (KeyboardInterrupt). Its compiled submit paths without a
GPU: c/interrupt_check.py runs `CUDATransferWorker` over c/fake_cuda.c (built here as the
`libcuda.so.1` it opens), as test_native_c.py runs c/worker_check.py. Its torch-ops path on a
GPU only. The CPU workers' checks are test_interrupt.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import HARNESSES, interrupt_once, run_over_fake_cuda
from kvtier.transfer import HostPool, KVCacheRegistration
from kvtier.transfer.cuda_worker import CUDATransferWorker
from kvtier.transfer.testing import make_layout


@pytest.mark.parametrize("depth", [0, 2])
def test_an_interrupted_cuda_submit_keeps_the_engines_count(tmp_path: Path, depth: int) -> None:
    """Before and after the engine's call, on the extension, ctypes and planned routes, for a
    store and an urgent load, with and without launch threads."""
    check = (HARNESSES / "interrupt_check.py").read_text()
    assert run_over_fake_cuda(tmp_path, check, str(depth)).strip() == "ok"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("when", ["before", "after"])
def test_an_interrupt_in_a_torch_ops_copy_fails_the_job(when: str) -> None:
    """The torch-ops path records a job before it queues any copy: interrupted as the copy is
    launched (or just after), the job is held, and reported failed once, after the copies it
    queued have ended."""
    kvs = make_layout("flash", torch.float16, "cuda", seed=1)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 1, num_slots=4, pin=True)
    with CUDATransferWorker(reg, pool, compiled=False, copy_mode="kernel") as w:
        copier = w._lanes["store"].copier
        copier.run = interrupt_once(copier.run, when)  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            w.submit_store(2, [0], [0])
        assert w.holds(2)
        with pytest.raises(ValueError, match="already in flight"):
            w.submit_store(2, [0], [0])
        w.submit_store(3, [1], [1])
        w.wait([2, 3])
        assert sorted((r.job_id, r.success) for r in w.get_finished()) == [(2, False), (3, True)]
        assert not w.holds(2)
    pool.close()
