"""The compiled engine's launch threads (coalesce_depth > 0) each make the engine's context
current as they start, and ask again before a batch if that failed. Over c/fake_cuda.c wrapped
so that a thread has no context current until it sets one, the first three sets are refused,
and every launch thread but the first starts 300 ms late.

`kvt_cuda_coalesce` returned before its threads had started: the first thread's refused start
was followed, before the late ones had taken the other refusals, by a refused ask for its first
batch, and that lane's first jobs failed. Whether they did depended on thread timing, so
test_cuda_context_faults.py's "late" case failed now and then. The engine now returns once
every launch thread has tried to enter: the refusals are all taken then, and no job fails."""

from __future__ import annotations

from pathlib import Path

from helpers import run_over_fake_cuda

WRAPPER = r"""
#define cuCtxGetCurrent fake_ctx_get
#define cuCtxSetCurrent fake_ctx_set
#include "fake_cuda.c"
#undef cuCtxGetCurrent
#undef cuCtxSetCurrent
#include <unistd.h>

#define CONTEXT_LOST 201 /* CUDA_ERROR_INVALID_CONTEXT */

static pthread_t asker;
static int armed, refusals, threads_seen;
static __thread int set_here, seen_here;

/* From now on: threads other than the caller have no context current until they set one, the
 * next `n` sets are refused, and each new thread but the first sleeps before its first ask. */
void fake_arm(int n) {
    pthread_mutex_lock(&mu);
    asker = pthread_self(), armed = 1, refusals = n;
    pthread_mutex_unlock(&mu);
}

int fake_refusals_left(void) { LOCKED(int, refusals); }

static int another_thread(void) {
    pthread_mutex_lock(&mu);
    int other = armed && !pthread_equal(pthread_self(), asker);
    pthread_mutex_unlock(&mu);
    return other;
}

CUresult cuCtxGetCurrent(void **ctx) {
    if (another_thread() && !seen_here) {
        seen_here = 1;
        pthread_mutex_lock(&mu);
        int n = threads_seen++;
        pthread_mutex_unlock(&mu);
        if (n)
            usleep(300000); /* a launch thread that starts late */
    }
    if (another_thread() && !set_here) {
        *ctx = NULL;
        return OK;
    }
    return fake_ctx_get(ctx);
}

CUresult cuCtxSetCurrent(void *ctx) {
    pthread_mutex_lock(&mu);
    int refused = ctx && refusals > 0 ? refusals-- : 0;
    pthread_mutex_unlock(&mu);
    if (refused)
        return CONTEXT_LOST;
    CUresult r = fake_ctx_set(ctx);
    set_here = r == OK && ctx;
    return r;
}
"""

CHILD = r"""
import time

from worker_check import FAKE, fake_cuda_worker

FAKE.fake_arm(3)  # one refusal for each launch thread's start
w, _ = fake_cuda_worker(coalesce_depth=2)
w.submit_store(1, [0], [0])
w.submit_load(2, [1], [5])
w.submit_load(3, [2], [6], urgent=True)  # a job in every lane
w.wait([1, 2, 3])
got, until = [], time.monotonic() + 5
while len(got) < 3 and time.monotonic() < until:
    got += [(r.job_id, r.success) for r in w.get_finished()]
    time.sleep(0.01)
assert FAKE.fake_refusals_left() == 0
assert sorted(got) == [(1, True), (2, True), (3, True)], got
w.shutdown()
print("ok")
"""


def test_launch_threads_have_tried_to_enter_before_the_first_submit(tmp_path: Path) -> None:
    out = run_over_fake_cuda(tmp_path, CHILD, wrapper=WRAPPER)
    assert out.strip() == "ok", out
