"""The CUDA worker over the stand-in driver (c/fake_cuda.c, as test_native_c.py runs it): a
second `shutdown()`, from another thread while the first waits for launched copies, returns
only once they have ended and are reported (it returned at once, with nothing reported)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.transfer import native

HARNESSES = Path(__file__).with_name("c")
HOST_CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")

SCRIPT = """
import ctypes, sys, threading, time
sys.path.insert(0, sys.argv[1])
import torch
from worker_check import COMPUTE, FAKE, stand_in_for_the_gpu
from kvtier.transfer import HostPool, KVCacheRegistration
from kvtier.transfer.cuda_worker import CUDATransferWorker
from kvtier.transfer.testing import make_layout

reg = KVCacheRegistration(make_layout("flash", torch.float16, "cpu", seed=5))
pool = HostPool(reg, 1, num_slots=8, pin=False)
reg.device = torch.device("cuda", 0)
pool.pinned = True
stand_in_for_the_gpu(pool)
w = CUDATransferWorker(reg, pool, copy_mode="kernel", compiled=True, coalesce_depth=0)
FAKE.fake_hold(ctypes.c_size_t(COMPUTE), 1)  # the stores wait for compute that has not run
w.submit_store(1, [3], [0])
w.submit_store(2, [4], [1])
first = threading.Thread(target=w.shutdown)
first.start()
while not w._closed:
    time.sleep(0.001)
threading.Timer(0.3, FAKE.fake_hold, (ctypes.c_size_t(COMPUTE), 0)).start()
w.shutdown()
got = sorted((r.job_id, r.success) for r in w.get_finished())
first.join(30)
print("got", got)
"""


@pytest.mark.skipif(HOST_CC is None, reason="needs a C compiler")
def test_a_second_cuda_shutdown_waits_for_the_launched_copies(tmp_path: Path) -> None:
    if native.library() is None or native.submit_extension() is None:
        pytest.skip("the library or the submit extension does not build here")
    assert HOST_CC is not None
    fake = tmp_path / "libcuda.so.1"
    subprocess.run(
        [*HOST_CC.split(), "-O1", "-fPIC", "-shared", "-pthread", "-Wl,-soname,libcuda.so.1",
         "-o", str(fake), str(HARNESSES / "fake_cuda.c")],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(HARNESSES)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "got [(1, True), (2, True)]" in out.stdout, out.stdout + out.stderr
