"""The CUDA worker over the stand-in driver (c/fake_cuda.c, as test_native_c.py runs it): a
second `shutdown()`, from another thread while the first waits for launched copies, returns
only once they have ended and are reported (it returned at once, with nothing reported)."""

from __future__ import annotations

from pathlib import Path

from helpers import run_over_fake_cuda

SCRIPT = """
import ctypes, threading, time
from worker_check import COMPUTE, FAKE, fake_cuda_worker

w, _ = fake_cuda_worker(coalesce_depth=0)
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


def test_a_second_cuda_shutdown_waits_for_the_launched_copies(tmp_path: Path) -> None:
    out = run_over_fake_cuda(tmp_path, SCRIPT, timeout=120)
    assert "got [(1, True), (2, True)]" in out, out
