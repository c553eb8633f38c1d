"""The CUDA worker under an interrupt (KeyboardInterrupt). Its compiled submit paths without a
GPU: c/interrupt_check.py runs `CUDATransferWorker` over c/fake_cuda.c (built here as the
`libcuda.so.1` it opens), as test_native_c.py runs c/worker_check.py. Its torch-ops path on a
GPU only. The CPU workers' checks are test_interrupt.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import build_fake_libcuda, interrupt_once
from kvtier.transfer import HostPool, KVCacheRegistration, native
from kvtier.transfer.cuda_worker import CUDATransferWorker
from kvtier.transfer.testing import make_layout

HARNESSES = Path(__file__).with_name("c")
CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@pytest.mark.skipif(CC is None, reason="needs a C compiler")
@pytest.mark.parametrize("depth", [0, 2])
def test_an_interrupted_cuda_submit_keeps_the_engines_count(tmp_path: Path, depth: int) -> None:
    """Before and after the engine's call, on the extension, ctypes and planned routes, for a
    store and an urgent load, with and without launch threads."""
    if native.library() is None or native.submit_extension() is None:
        pytest.skip("the library or the submit extension does not build here")
    assert CC is not None
    build_fake_libcuda(CC, tmp_path, HARNESSES / "fake_cuda.c", HARNESSES)
    # helpers.py, shared with the tests, is one folder up from the harness.
    path = os.pathsep.join(filter(None, [str(HARNESSES.parents[1]), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path), "PYTHONPATH": path}
    out = subprocess.run(
        [sys.executable, str(HARNESSES / "interrupt_check.py"), str(depth)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("when", ["before", "after"])
def test_an_interrupt_in_a_torch_ops_copy_fails_the_jobinterrupt_once(when: str) -> None:
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
