"""`kvt_cuda_wait_for`'s waiter thread (cudaengine.c), over c/fake_cuda.c, and c/waiter_check.c
under ThreadSanitizer and AddressSanitizer with UndefinedBehaviorSanitizer.

- The one waiter thread blocked on the latest job a caller wanted (`want`, a lane's maximum):
  a caller waiting for an earlier job of that lane was not woken when that job ended, nor one
  waiting on another lane while the thread blocked on the first. Each answered -1 only at its
  timeout (in Python's 50 ms slices, a wait ended up to a slice late). Each lane now has its
  own waiter thread, which waits for the lane's batches in order.
- A failed wait's CUresult stuck to its job: asked again once the job had finished, the wait
  still failed (and `CUDATransferWorker.wait` raised), until a poll took the job.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import HARNESSES, run_over_fake_cuda

# The fake's next `cuEventSynchronize` fails at once when armed: a wait that failed.
FAILING_SYNC = r"""
#define cuEventSynchronize fake_event_synchronize
#include "fake_cuda.c"
#undef cuEventSynchronize

static int fail_next; /* guarded by the fake's mutex */

void fake_fail_next_sync(void) {
    pthread_mutex_lock(&mu);
    fail_next = 1;
    pthread_mutex_unlock(&mu);
}

CUresult cuEventSynchronize(void *ev) {
    pthread_mutex_lock(&mu);
    int fail = fail_next;
    fail_next = 0;
    pthread_mutex_unlock(&mu);
    return fail ? 719 /* CUDA_ERROR_LAUNCH_FAILED */ : fake_event_synchronize(ev);
}
"""

SETUP = r"""
import ctypes, sys, threading, time

import numpy as np

from kvtier.transfer.native import EngineResult, library

W, COMPUTE, STREAMS = 64, 9, (1, 2, 3)
fake = ctypes.CDLL("libcuda.so.1")
fake.fake_hold.argtypes = [ctypes.c_size_t, ctypes.c_int]
lib = library()
wait_for = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64
)(("kvt_cuda_wait_for", lib))
host = np.zeros((64, W), np.uint8)
dev = (np.arange(64 * W, dtype=np.uint64).reshape(64, W) % 251 + 1).astype(np.uint8)
seg = np.array([[host.ctypes.data, W, dev.ctypes.data, W, W]], np.uint64)  # a store
err = ctypes.create_string_buffer(256)
handle = lib.kvt_cuda_new(ctypes.create_string_buffer(b"image"), (ctypes.c_uint64 * 3)(*STREAMS),
                          None, 0, 0, 2, err, len(err))
assert handle, err.value
table = lib.kvt_cuda_add_table(handle, seg.ctypes.data, 1, seg.ctypes.data, 1, 0)
depth = int(sys.argv[1])
assert depth == 0 or lib.kvt_cuda_coalesce(handle, depth) == 0
keep = []


def submit(lane, row):
    rows = np.array([row], np.int64)
    keep.append(rows)
    assert lib.kvt_cuda_submit(handle, lane, COMPUTE, row, 0, table, W, rows.ctypes.data,
                               rows.ctypes.data, 1) == 0


def until(cond):
    for _ in range(5000):
        if cond():
            return
        time.sleep(0.001)
    raise AssertionError("timed out")


def timed_wait(lane, seq, timeout_s, out):
    start = time.monotonic()
    rc = wait_for(handle, lane, seq, int(timeout_s * 1e9))
    out.append((rc, time.monotonic() - start))


def in_thread(*args):
    out = []
    t = threading.Thread(target=timed_wait, args=(*args, out))
    t.start()
    return t, out


def answer(out):
    rc, took = out[0]
    return f"{rc} {'soon' if took < 1.5 else 'at the timeout'}"
"""

EARLIER_JOB = r"""
# Job 1 waits on its held lane; job 2 also waits for compute that is held longer.
fake.fake_hold(STREAMS[0], 1)
submit(0, 0)
until(lambda: fake.fake_launches() == 1)
fake.fake_run()  # job 1's compute event is recorded
fake.fake_hold(COMPUTE, 1)
submit(0, 1)
later, later_out = in_thread(0, 2, 4.0)  # with depth 1, job 2 is not launched yet
time.sleep(0.2)
earlier, earlier_out = in_thread(0, 1, 3.0)
time.sleep(0.2)
fake.fake_hold(STREAMS[0], 0)  # job 1's copies run; job 2's wait for compute still holds it
fake.fake_run()
earlier.join()
print("earlier job", answer(earlier_out), flush=True)
fake.fake_hold(COMPUTE, 0)
fake.fake_run()
later.join()
print("later job", answer(later_out), flush=True)
assert lib.kvt_cuda_sync(handle) == 0
lib.kvt_cuda_free(handle)
"""

OTHER_LANE = r"""
fake.fake_hold(STREAMS[0], 1)
submit(0, 0)
out = []
timed_wait(0, 1, 0.002, out)  # handed to the waiter thread, which blocks on it
print("held job", out[0][0], flush=True)
fake.fake_hold(STREAMS[1], 1)
submit(1, 1)
other, other_out = in_thread(1, 1, 3.0)
time.sleep(0.2)
fake.fake_hold(STREAMS[1], 0)
fake.fake_run()
other.join()
print("other lane", answer(other_out), flush=True)
fake.fake_hold(STREAMS[0], 0)
assert lib.kvt_cuda_sync(handle) == 0
lib.kvt_cuda_free(handle)
"""

STALE_FAILURE = r"""
fake.fake_hold(STREAMS[0], 1)
submit(0, 0)
fake.fake_fail_next_sync()
out = []
timed_wait(0, 1, 1.0, out)
print("failed wait", out[0][0], flush=True)
fake.fake_hold(STREAMS[0], 0)
fake.fake_run()
assert lib.kvt_cuda_sync(handle) == 0
out = []
timed_wait(0, 1, 1.0, out)
print("asked again once done", out[0][0], flush=True)
res = (EngineResult * 4)()
assert lib.kvt_cuda_poll(handle, res, 4) == 1 and res[0].ok
out = []
timed_wait(0, 1, 1.0, out)
print("asked again once polled", out[0][0], flush=True)
lib.kvt_cuda_free(handle)
"""


@pytest.mark.parametrize("depth", [0, 1])
def test_a_wait_for_an_earlier_job_ends_when_that_job_does(tmp_path: Path, depth: int) -> None:
    """Old: the waiter thread blocked on job 2 (or, with depth 1, waited for its launch), and
    the wait for job 1 answered -1 at its 3 s timeout, its copies long done."""
    out = run_over_fake_cuda(tmp_path, SETUP + EARLIER_JOB, str(depth), needs_extension=False)
    assert out.splitlines() == ["earlier job 0 soon", "later job 0 soon"], out


@pytest.mark.parametrize("depth", [0, 2])
def test_a_wait_on_one_lane_is_not_held_up_by_another_lanes_copies(
    tmp_path: Path, depth: int
) -> None:
    """Old: the one waiter thread blocked on lane 0's held job, and lane 1's finished job
    was answered -1 at the 3 s timeout."""
    out = run_over_fake_cuda(tmp_path, SETUP + OTHER_LANE, str(depth), needs_extension=False)
    assert out.splitlines() == ["held job -1", "other lane 0 soon"], out


@pytest.mark.parametrize("depth", [0, 2])
def test_a_failed_wait_is_not_reported_again_once_the_job_has_finished(
    tmp_path: Path, depth: int
) -> None:
    """Old: the wait asked again once the copies had ended answered 719, the first wait's
    failure."""
    out = run_over_fake_cuda(
        tmp_path, SETUP + STALE_FAILURE, str(depth), wrapper=FAILING_SYNC, needs_extension=False
    )
    lines = out.splitlines()
    assert lines == ["failed wait 719", "asked again once done 0", "asked again once polled 0"], out


# ---- c/waiter_check.c under the sanitizers ----

CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
SANITIZERS = {"thread": ["-fsanitize=thread"], "address": ["-fsanitize=address,undefined"]}


def _sanitizer_builds(cc: str, flags: list[str], tmp_path: Path) -> bool:
    """Whether `cc` builds and runs a threaded program with `flags` here."""
    probe = tmp_path / "probe.c"
    probe.write_text("#include <pthread.h>\nint main(void) { return 0; }\n")
    built = subprocess.run([cc, *flags, "-pthread", "-o", str(tmp_path / "probe"), str(probe)],
                           capture_output=True, timeout=120)  # fmt: skip
    if built.returncode:
        return False
    ran = subprocess.run([str(tmp_path / "probe")], capture_output=True, timeout=60)
    return ran.returncode == 0


@pytest.mark.parametrize("sanitizer", sorted(SANITIZERS))
def test_the_waiter_thread_under_a_sanitizer(tmp_path: Path, sanitizer: str) -> None:
    """Submits on two lanes (launched by the submitter, then by launch threads of depth 2),
    waits from four threads with short timeouts, polls, peeks and drops, syncs, a lane held
    now and then, and a free while the waiter thread blocks: no race, leak or misuse reported.
    Old: the harness's two lost wake-ups (an earlier job's wait, another lane's) failed it."""
    import kvtier.transfer

    if CC is None:
        pytest.skip("needs a C compiler")
    flags = SANITIZERS[sanitizer]
    if not _sanitizer_builds(CC, flags, tmp_path):
        pytest.skip(f"{CC} cannot build with {' '.join(flags)} here")
    sources = Path(kvtier.transfer.__file__).parent
    # The fake instrumented too: its mutex orders the engine's threads' driver calls.
    common = ["-O1", "-g", "-Wall", "-Werror", "-pthread", *flags, f"-I{sources}"]
    fake = [CC, *common, "-fPIC", "-shared", "-Wl,-soname,libcuda.so.1", "-o",
            str(tmp_path / "libcuda.so.1"), str(HARNESSES / "fake_cuda.c")]  # fmt: skip
    exe = tmp_path / "waiter_check"
    harness = [CC, *common, "-o", str(exe), str(HARNESSES / "waiter_check.c"),
               *(str(sources / n) for n in ("rowcopy.c", "copyengine.c", "cudaengine.c")),
               f"-L{tmp_path}", "-l:libcuda.so.1", f"-Wl,-rpath,{tmp_path}", "-ldl"]  # fmt: skip
    for build in (fake, harness):
        made = subprocess.run(build, capture_output=True, text=True, timeout=300)
        assert made.returncode == 0, made.stderr
    # The fake keeps destroyed events (it catches a use after destroy): not a leak of ours.
    supp = tmp_path / "lsan.supp"
    supp.write_text("leak:cuEventCreate\n")
    env = {**os.environ, "TSAN_OPTIONS": "halt_on_error=1 exitcode=66",
           "ASAN_OPTIONS": "detect_leaks=1", "LSAN_OPTIONS": f"suppressions={supp}",
           "UBSAN_OPTIONS": "halt_on_error=1 print_stacktrace=1"}  # fmt: skip
    for depth in ("0", "2"):
        run = subprocess.run([str(exe), depth], capture_output=True, text=True, timeout=60, env=env)
        assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr
        assert "WARNING:" not in run.stderr and "runtime error" not in run.stderr, run.stderr
