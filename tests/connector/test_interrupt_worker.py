"""The worker half under an interrupt (KeyboardInterrupt) while it hands a job to the transfer
worker, over the real scheduler half, manager and CPU transfer workers.

Ctrl-C in a notebook interrupts the cell, and the user goes on: the interrupted job must
still be reported exactly once, by the transfer worker if it queued the job (the interrupt
may come as its submit returns), else by the worker half, failed, as a refusal is. Were it
never reported, its keys would stay pending (or pinned) for good, and a later prompt with the
same prefix would wait for them forever. The transfer workers' own side is
tests/transfer/test_interrupt.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from engine_sim import BLOCK_SHAPE, block_hashes
from helpers import LibWith, interrupt_once
from kvtier.base import LookupResult, ReqContext, TransferResult, make_offload_key
from kvtier.connector import OffloadingScheduler, OffloadingWorker, StepMetadata, StepProgress
from kvtier.cpu import CPUOffloadingManager
from kvtier.transfer import (
    CPUTransferWorker,
    HostPool,
    KVCacheRegistration,
    KVTensor,
    NativeCPUTransferWorker,
    TransferWorker,
)
from kvtier.transfer.native import library, submit_extension

TPB = BLOCK_SHAPE[1]  # tokens per block

# Where the interrupt comes, and whether the job is queued by then.
POINTS = {
    "submit_entry": False,  # as the transfer worker's submit_* is called
    "engine_return": True,  # inside it, as its engine's (or copy queue's) submit returns
    "submit_return": True,  # as submit_* returns
}


def _transfer(backend: str) -> TransferWorker:
    if backend != "python" and library() is None:
        pytest.skip("the compiled copy engine cannot be built here")
    if backend == "extension" and submit_extension() is None:
        pytest.skip("the submit extension cannot be built here (no Python headers?)")
    kv = torch.zeros((16, *BLOCK_SHAPE))
    reg = KVCacheRegistration([KVTensor(kv, "flashinfer")])
    pool = HostPool(reg, 1, num_slots=8)
    if backend == "python":
        return CPUTransferWorker(reg, pool)
    w = NativeCPUTransferWorker(reg, pool)
    if backend == "ctypes":
        w._ext_submit = None
    return w


def _arm(w: TransferWorker, point: str, kind: str) -> None:
    if point != "engine_return":
        name = "submit_load" if kind == "load" else "submit_store"
        when = "before" if point == "submit_entry" else "after"
        setattr(w, name, interrupt_once(getattr(w, name), when))
    elif isinstance(w, CPUTransferWorker):
        w._submit = interrupt_once(w._submit, "after")  # type: ignore[method-assign]
    else:
        assert isinstance(w, NativeCPUTransferWorker)
        if w._ext_submit is not None:
            w._ext_submit = interrupt_once(w._ext_submit, "after")
        else:
            fn = interrupt_once(w._lib.kvt_engine_submit_ids, "after")
            w._lib = LibWith(w._lib, kvt_engine_submit_ids=fn)  # type: ignore[assignment]


def _drain(worker: OffloadingWorker, s: OffloadingScheduler) -> list[TransferResult]:
    """Report results to `s` until no job is in flight (or 10 s pass); returns them all."""
    got: list[TransferResult] = []
    deadline = time.monotonic() + 10
    while True:
        results = worker.get_finished()
        s.on_worker_results(results)  # raises ValueError on a job reported twice
        got += results
        if s.num_jobs_in_flight() == 0 or time.monotonic() > deadline:
            return got
        time.sleep(0.005)


@pytest.mark.parametrize("kind", ["store", "load"])
@pytest.mark.parametrize("point", list(POINTS))
@pytest.mark.parametrize("backend", ["python", "extension", "ctypes"])
def test_an_interrupted_submit_is_reported_exactlyinterrupt_once(
    backend: str, point: str, kind: str
) -> None:
    m = CPUOffloadingManager(8)
    s = OffloadingScheduler(m, tokens_per_block=TPB)
    with _transfer(backend) as transfer:
        worker = OffloadingWorker(transfer)
        hashes = block_hashes("a", 2)
        s.add_request("a", hashes, 2 * TPB + 1)
        meta = s.build_step_metadata([StepProgress("a", [[0, 1, 2]], 2 * TPB)])
        run: Callable[[StepMetadata], None] = worker.finish_step
        if kind == "load":  # store the prefix, then load it for another request
            worker.finish_step(meta)
            _drain(worker, s)
            s.add_request("b", hashes, 2 * TPB + 1)
            assert s.get_num_new_matched_tokens("b", 0) == 2 * TPB
            s.update_state_after_alloc("b", [[4, 5, 6]], 2 * TPB)
            meta = s.build_step_metadata()
            run = worker.start_step
        (job,) = meta.loads if kind == "load" else meta.stores
        _arm(transfer, point, kind)
        with pytest.raises(KeyboardInterrupt):
            run(meta)
        run(meta)  # fed again, as the HF integration does after an interrupt: skipped
        results = _drain(worker, s)

    queued = POINTS[point]
    assert [(r.job_id, r.success) for r in results] == [(job.job_id, queued)]
    assert s.num_jobs_in_flight() == 0
    stats = m.get_stats()
    assert (stats.pinned, stats.pending_writes) == (0, 0)
    if kind == "store":
        ready = LookupResult.HIT if queued else LookupResult.MISS
        ctx = ReqContext("probe")
        assert [m.lookup(make_offload_key(h, 0), ctx) for h in hashes] == [ready, ready]
    else:
        done = s.take_finished()
        assert "b" in done.recving
        assert ("b" in done.failed_loads) is not queued
