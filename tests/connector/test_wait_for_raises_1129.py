"""A step whose `wait_for` wait raises reports its loads failed instead of holding them.

The loads were neither submitted nor ever reported: their pins, device blocks and request
stayed in the scheduler for good, and a later prompt of the prefix found it pinned."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from engine_sim import TOKENS_PER_BLOCK, Engine, Request, assert_clean, block_hashes
from helpers import small_worker
from kvtier.connector import JobKind, OffloadingWorker, StepMetadata, TransferJob

SYSTEM = block_hashes("system", 3)


def test_loads_of_a_step_whose_wait_raised_are_reported_failed(engine: Engine) -> None:
    e = engine
    a = Request("a", block_hashes("a", 1, SYSTEM))
    assert e.add(a) == 0
    e.step()
    e.drain()
    assert not e.finish("a")
    # c's stores are handed over and not yet reported when c is preempted: the next step
    # waits for them before its loads.
    c = Request("c", block_hashes("c", 2))
    assert e.add(c) == 0
    e.step()
    e.preempt("c")
    assert e.scheduler.job_ids_in_flight()  # c's stores, for the next step to wait for
    b = Request("b", block_hashes("b", 1, SYSTEM))
    assert e.add(b) == len(SYSTEM) * TOKENS_PER_BLOCK
    real_wait = e.transfer.wait
    e.transfer.wait = _raises_once(real_wait)  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="the device is gone"):
        e.step()  # its first wait is for c's stores (`wait_for`)
    e.transfer.wait = real_wait  # type: ignore[method-assign]
    e.collect()
    assert "b" in e.last_finished.failed_loads  # the engine recomputes b's prefix
    assert e.loaded_blocks == 0
    e.step()  # b recomputes its prefix and stores its own block
    e.finish("b")
    assert_clean(e)
    # The prefix is neither pinned nor lost: the next request loads it.
    d = Request("d", block_hashes("d", 1, SYSTEM))
    assert e.add(d) == len(SYSTEM) * TOKENS_PER_BLOCK
    e.step()
    e.finish("d")
    assert_clean(e)
    assert e.loaded_blocks == len(SYSTEM)


def test_the_same_step_fed_again_after_its_wait_raised_submits_no_load() -> None:
    """An engine that repeats the step (its error path) must not start the load that was
    reported failed: the engine recomputes into those blocks."""
    transfer = small_worker(False)
    try:
        w = OffloadingWorker(transfer)
        transfer.submit_store(1, [0], [0])
        load = TransferJob(2, JobKind.LOAD, "b", 0, np.array([1]), np.array([3]))
        meta = StepMetadata(loads=[load], wait_for=[1])
        real_wait = transfer.wait
        transfer.wait = _raises_once(real_wait)  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            w.start_step(meta)
        w.start_step(meta)  # the wait works now; the load stays unsubmitted
        assert not transfer.holds(2)
        real_wait([1])
        got = sorted((r.job_id, r.success) for r in w.get_finished())
        assert got == [(1, True), (2, False)]
        w.start_step(meta)  # reported: still skipped, never a second report
        assert w.get_finished() == []
    finally:
        transfer.shutdown()


def _raises_once(wait: Any) -> Any:
    """`wait`, whose first call raises as a failed device sync would."""
    calls = 0

    def call(job_ids: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("the device is gone")
        wait(job_ids)

    return call
