"""`request_finished(release=True)` stopped part-way, and a released request's failed load.

An interrupt (KeyboardInterrupt, at any point where CPython delivers one) inside the release
left the request tracked with some of its jobs already mapped as released: when such a job
was the last to complete, the request was neither reported in `sending` (the engine, told
nothing, holds its blocks as after any error there) nor forgotten, for good. And the blocks of
a load that failed and was not yet taken were reported in `failed_load_blocks` after the
release had given them back to the engine, which may have handed them to other requests."""

from __future__ import annotations

import pytest

import kvtier.connector.scheduler as scheduler_module
from engine_sim import block_hashes, stored_manager
from helpers import interrupt_at
from kvtier.base import ReqContext, TransferResult
from kvtier.connector import OffloadingScheduler, StepProgress
from kvtier.cpu import CPUOffloadingManager
from kvtier.policies import LRUPolicy

TPB = 4
ENDED: list[str] = []


class _Ends(LRUPolicy):
    """LRU that records the id of every request whose end it hears of, in `ENDED`."""

    def on_request_finished(self, ctx: ReqContext) -> None:
        ENDED.append(ctx.req_id)
        super().on_request_finished(ctx)


def _two_stores() -> tuple[CPUOffloadingManager, OffloadingScheduler, list[int]]:
    """Request "a" with a store in flight in each of two KV-cache groups."""
    m = CPUOffloadingManager(16, _Ends)
    s = OffloadingScheduler(m, tokens_per_block=TPB, groups=(0, 1))
    s.add_request("a", block_hashes("a", 2), 2 * TPB + 1)
    assert s.get_num_new_matched_tokens("a", 0) == 0
    s.update_state_after_alloc("a", [[1, 2], [3, 4]], 0)
    step = s.build_step_metadata([StepProgress("a", [[1, 2], [3, 4]], 2 * TPB)])
    return m, s, [job.job_id for job in step.stores]


@pytest.mark.parametrize("order", [1, -1], ids=["first-job-last", "last-job-last"])
def test_an_interrupt_in_the_release_leaves_the_request_held_or_released(order: int) -> None:
    for n in range(10_000):
        ENDED.clear()
        m, s, jobs = _two_stores()
        fired: list[str] = []
        released = None
        try:
            with interrupt_at(n, fired, scheduler_module.__file__):
                released = s.request_finished("a", release=True)
        except KeyboardInterrupt:
            assert fired
        if not fired:
            assert released is False and n > 20  # that many points were tried
            break
        # The engine got no answer; a request still tracked as running is finished again,
        # one tracked as finished is held until it is in `sending`.
        tracked = s._requests.get("a")
        if tracked is not None and not tracked.finished:
            assert s.request_finished("a", release=True) is False
            tracked = None
        held = tracked is not None
        s.on_worker_results([TransferResult(j, True) for j in jobs[::-order]])
        where = f"after an interrupt at {fired[0]}"
        assert ("a" in s.take_finished().sending) == held, where
        assert s.num_requests() == 0 and s.num_jobs_in_flight() == 0, where
        assert not s.has_fences() and not s._released, where
        stats = m.get_stats()
        assert (stats.pending_writes, stats.stores) == (0, 4), where
        assert ENDED.count("a") <= 1, where
    else:
        pytest.fail("request_finished never ran to its end")


def test_a_released_request_does_not_report_the_blocks_of_its_failed_load() -> None:
    """Its load failed, and stores of the chunks after it were planned, before the engine
    took the failure: released, its blocks may hold other requests' KV by the next
    `take_finished`, which reports the failure but not the blocks (as for a request that
    finishes with no job, or is preempted)."""
    hashes = block_hashes("a", 4)
    s = OffloadingScheduler(stored_manager(16, hashes[:2]), tokens_per_block=TPB)
    s.add_request("a", hashes, 4 * TPB + 1)
    assert s.get_num_new_matched_tokens("a", 0) == 2 * TPB
    s.update_state_after_alloc("a", [[10, 11, 12, 13]], 2 * TPB)
    (load,) = s.build_step_metadata().loads
    s.on_worker_results([TransferResult(load.job_id, False)])
    step = s.build_step_metadata([StepProgress("a", [[10, 11, 12, 13]], 4 * TPB)])
    assert step.stores
    assert s.request_finished("a", release=True) is False
    done = s.take_finished()
    assert done.failed_loads == {"a"} and done.failed_load_blocks == set()
