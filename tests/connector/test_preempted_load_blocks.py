"""A preempted request's failed load names no device blocks: the engine freed them at the
preemption and may have given them to other requests, whose KV `failed_load_blocks` would then
call invalid. The request is still reported (`recving`, `failed_loads`); it recomputes anyway.
The randomized check is tests/connector/test_scheduler_model.py's fuzz."""

from __future__ import annotations

import pytest

from engine_sim import block_hashes
from kvtier.base import TransferResult
from kvtier.connector import OffloadingScheduler, StepProgress
from kvtier.cpu import CPUOffloadingManager

TPB = 4


def cached_prefix(workers: int = 1) -> tuple[CPUOffloadingManager, OffloadingScheduler]:
    """A scheduler whose host tier holds the two chunks of request "a"'s prompt."""
    m = CPUOffloadingManager(8)
    s = OffloadingScheduler(m, tokens_per_block=TPB, num_workers=workers)
    s.add_request("a", block_hashes("a", 2), 2 * TPB + 1)
    assert s.get_num_new_matched_tokens("a", 0) == 0
    s.update_state_after_alloc("a", [[0, 1, 2]], 0)
    (store,) = s.build_step_metadata([StepProgress("a", [[0, 1, 2]], 2 * TPB)]).stores
    for w in range(workers):
        s.on_worker_results([TransferResult(store.job_id, True)], worker=w)
    assert not s.request_finished("a")
    s.take_finished()
    return m, s


def offer(s: OffloadingScheduler, req_id: str, blocks: list[int]) -> None:
    """`req_id` arrives with "a"'s prompt and is offered both chunks, loaded into `blocks`."""
    s.add_request(req_id, block_hashes("a", 2), 2 * TPB + 1)
    assert s.get_num_new_matched_tokens(req_id, 0) == 2 * TPB
    s.update_state_after_alloc(req_id, [blocks], 2 * TPB)


@pytest.mark.parametrize("lost", [False, True], ids=["reported", "fail_unreported"])
def test_a_load_failed_after_its_request_was_preempted_reports_no_blocks(lost: bool) -> None:
    m, s = cached_prefix(workers=2)
    offer(s, "b", [5, 6, 7])
    offer(s, "c", [8, 9, 10])
    meta = s.build_step_metadata()
    load_b, load_c = sorted(meta.loads, key=lambda j: j.req_id)
    assert (load_b.device_blocks.tolist(), load_c.device_blocks.tolist()) == ([5, 6], [8, 9])
    s.request_preempted("b")  # the engine frees blocks 5-7 and may reuse them at once
    assert s.build_step_metadata().wait_for == [load_b.job_id]
    for job in (load_b, load_c):
        s.on_worker_results([TransferResult(job.job_id, True)], worker=0)
    if lost:
        s.fail_unreported(worker=1)
    else:
        s.on_worker_results(
            [TransferResult(load_b.job_id, False), TransferResult(load_c.job_id, False)],
            worker=1,
        )
    done = s.take_finished()
    # Both loads ended failed; only c still owns the blocks its load left without valid KV.
    assert (done.recving, done.failed_loads) == ({"b", "c"}, {"b", "c"})
    assert done.failed_load_blocks == {8, 9}
    assert m.get_stats().pinned == 0
    assert s.load_jobs_failed == 2
    assert s.get_num_new_matched_tokens("b", 0) == 0  # recomputed, not offered again


def test_a_preempted_request_is_reported_again_once_it_loads_anew() -> None:
    """The mark is per job: a later load of the same request, after its preempted one ended,
    reports its own blocks if it fails."""
    _, s = cached_prefix()
    offer(s, "b", [5, 6, 7])
    (first,) = s.build_step_metadata().loads
    s.request_preempted("b")
    s.on_worker_results([TransferResult(first.job_id, True)])
    assert s.take_finished().recving == {"b"}
    assert s.get_num_new_matched_tokens("b", 0) == 2 * TPB
    s.update_state_after_alloc("b", [[11, 12, 13]], 2 * TPB)
    (second,) = s.build_step_metadata().loads
    s.on_worker_results([TransferResult(second.job_id, False)])
    done = s.take_finished()
    assert (done.failed_loads, done.failed_load_blocks) == ({"b"}, {11, 12})


@pytest.mark.parametrize("gives_back", ["request_preempted", "request_finished"])
def test_a_load_failed_at_alloc_names_no_blocks_given_back_before_it_is_taken(
    gives_back: str,
) -> None:
    """A load whose offer is gone at allocation (here: a reset) fails at once; its blocks wait
    for `take_finished`. A preemption or finish before then returns them to the engine."""
    _, s = cached_prefix()
    for req_id in ("b", "c"):
        s.add_request(req_id, block_hashes("a", 2), 2 * TPB + 1)
        assert s.get_num_new_matched_tokens(req_id, 0) == 2 * TPB
    s.reset_cache()
    s.update_state_after_alloc("b", [[5, 6, 7]], 2 * TPB)
    s.update_state_after_alloc("c", [[8, 9, 10]], 2 * TPB)
    if gives_back == "request_preempted":
        s.request_preempted("b")
    else:
        assert not s.request_finished("b")
    done = s.take_finished()
    assert (done.recving, done.failed_loads) == ({"b", "c"}, {"b", "c"})
    assert done.failed_load_blocks == {8, 9}
    assert s.build_step_metadata().loads == []
