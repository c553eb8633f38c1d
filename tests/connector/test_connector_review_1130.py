"""Third review pass of the connector (2026-11-30): calls in an order the engine contract
rules out, and inputs of the wrong kind, are refused before they change anything.

Before: a load could be planned for a request that had finished (or had stores planned since
the offer), beside its jobs in flight; preempting a finished request dropped the report of its
failed load's blocks; a `block_hashes` that was not a sequence failed at the first lookup with
a bare TypeError; a reset whose cache policy raised left running requests never storing their
chunks again; and a worker result of the wrong type raised a bare AttributeError."""

from __future__ import annotations

import hashlib

import pytest

from kvtier.base import TransferResult
from kvtier.connector import OffloadingScheduler, StepProgress
from kvtier.cpu import CPUOffloadingManager
from kvtier.policies.lru import LRUPolicy

TPB = 4
HASHES = [hashlib.sha256(bytes([i])).digest() for i in range(4)]
BLOCKS = [0, 1, 2, 3, 4]


def _stored(s: OffloadingScheduler, req_id: str, num_chunks: int) -> None:
    """Request `req_id` stores its first `num_chunks` chunks and finishes."""
    s.add_request(req_id, HASHES, len(HASHES) * TPB + 1)
    meta = s.build_step_metadata([StepProgress(req_id, [BLOCKS], num_chunks * TPB)])
    s.on_worker_results([TransferResult(j.job_id, True) for j in meta.stores])
    assert s.request_finished(req_id) is False


def _offered_then_stored(finish: bool) -> tuple[OffloadingScheduler, int]:
    """Request "r" is offered two stored chunks, then a step plans a store of its third
    (and, with `finish`, it finishes with that store in flight) before the allocation."""
    s = OffloadingScheduler(CPUOffloadingManager(8), tokens_per_block=TPB)
    _stored(s, "w", 2)
    s.add_request("r", HASHES, len(HASHES) * TPB + 1)
    n = s.get_num_new_matched_tokens("r", 0)
    assert n == 2 * TPB
    meta = s.build_step_metadata([StepProgress("r", [[9, 10, 11, 12, 13]], 3 * TPB)])
    assert len(meta.stores) == 1
    if finish:
        assert s.request_finished("r") is True
    return s, n


@pytest.mark.parametrize("finish", [False, True])
def test_an_allocation_after_the_request_ran_or_finished_plans_no_load(finish: bool) -> None:
    s, n = _offered_then_stored(finish)
    in_flight = s.job_ids_in_flight()
    with pytest.raises(ValueError, match=r"'r'.*(finished|in flight)"):
        s.update_state_after_alloc("r", [BLOCKS], n)
    # Refused with nothing planned: no load beside the store, none in the next step.
    assert s.job_ids_in_flight() == in_flight
    assert s.build_step_metadata().loads == []
    s.on_worker_results([TransferResult(j, True) for j in in_flight])
    done = s.take_finished()
    assert done.recving == set() and done.failed_loads == set()
    assert done.sending == ({"r"} if finish else set())
    stats = s.manager.get_stats()
    assert (stats.pinned, stats.pending_writes, stats.ready) == (0, 0, 3)


def test_preempting_a_finished_request_is_refused_and_keeps_its_failed_blocks() -> None:
    s = OffloadingScheduler(CPUOffloadingManager(8), tokens_per_block=TPB, groups=(0, 1))
    s.add_request("w", HASHES, len(HASHES) * TPB + 1)
    meta = s.build_step_metadata([StepProgress("w", [BLOCKS, BLOCKS], 2 * TPB)])
    s.on_worker_results([TransferResult(j.job_id, True) for j in meta.stores])
    assert s.request_finished("w") is False
    s.add_request("r", HASHES, len(HASHES) * TPB + 1)
    n = s.get_num_new_matched_tokens("r", 0)
    assert n == 2 * TPB
    s.update_state_after_alloc("r", [[20, 21, 22], [30, 31, 32]], n)
    first, second = s.build_step_metadata().loads
    s.on_worker_results([TransferResult(first.job_id, False)])
    assert s.request_finished("r") is True  # the engine holds both groups' blocks
    with pytest.raises(ValueError, match="'r' already finished"):
        s.request_preempted("r")
    assert s.build_step_metadata().wait_for == []
    s.on_worker_results([TransferResult(second.job_id, True)])
    done = s.take_finished()
    assert done.sending == {"r"} and done.failed_loads == {"r"}
    assert done.failed_load_blocks == {20, 21}


@pytest.mark.parametrize(
    "bad",
    [None, 5, b"\x01" * 64, bytearray(64), "abcd"],
    ids=["None", "int", "bytes", "bytearray", "str"],
)
def test_block_hashes_that_are_not_a_sequence_of_hashes_are_refused(bad: object) -> None:
    s = OffloadingScheduler(CPUOffloadingManager(8), tokens_per_block=TPB)
    with pytest.raises(ValueError, match=r"'r'.*block_hashes=.*expected a sequence"):
        s.add_request("r", bad, 13)  # type: ignore[arg-type]
    assert s.num_requests() == 0
    s.add_request("r", HASHES, 13)  # as if the refused call never happened
    assert s.get_num_new_matched_tokens("r", 0) == 0


class _ClearFails(LRUPolicy):
    armed = False

    def clear(self) -> None:
        super().clear()
        if self.armed:
            raise RuntimeError("policy bug in clear")


def test_a_reset_whose_policy_raises_still_stores_every_chunk_again() -> None:
    manager = CPUOffloadingManager(8, _ClearFails)
    s = OffloadingScheduler(manager, tokens_per_block=TPB)
    s.add_request("r", HASHES, len(HASHES) * TPB + 1)
    meta = s.build_step_metadata([StepProgress("r", [BLOCKS], 2 * TPB)])
    s.on_worker_results([TransferResult(j.job_id, True) for j in meta.stores])
    policy = manager.policy
    assert isinstance(policy, _ClearFails)
    policy.armed = True
    with pytest.raises(RuntimeError, match="policy bug"):
        s.reset_cache()
    policy.armed = False
    assert manager.get_stats().ready == 0  # the manager forgot the chunks all the same
    meta = s.build_step_metadata([StepProgress("r", [BLOCKS], 4 * TPB)])
    assert [j.device_blocks.tolist() for j in meta.stores] == [[0, 1, 2, 3]]


@pytest.mark.parametrize("bad", [(1, True), {"job_id": 1, "success": True}, None])
def test_a_worker_result_that_is_not_a_transfer_result_is_refused(bad: object) -> None:
    s = OffloadingScheduler(CPUOffloadingManager(8), tokens_per_block=TPB)
    s.add_request("r", HASHES, len(HASHES) * TPB + 1)
    meta = s.build_step_metadata([StepProgress("r", [BLOCKS], TPB)])
    (job,) = meta.stores
    with pytest.raises(ValueError, match="expected a TransferResult"):
        s.on_worker_results([TransferResult(job.job_id, True), bad])  # type: ignore[list-item]
    assert s.job_ids_in_flight() == [job.job_id]  # the good report was not applied either
    s.on_worker_results([TransferResult(job.job_id, True)])
    assert s.job_ids_in_flight() == [] and s.manager.get_stats().ready == 1
