"""A cache policy raising while the connector cancels a request's unsent jobs (its `unpin`,
called by the manager's `complete_load`): the error propagates, and the scheduler stays usable.
Before: the job left the jobs in flight but stayed queued to be sent, so every later
`build_step_metadata` raised KeyError, and a finished request stayed tracked for good."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvtier.base import OffloadKey, ReqContext, TransferResult
from kvtier.connector import OffloadingScheduler, StepProgress
from kvtier.cpu import CPUOffloadingManager
from kvtier.policies.lru import LRUPolicy

HASHES = [bytes([i + 1]) * 32 for i in range(2)]


class UnpinFails(LRUPolicy):
    armed = False

    def unpin(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        if self.armed:
            raise RuntimeError("policy bug in unpin")
        super().unpin(keys, ctx)


def _unsent_load() -> tuple[OffloadingScheduler, CPUOffloadingManager]:
    """Request "w" stored two chunks; request "r" has a load of them planned, not yet sent."""
    manager = CPUOffloadingManager(8, UnpinFails)
    s = OffloadingScheduler(manager, tokens_per_block=4)
    s.add_request("w", HASHES, 9)
    meta = s.build_step_metadata([StepProgress("w", [[0, 1, 2]], 8)])
    s.on_worker_results([TransferResult(j.job_id, True) for j in meta.stores])
    assert s.request_finished("w") is False
    s.add_request("r", HASHES, 9)
    n = s.get_num_new_matched_tokens("r", 0)
    assert n == 8
    s.update_state_after_alloc("r", [[4, 5, 6]], n)
    return s, manager


def _policy(manager: CPUOffloadingManager) -> UnpinFails:
    policy = manager.policy
    assert isinstance(policy, UnpinFails)
    return policy


def test_finished_with_an_unsent_load_the_request_ends_and_steps_go_on() -> None:
    s, manager = _unsent_load()
    _policy(manager).armed = True
    with pytest.raises(RuntimeError, match="policy bug in unpin"):
        s.request_finished("r")
    _policy(manager).armed = False
    assert s.num_requests() == 0 and s.num_jobs_in_flight() == 0
    meta = s.build_step_metadata()
    assert not meta.loads and not meta.stores
    # Another request with the same prefix is still offered it and loads it.
    s.add_request("q", HASHES, 9)
    assert s.get_num_new_matched_tokens("q", 0) == 8
    s.update_state_after_alloc("q", [[7, 8, 9]], 8)
    loads = s.build_step_metadata([StepProgress("q", [[7, 8, 9]], 0)]).loads
    assert [job.req_id for job in loads] == ["q"]
    s.on_worker_results([TransferResult(job.job_id, True) for job in loads])
    assert "q" in s.take_finished().recving


def test_preempted_with_an_unsent_load_the_preemption_still_applies() -> None:
    s, manager = _unsent_load()
    _policy(manager).armed = True
    with pytest.raises(RuntimeError, match="policy bug in unpin"):
        s.request_preempted("r")
    _policy(manager).armed = False
    assert s.num_jobs_in_flight() == 0
    meta = s.build_step_metadata()
    assert not meta.loads and not meta.wait_for
    # Readmitted, it is offered the chunks again, as after any preemption.
    assert s.get_num_new_matched_tokens("r", 0) == 8
    assert s.request_finished("r") is False
    assert s.num_requests() == 0
