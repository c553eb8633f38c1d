"""A coalescing lane's batch that borrows the previous batch's end event as its start, when
that batch is polled while the borrowing batch is still being launched (outside the engine's
mutex). Over c/fake_cuda.c, wrapped so that the launch thread parks in `cuStreamWaitEvent`
inside that window, deterministically.

The borrower was marked only once launched, so a submit in the window that filled the ring
to the slot before it reused that slot (the polled batch's): the later job's launch recorded
the borrowed event again, and the borrower's `seconds` came out negative."""

from __future__ import annotations

from pathlib import Path

from helpers import run_over_fake_cuda

WRAPPER = r"""
#define cuStreamWaitEvent fake_stream_wait_event
#include "fake_cuda.c"
#undef cuStreamWaitEvent

static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cv = PTHREAD_COND_INITIALIZER;
static int armed, parked, released;

void gate_arm(void) { pthread_mutex_lock(&gate_mu); armed = 1; pthread_mutex_unlock(&gate_mu); }
int gate_parked(void) {
    pthread_mutex_lock(&gate_mu);
    int p = parked;
    pthread_mutex_unlock(&gate_mu);
    return p;
}
void gate_release(void) {
    pthread_mutex_lock(&gate_mu);
    released = 1;
    pthread_cond_broadcast(&gate_cv);
    pthread_mutex_unlock(&gate_mu);
}

/* The next call once armed parks until released: the launch thread, inside launch_batch. */
CUresult cuStreamWaitEvent(void *stream, void *ev, unsigned flags) {
    pthread_mutex_lock(&gate_mu);
    if (armed) {
        armed = 0, parked = 1;
        while (!released)
            pthread_cond_wait(&gate_cv, &gate_mu);
    }
    pthread_mutex_unlock(&gate_mu);
    return fake_stream_wait_event(stream, ev, flags);
}
"""

CHILD = r"""
import ctypes, time

import numpy as np
import torch

from kvtier.transfer import HostPool, KVCacheRegistration
from kvtier.transfer.native import EngineResult, library, segment_tables
from kvtier.transfer.testing import make_layout

COMPUTE, STORE_STREAM, RING = 9, 1, 64  # cudaengine.c's first ring holds 64 jobs
fake = ctypes.CDLL("libcuda.so.1")
fake.fake_hold.argtypes = [ctypes.c_size_t, ctypes.c_int]
lib = library()
kvs = make_layout("flash", torch.float16, "cpu", seed=3)
reg = KVCacheRegistration(kvs)
pool = HostPool(reg, 1, num_slots=8, pin=False)
page = reg.page_bytes(0)
err = ctypes.create_string_buffer(256)
handle = lib.kvt_cuda_new(ctypes.create_string_buffer(b"image"), (ctypes.c_uint64 * 3)(1, 2, 3),
                          None, 0, 0, 2, err, len(err))
assert handle, err.value
st, _ = segment_tables(reg, pool.address, pool.row_bytes)[0]
table = lib.kvt_cuda_add_table(handle, st.ctypes.data, st.shape[0], st.ctypes.data, 1, 0)
assert lib.kvt_cuda_coalesce(handle, 2) == 0
keep = []


def submit(job_id):
    dst, src = np.array([job_id % 8], np.int64), np.array([job_id % 16], np.int64)
    keep.append((dst, src))
    rc = lib.kvt_cuda_submit(handle, 0, COMPUTE, job_id, 0, table, page, dst.ctypes.data,
                             src.ctypes.data, 1)
    assert rc == 0, rc


def until(cond):
    for _ in range(10000):
        if cond():
            return
        time.sleep(0.001)
    raise AssertionError("timed out")


def poll():
    out = (EngineResult * 256)()
    k = lib.kvt_cuda_poll(handle, out, 256)
    return [(r.job_id, r.ok, r.seconds) for r in out[:k]]


fake.fake_hold(STORE_STREAM, 1)  # the first batch stays queued: the next one borrows its end
submit(1)
until(lambda: fake.fake_launches() == 1)  # its wait for compute is behind it
fake.gate_arm()
submit(2)  # taken, borrows job 1's end, parks in its wait for compute
until(fake.gate_parked)
fake.fake_hold(STORE_STREAM, 0)
fake.fake_run()
first = poll()
assert [j for j, _, _ in first] == [1], first  # job 2 is now the oldest, mid-launch
for j in range(3, RING + 2):  # the last of them lands in the slot before job 2's
    submit(j)
fake.gate_release()
assert lib.kvt_cuda_sync(handle) == 0
rest = poll()
assert [j for j, _, _ in rest] == list(range(2, RING + 2)), rest
assert all(ok for _, ok, _ in first + rest)
secs = dict((j, s) for j, _, s in rest)
want = page * 1e-9  # the fake's clock: 1 ms per MB copied
assert abs(secs[2] - want) < want * 1e-3, (secs[2], want)
lib.kvt_cuda_free(handle)
print("ok")
"""


def test_a_borrowed_start_event_is_not_reused_while_its_batch_launches(tmp_path: Path) -> None:
    out = run_over_fake_cuda(tmp_path, CHILD, wrapper=WRAPPER, needs_extension=False)
    assert out.strip() == "ok"
