"""The CUDA worker's compiled path when the driver fails under it, over c/fake_cuda.c wrapped
with two faults: the engine's context can no longer be made current (`cuCtxSetCurrent`
refused, as for a destroyed context), and a poisoned context (every query and synchronize
reports the sticky error, as after an illegal address).

A poll that could not make the context current returned nothing, so the jobs it should have
reported were never reported; and a `wait` whose driver call failed returned as if the jobs
were done. Now such jobs are reported failed, each once, and such a wait raises. A launch
thread that could not make the context current as it started (one starting late, while it
could not be) failed every later job of its lane; it now asks again before each batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import run_over_fake_cuda

WRAPPER = r"""
#define cuCtxGetCurrent fake_ctx_get
#define cuCtxSetCurrent fake_ctx_set
#include "fake_cuda.c"
#undef cuCtxGetCurrent
#undef cuCtxSetCurrent

#define CONTEXT_LOST 201 /* CUDA_ERROR_INVALID_CONTEXT */

static int lost; /* no thread can make the engine's context current */

void fake_lose_context(int on) {
    pthread_mutex_lock(&mu);
    lost = on;
    pthread_mutex_unlock(&mu);
}

/* The driver's sticky error of a poisoned context, from now on. */
void fake_poison(int code) {
    pthread_mutex_lock(&mu);
    sticky = code;
    changed();
    pthread_mutex_unlock(&mu);
}

static int is_lost(void) { LOCKED(int, lost); }

/* Contexts current per thread, as the driver's are (the fake's is one for the process): a
 * thread other than the one that asked has none until it sets one. */
static int per_thread;
static pthread_t asker;
static __thread int set_here;

void fake_per_thread_contexts(void) {
    pthread_mutex_lock(&mu);
    per_thread = 1, asker = pthread_self();
    pthread_mutex_unlock(&mu);
}

static int has_none(void) {
    pthread_mutex_lock(&mu);
    int none = per_thread && !pthread_equal(pthread_self(), asker) && !set_here;
    pthread_mutex_unlock(&mu);
    return none;
}

CUresult cuCtxGetCurrent(void **ctx) {
    if (!is_lost() && !has_none())
        return fake_ctx_get(ctx);
    *ctx = NULL; /* the calling thread has none current */
    return OK;
}

static int refusals; /* the next so many calls that set a context fail */

void fake_refuse_ctx_sets(int n) {
    pthread_mutex_lock(&mu);
    refusals = n;
    pthread_mutex_unlock(&mu);
}

int fake_refusals_left(void) { LOCKED(int, refusals); }

CUresult cuCtxSetCurrent(void *ctx) {
    pthread_mutex_lock(&mu);
    int refused = ctx && refusals > 0 ? refusals-- : 0;
    pthread_mutex_unlock(&mu);
    if (refused || (is_lost() && ctx))
        return CONTEXT_LOST;
    CUresult r = fake_ctx_set(ctx);
    set_here = r == OK && ctx;
    return r;
}
"""

CHILD = r"""
import sys, time

from worker_check import FAKE, fake_cuda_worker

if sys.argv[1] == "late":
    # The main thread has the context current; each launch thread sets it as it starts.
    FAKE.fake_per_thread_contexts()
    FAKE.fake_refuse_ctx_sets(3)
w, _ = fake_cuda_worker(coalesce_depth=int(sys.argv[2]))


def finished(n):
    # Results as they come (a launch thread may launch a job after a poll), for up to 5 s.
    got, until = [], time.monotonic() + 5
    while len(got) < n and time.monotonic() < until:
        got += [(r.job_id, r.success) for r in w.get_finished()]
        time.sleep(0.01)
    return sorted(got)


def wait_error(ids):
    try:
        w.wait(ids)
    except RuntimeError as exc:
        return str(exc)
    return None


w.submit_store(1, [0], [0])
w.submit_store(2, [1], [1])
w.submit_load(3, [2], [5])
if sys.argv[1] == "lost":
    FAKE.fake_lose_context(1)
    got = finished(3)
    assert got == [(1, False), (2, False), (3, False)], got
    assert w.get_finished() == [] and not any(w.holds(j) for j in (1, 2, 3))
    FAKE.fake_lose_context(0)
    w.submit_store(4, [3], [3])
    FAKE.fake_lose_context(1)
    error = wait_error([4])
    assert error is not None and "store jobs [4] (CUresult 201)" in error, error
    assert w.holds(4)
    assert finished(1) == [(4, False)]
    FAKE.fake_lose_context(0)
    w.submit_store(5, [4], [4])  # the engine goes on once its context is back
    w.wait([5])
    got = [(r.job_id, r.success) for r in w.get_finished()]
    assert got == [(5, True)], got
elif sys.argv[1] == "late":
    # Each launch thread could not enter as it started (it may start late, while a context
    # cannot be made current); it asks again, rather than fail every job of its lane.
    w.wait([1, 2, 3])
    got = sorted((r.job_id, r.success) for r in w.get_finished())
    assert FAKE.fake_refusals_left() == 0, "a launch thread never tried to enter"
    assert got == [(1, True), (2, True), (3, True)], got
else:
    FAKE.fake_poison(700)  # CUDA_ERROR_ILLEGAL_ADDRESS
    error = wait_error([1, 3])
    assert error is not None, "a failed wait returned as if the jobs were done"
    assert "store jobs [1] (CUresult 700)" in error and "load jobs [3] (CUresult 700)" in error
    assert all(w.holds(j) for j in (1, 2, 3))  # still in flight: reported below
    got = finished(3)
    assert got == [(1, False), (2, False), (3, False)], got
    assert w.get_finished() == []
    assert wait_error([1, 3]) is None  # reported: no longer in flight
w.shutdown()
print("ok")
"""


@pytest.mark.parametrize(
    ("fault", "depth"),
    # "late": launch threads (depth > 0) that could not enter as they started.
    [("lost", 0), ("lost", 2), ("poisoned", 0), ("poisoned", 2), ("late", 2)],
)
def test_jobs_under_a_lost_or_poisoned_context_are_reported_failed_and_a_failed_wait_raises(
    tmp_path: Path, fault: str, depth: int
) -> None:
    out = run_over_fake_cuda(tmp_path, CHILD, fault, str(depth), wrapper=WRAPPER)
    assert out.strip() == "ok"
