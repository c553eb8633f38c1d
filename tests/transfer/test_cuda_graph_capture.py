"""A CUDA worker's submit while the current stream is being captured into a CUDA graph: the
event it records on that stream, and its lane's wait for it, would have joined the graph, so
the job became part of the graph instead of copying. Now such a submit raises, naming graph
capture, before anything is queued; once the capture ends the same job id goes through.

Over c/fake_cuda.c wrapped with `cuStreamIsCapturing` (the compiled path, every submit route),
and on a GPU with a real capture (every path, torch ops included)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import run_over_fake_cuda
from kvtier.transfer import HostPool, KVCacheRegistration
from kvtier.transfer.cuda_worker import CUDATransferWorker
from kvtier.transfer.testing import make_layout

WRAPPER = r"""
#include "fake_cuda.c"

static uintptr_t captured; /* the stream being captured (0: none) */
static int capture_status, capture_checks;

void fake_capture(uintptr_t stream, int status) {
    pthread_mutex_lock(&mu);
    captured = stream, capture_status = status;
    pthread_mutex_unlock(&mu);
}

int fake_capture_checks(void) { LOCKED(int, capture_checks); }

CUresult cuStreamIsCapturing(void *stream, int *status) {
    pthread_mutex_lock(&mu);
    capture_checks++;
    *status = captured && (uintptr_t)stream == captured ? capture_status : 0;
    pthread_mutex_unlock(&mu);
    return OK;
}
"""

CHILD = r"""
import ctypes, sys

import numpy as np

from worker_check import COMPUTE, FAKE, fake_cuda_worker
from kvtier.transfer.testing import assert_block_equals, snapshot

route, depth = sys.argv[1], int(sys.argv[2])
options = {"fault_injector": lambda job_id, direction: None} if route == "planned" else {}
w, kvs = fake_cuda_worker(coalesce_depth=depth, **options)
before = snapshot(kvs)
ids = (lambda v: [np.int64(i) for i in v]) if route == "ctypes" else list
capture = lambda stream, status: FAKE.fake_capture(ctypes.c_size_t(stream), status)
submits = {
    1: lambda: w.submit_store(1, ids([3]), ids([0])),
    2: lambda: w.submit_load(2, ids([1]), ids([20])),
    3: lambda: w.submit_load(3, ids([1]), ids([21]), urgent=True),
}

w.submit_store(9, ids([4]), ids([1]))
w.wait([9])
for status in (1, 2):  # CU_STREAM_CAPTURE_STATUS_ACTIVE, _INVALIDATED
    capture(COMPUTE, status)
    for job_id, submit in submits.items():
        try:
            submit()
        except RuntimeError as exc:
            assert "captured into a CUDA graph" in str(exc) and f"job {job_id}" in str(exc), exc
        else:
            raise AssertionError("a submit under graph capture was queued")
        assert not w.holds(job_id)
    assert [w._engine.accepted(lane) for lane in range(3)] == [1, 0, 0]  # job 9 alone

capture(77, 1)  # another stream's capture is not the compute stream's
checks = FAKE.fake_capture_checks()
for submit in submits.values():
    submit()
assert FAKE.fake_capture_checks() - checks == 3  # one driver call a submit
w.wait([1, 2, 3])
got = sorted((r.job_id, r.success) for r in w.get_finished())
assert got == [(1, True), (2, True), (3, True), (9, True)], got
assert_block_equals(kvs, 20, before[4])
assert_block_equals(kvs, 21, before[4])
w.shutdown()
print("ok")
"""


@pytest.mark.parametrize("depth", [0, 2])
@pytest.mark.parametrize("route", ["extension", "ctypes", "planned"])
def test_a_submit_under_graph_capture_is_refused_and_one_after_it_runs(
    tmp_path: Path, route: str, depth: int
) -> None:
    out = run_over_fake_cuda(tmp_path, CHILD, route, str(depth), wrapper=WRAPPER, timeout=120)
    assert out.strip() == "ok", out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "options",
    [{"compiled": True}, {"compiled": True, "coalesce_depth": 2}, {"compiled": False}],
    ids=["compiled", "coalesced", "torch"],
)
def test_a_submit_under_a_real_graph_capture_is_refused(options: dict[str, Any]) -> None:
    kvs = make_layout("flash", torch.float16, "cuda", seed=3)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, num_slots=4, pin=True)
    scratch = torch.zeros(1, device=reg.device)
    graph = torch.cuda.CUDAGraph()
    with CUDATransferWorker(reg, pool, **options) as w:
        error = None
        with torch.cuda.graph(graph):
            scratch.add_(1)  # a node, so that the graph is not empty
            try:
                w.submit_store(1, [0], [0])
            except RuntimeError as exc:
                error = str(exc)
        assert error is not None and "captured into a CUDA graph" in error, error
        assert not w.holds(1)
        w.submit_store(1, [0], [0])
        w.wait([1])
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
    pool.close()
