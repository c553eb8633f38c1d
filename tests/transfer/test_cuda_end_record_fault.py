"""A batch whose end event could not be recorded after its copies were queued: the event keeps
an older state, so `wait` returned at once, as if the job were done, while its copies were
still queued (and poll could report it failed, possibly early); a slot or block reused then
was overwritten by the late copies. Now the engine fails the batch's jobs and drains the
lane's queue before they count as launched: when `wait` returns, the copies have ended.

Over c/fake_cuda.c wrapped so that the first `cuEventRecord` after a kernel launch (a batch's
end event) fails once, when armed."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import run_over_fake_cuda

WRAPPER = r"""
#define cuEventRecord fake_event_record
#define cuLaunchKernel fake_launch_kernel
#define cuStreamSynchronize fake_stream_sync
#include "fake_cuda.c"
#undef cuEventRecord
#undef cuLaunchKernel
#undef cuStreamSynchronize

static int armed, launched_since;

void fake_fail_next_end_record(void) {
    pthread_mutex_lock(&mu);
    armed = 1, launched_since = 0;
    pthread_mutex_unlock(&mu);
}

CUresult cuLaunchKernel(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shmem, void *stream, void **params,
                        void **extra) {
    CUresult r = fake_launch_kernel(fn, gx, gy, gz, bx, by, bz, shmem, stream, params, extra);
    pthread_mutex_lock(&mu);
    launched_since = 1;
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuEventRecord(void *ev, void *stream) {
    pthread_mutex_lock(&mu);
    int fail = armed && launched_since;
    if (fail)
        armed = 0;
    pthread_mutex_unlock(&mu);
    return fail ? 700 /* CUDA_ERROR_ILLEGAL_ADDRESS */ : fake_event_record(ev, stream);
}

/* A stream synchronize outlasts the engine's compute, which a GPU finishes on its own: the
 * harness's hold on it ends (no Python thread could end it while the submit holds the GIL). */
CUresult cuStreamSynchronize(void *stream) {
    fake_hold(9, 0); /* worker_check.COMPUTE */
    return fake_stream_sync(stream);
}
"""

CHILD = r"""
import ctypes
import sys

from worker_check import COMPUTE, FAKE, fake_cuda_worker

w, _ = fake_cuda_worker(coalesce_depth=int(sys.argv[1]))
rows = w.pool.rows
w.submit_store(1, [0], [0])
w.wait([1])
assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
rows[1].fill_(0xAB)  # slot 1 before job 2
# The engine's compute runs on: job 2's copies, which wait for it, stay queued until a
# synchronize outlasts it (the wrapper's cuStreamSynchronize).
FAKE.fake_hold(ctypes.c_size_t(COMPUTE), 1)
FAKE.fake_fail_next_end_record()
w.submit_store(2, [1], [1])
w.wait([2])
# Its copies have ended (they were queued before the record failed): the slot may be reused.
assert not bool((rows[1] == 0xAB).all()), "wait returned before job 2's copies ran"
assert [(r.job_id, r.success) for r in w.get_finished()] == [(2, False)]
w.submit_store(3, [2], [2])  # the lane goes on
w.wait([3])
assert [(r.job_id, r.success) for r in w.get_finished()] == [(3, True)]
w.shutdown()
print("ok")
"""


@pytest.mark.parametrize("depth", [0, 2])
def test_wait_returns_only_once_the_copies_of_a_failed_end_record_ended(
    tmp_path: Path, depth: int
) -> None:
    out = run_over_fake_cuda(tmp_path, CHILD, str(depth), wrapper=WRAPPER, timeout=120)
    assert out.strip() == "ok", out
