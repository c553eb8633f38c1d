"""`OffloadingScheduler.on_worker_results` stopped part-way by an interrupt (KeyboardInterrupt,
or any BaseException) or by a manager or policy call that raises: the jobs whose effects were
not all applied stay in flight, and `fail_unreported` finishes them (a report not yet applied
counts as a failure), leaving no pin, pending write, held request or lost slot behind.

The interrupt is injected at every point of the scheduler's own code where CPython can deliver
one (`sys.settrace` on the frames of `scheduler.py`; just after each manager call returned
among them), and inside each manager, policy and logging call it makes (a manager call that
raises changes nothing, by the manager's contract).
"""

from __future__ import annotations

import inspect

import pytest

import kvtier.connector.scheduler as scheduler_module
from engine_sim import BLOCK_SHAPE, block_hashes
from helpers import interrupt_at, interrupt_once, key
from kvtier.base import (
    BlockIDsLoadStoreSpec,
    LookupResult,
    ReqContext,
    TransferResult,
    make_offload_key,
)
from kvtier.connector import OffloadingScheduler, StepProgress
from kvtier.cpu import CPUOffloadingManager

TPB = BLOCK_SHAPE[1]  # tokens per block
SLOTS = 8
SCHEDULER_FILE = scheduler_module.__file__


class _Case:
    """One batch of worker reports, completing three jobs of every kind at once: a store sent
    before a `reset_cache` (its slot quarantined until it ends), a store of a request that
    finished first (held), and a failed load."""

    def __init__(self, num_workers: int) -> None:
        m = CPUOffloadingManager(SLOTS)
        s = OffloadingScheduler(m, tokens_per_block=TPB, num_workers=num_workers)
        self.m, self.s, self.num_workers = m, s, num_workers
        s.add_request("c", block_hashes("c", 1), TPB + 1)
        (c_store,) = s.build_step_metadata([StepProgress("c", [[0, 1]], TPB)]).stores
        s.reset_cache()
        self.prefix = block_hashes("p", 2)
        s.add_request("p", self.prefix, 2 * TPB + 1)
        (p_store,) = s.build_step_metadata([StepProgress("p", [[2, 3, 4]], 2 * TPB)]).stores
        self.report_all([TransferResult(p_store.job_id, True)])
        s.add_request("b", self.prefix, 2 * TPB + 1)
        assert s.get_num_new_matched_tokens("b", 0) == 2 * TPB
        s.update_state_after_alloc("b", [[5, 6, 7]], 2 * TPB)
        (b_load,) = s.build_step_metadata().loads
        self.a_hashes = block_hashes("a", 2)
        s.add_request("a", self.a_hashes, 2 * TPB + 1)
        (a_store,) = s.build_step_metadata([StepProgress("a", [[8, 9, 10]], 2 * TPB)]).stores
        assert s.request_finished("a")
        for w in range(num_workers - 1):  # every worker but the last has reported
            s.on_worker_results(
                [
                    TransferResult(c_store.job_id, True, 100),
                    TransferResult(a_store.job_id, True, 200),
                    TransferResult(b_load.job_id, True, 50),
                ],
                worker=w,
            )
        self.batch = [
            TransferResult(a_store.job_id, True, 200),
            TransferResult(b_load.job_id, False),
            TransferResult(c_store.job_id, True, 100),
        ]
        self.before = (s.bytes_stored, s.store_jobs_failed, s.bytes_loaded, s.load_jobs_failed)
        assert m.get_stats().pinned == 2

    def report_all(self, results: list[TransferResult]) -> None:
        for w in range(self.num_workers):
            self.s.on_worker_results(results, worker=w)

    def deliver(self) -> None:
        self.s.on_worker_results(self.batch, worker=self.num_workers - 1)

    def assert_recovered(self, outcome_kept: bool) -> None:
        """After `fail_unreported`: nothing held, every request finishable, every slot usable,
        each job counted once. `outcome_kept`: the held request's store, first in the batch,
        had its report applied before the interrupt, so it succeeded."""
        s, m = self.s, self.m
        s.fail_unreported()
        assert s.num_jobs_in_flight() == 0
        done = s.take_finished()
        assert done.sending == {"a"}  # the held request's blocks are handed back
        assert (done.recving, done.failed_loads) == ({"b"}, {"b"})
        assert done.failed_load_blocks == {5, 6}
        for rid in ("b", "c", "p"):
            assert s.request_finished(rid) is False
        assert s.num_requests() == 0
        st = m.get_stats()
        assert (st.pinned, st.pending_writes) == (0, 0)
        # Each job counted once: as a success with its bytes (from every worker), or failed.
        b0, f0, lb0, lf0 = self.before
        stored, failed = s.bytes_stored - b0, s.store_jobs_failed - f0
        # (bytes per worker, failures) -> whether the held request's store succeeded
        a_ok = {(300, 0): True, (100, 1): False, (200, 1): True, (0, 2): False}[
            (stored // self.num_workers, failed)
        ]
        assert (s.bytes_loaded - lb0, s.load_jobs_failed - lf0) == (0, 1)
        ctx = ReqContext("probe")
        a_hits = [m.lookup(make_offload_key(h, 0), ctx) for h in self.a_hashes]
        want = LookupResult.HIT if a_ok else LookupResult.MISS
        assert a_hits == [want, want]
        assert a_ok or not outcome_kept
        # Every slot is free or evictable, the reset's quarantined one included.
        out = m.prepare_store([key(1000 + i) for i in range(SLOTS)], ctx)
        assert out is not None and isinstance(out.store_spec, BlockIDsLoadStoreSpec)
        assert sorted(out.store_spec.block_ids.tolist()) == list(range(SLOTS))


@pytest.mark.parametrize("num_workers", [1, 2])
def test_an_interrupt_at_any_point_of_the_batch_is_recovered(num_workers: int) -> None:
    points: list[str] = []
    for n in range(10_000):
        case = _Case(num_workers)
        fired: list[str] = []
        try:
            with interrupt_at(n, fired, SCHEDULER_FILE):
                case.deliver()
        except KeyboardInterrupt:
            assert fired
        else:
            assert not fired  # every point was tried: the batch ran to its end
            case.assert_recovered(outcome_kept=True)
            break
        points.append(fired[0])
        try:
            case.assert_recovered(outcome_kept=False)
        except AssertionError as e:
            raise AssertionError(f"not recovered after an interrupt at {fired[0]}") from e
    else:
        pytest.fail("the batch never ran to its end")
    # The injection reached the completion's effects, just after each manager call among them.
    assert sum("_complete" in p for p in points) >= 10
    lines, first = inspect.getsourcelines(OffloadingScheduler._complete)
    for call in ("complete_load(", "complete_store(", "on_reset_flushed()"):
        (n,) = [first + i for i, line in enumerate(lines) if f"self.manager.{call}" in line]
        assert any(f"of line {n}:" in p for p in points), call


# Calls the completion makes into the manager, its policy and logging, each raising once: a
# manager call as it is entered (one that raises changes nothing), a policy call as it returns
# (the manager undoes it), logging as it returns.
CALLS = {
    "complete_store": ("m", "before"),
    "complete_load": ("m", "before"),
    "on_reset_flushed": ("m", "before"),
    "insert": ("policy", "after"),
    "unpin": ("policy", "after"),
    "warning": ("logger", "after"),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_a_manager_policy_or_logging_call_raising_is_recovered_with_the_reported_outcome(
    call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = _Case(1)
    where, when = CALLS[call]
    obj = {"m": case.m, "policy": case.m._policy, "logger": scheduler_module.logger}[where]
    monkeypatch.setattr(obj, call, interrupt_once(getattr(obj, call), when))
    with pytest.raises(KeyboardInterrupt):
        case.deliver()
    # The held request's store, first in the batch, was reported before the raise: kept.
    case.assert_recovered(outcome_kept=True)
