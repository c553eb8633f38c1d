"""`request_finished(release=True)`: a finished request's device blocks go back to the engine
at once while its stores still read them; a later step that is given one of those blocks
waits for the stores first (`blocks_allocated` -> `wait_for`), as vLLM's own connector fences
reused blocks instead of holding them."""

from __future__ import annotations

from typing import Any

from engine_sim import block_hashes, stored_manager
from kvtier.base import ReqContext, TransferResult, make_offload_key
from kvtier.connector import OffloadingScheduler, StepProgress
from kvtier.cpu import CPUOffloadingManager
from kvtier.policies import LRUPolicy

TPB = 4


def _storing(s: OffloadingScheduler, req_id: str, hashes: list[bytes], blocks: list[int]) -> Any:
    """`req_id` computed `len(blocks)` full blocks; return the step with its stores (sent)."""
    s.add_request(req_id, hashes, len(blocks) * TPB + 1)
    assert s.get_num_new_matched_tokens(req_id, 0) == 0
    s.update_state_after_alloc(req_id, [blocks], 0)
    step = s.build_step_metadata([StepProgress(req_id, [blocks], len(blocks) * TPB)])
    assert step.stores
    return step


def test_released_blocks_are_fenced_until_their_store_completes() -> None:
    m = CPUOffloadingManager(16)
    s = OffloadingScheduler(m, tokens_per_block=TPB)
    (store,) = _storing(s, "a", block_hashes("a", 3), [5, 6, 7]).stores
    assert s.request_finished("a", release=True) is False
    assert s.num_requests() == 0 and s.job_ids_in_flight() == [store.job_id]
    # Blocks no store reads: nothing to wait for.
    s.blocks_allocated([1, 2, 8])
    assert s.build_step_metadata().wait_for == []
    # One of the store's blocks given to another request: that step waits for the store.
    s.blocks_allocated([1, 6])
    s.blocks_allocated([7])  # listed once, however many of its blocks are reused
    assert s.build_step_metadata().wait_for == [store.job_id]
    s.on_worker_results([TransferResult(store.job_id, True)])
    # Stored, never reported in `sending` (the engine holds nothing), and no fence is left.
    finished = s.take_finished()
    assert finished.sending == set() and "a" not in finished.recving
    assert m.get_stats().stores == 3
    s.blocks_allocated([5, 6, 7])
    assert s.build_step_metadata().wait_for == []
    assert s.job_ids_in_flight() == []


def test_without_release_the_blocks_are_held_as_before() -> None:
    s = OffloadingScheduler(CPUOffloadingManager(16), tokens_per_block=TPB)
    (store,) = _storing(s, "a", block_hashes("a", 2), [3, 4]).stores
    assert s.request_finished("a") is True
    s.blocks_allocated([3, 4])  # held blocks are never reused: nothing fenced
    assert s.build_step_metadata().wait_for == []
    s.on_worker_results([TransferResult(store.job_id, True)])
    assert s.take_finished().sending == {"a"}


def test_a_request_with_a_load_in_flight_still_holds_its_blocks() -> None:
    """An aborted request whose load is still writing its blocks cannot give them back."""
    hashes = block_hashes("b", 3)
    m = stored_manager(16, hashes[:2])
    s = OffloadingScheduler(m, tokens_per_block=TPB)
    s.add_request("b", hashes, 3 * TPB + 1)
    assert s.get_num_new_matched_tokens("b", 0) == 2 * TPB
    s.update_state_after_alloc("b", [[0, 1, 2, 3]], 2 * TPB)
    (load,) = s.build_step_metadata().loads
    assert s.request_finished("b", release=True) is True
    s.on_worker_results([TransferResult(load.job_id, True)])
    assert "b" in s.take_finished().sending


def test_a_finished_request_without_jobs_holds_nothing_either_way() -> None:
    s = OffloadingScheduler(CPUOffloadingManager(16), tokens_per_block=TPB)
    s.add_request("c", block_hashes("c", 1), 3)
    assert s.request_finished("c", release=True) is False
    assert s.num_requests() == 0


INSERTED: list[tuple[ReqContext | None, int]] = []


class _Recording(LRUPolicy):
    """LRU that records the context and size of every insert in `INSERTED`."""

    def insert(self, keys: Any, ctx: ReqContext | None = None) -> None:
        keys = list(keys)
        INSERTED.append((ctx, len(keys)))
        super().insert(keys, ctx)


def test_the_id_of_a_released_request_may_be_reused_while_its_stores_run() -> None:
    """The engine forgets a released request: its id may come back as a new request's, whose
    jobs and context must not be confused with the old one's."""
    INSERTED.clear()
    m = CPUOffloadingManager(16, _Recording)
    s = OffloadingScheduler(m, tokens_per_block=TPB)
    old = block_hashes("old", 2)
    (store,) = _storing(s, "r", old, [0, 1]).stores
    assert s.request_finished("r", release=True) is False
    new = block_hashes("new", 3)
    (new_store,) = _storing(s, "r", new, [2, 3, 4]).stores
    s.on_worker_results([TransferResult(store.job_id, True)])
    # The old job completed with the old request's context; the new request is untouched.
    ((ctx, n),) = INSERTED
    assert n == 2 and ctx is not None
    assert make_offload_key(old[1], 0) in ctx.key_positions
    assert make_offload_key(new[0], 0) not in ctx.key_positions
    assert s.num_requests() == 1 and s.job_ids_in_flight() == [new_store.job_id]
    assert s.get_num_new_matched_tokens("r", 0) is None  # its own store still in flight
    s.on_worker_results([TransferResult(new_store.job_id, True)])
    assert s.request_finished("r") is False
    assert m.get_stats().stores == 5
    assert s.take_finished().sending == set()


def test_a_failed_or_lost_store_of_a_released_request_frees_its_slots_and_fence() -> None:
    m = CPUOffloadingManager(16)
    s = OffloadingScheduler(m, tokens_per_block=TPB, num_workers=2)
    hashes = block_hashes("f", 2)
    (store,) = _storing(s, "f", hashes, [8, 9]).stores
    assert s.request_finished("f", release=True) is False
    s.on_worker_results([TransferResult(store.job_id, False)], worker=0)
    assert s.fail_unreported(worker=1) == [store.job_id]  # worker 1 died
    assert m.get_stats().pending_writes == 0 and m.get_stats().stores == 0
    assert s.store_jobs_failed == 1
    s.blocks_allocated([8, 9])
    assert s.build_step_metadata().wait_for == []
    key = make_offload_key(hashes[0], 0)
    assert m.prepare_store([key], ReqContext("g")) is not None  # the slots are free again


def test_several_groups_and_chunks_fence_every_block_read() -> None:
    hashes = block_hashes("g", 4)
    m = CPUOffloadingManager(32)
    s = OffloadingScheduler(m, tokens_per_block=TPB, blocks_per_chunk=2, groups=(0, 1))
    s.add_request("g", hashes, 4 * TPB + 1)
    assert s.get_num_new_matched_tokens("g", 0) == 0
    s.update_state_after_alloc("g", [[0, 1, 2, 3], [10, 11, 12, 13]], 0)
    step = s.build_step_metadata([StepProgress("g", [[0, 1, 2, 3], [10, 11, 12, 13]], 4 * TPB)])
    by_group = {job.group: job.job_id for job in step.stores}
    assert s.request_finished("g", release=True) is False
    for block, group in ((3, 0), (12, 1)):
        s.blocks_allocated([block])
        assert s.build_step_metadata().wait_for == [by_group[group]]
