"""A request id the engine reuses once the request that had it is finished: the old request's
pending reports must not be read as the new one's."""

from __future__ import annotations

import pytest

from engine_sim import block_hashes
from kvtier.base import TransferResult
from kvtier.connector import OffloadingScheduler, StepProgress
from kvtier.cpu import CPUOffloadingManager

TPB = 4


def stored(s: OffloadingScheduler, req_id: str, prompt: str, blocks: list[int]) -> None:
    """`req_id` computes and stores `prompt`'s two chunks, then finishes."""
    s.add_request(req_id, block_hashes(prompt, 2), 2 * TPB + 1)
    assert s.get_num_new_matched_tokens(req_id, 0) == 0
    s.update_state_after_alloc(req_id, [blocks], 0)
    (store,) = s.build_step_metadata([StepProgress(req_id, [blocks], 2 * TPB)]).stores
    s.on_worker_results([TransferResult(store.job_id, True)])
    assert not s.request_finished(req_id)


def test_a_reused_id_is_not_reported_for_the_old_requests_failed_load() -> None:
    s = OffloadingScheduler(CPUOffloadingManager(8), tokens_per_block=TPB)
    stored(s, "x", "p1", [0, 1, 2])
    s.take_finished()
    # The old "b" is offered p1, the tier is reset before its blocks are allocated: its load
    # fails at allocation, to be reported at the next take_finished. The engine drops it.
    s.add_request("b", block_hashes("p1", 2), 2 * TPB + 1)
    assert s.get_num_new_matched_tokens("b", 0) == 2 * TPB
    s.reset_cache()
    s.update_state_after_alloc("b", [[5, 6, 7]], 2 * TPB)
    assert not s.request_finished("b")  # nothing held: the id is free again
    stored(s, "y", "p2", [0, 1, 2])
    # A new "b" loads p2; its load is planned, not yet sent.
    s.add_request("b", block_hashes("p2", 2), 2 * TPB + 1)
    assert s.get_num_new_matched_tokens("b", 0) == 2 * TPB
    s.update_state_after_alloc("b", [[8, 9, 10]], 2 * TPB)
    done = s.take_finished()
    assert "b" not in done.recving and "b" not in done.failed_loads
    (load,) = s.build_step_metadata().loads
    s.on_worker_results([TransferResult(load.job_id, True)])
    done = s.take_finished()
    assert (done.recving, done.failed_loads) == ({"b"}, set())


def test_an_id_whose_release_is_still_to_be_reported_is_refused() -> None:
    s = OffloadingScheduler(CPUOffloadingManager(8), tokens_per_block=TPB)
    s.add_request("a", block_hashes("p1", 2), 2 * TPB + 1)
    assert s.get_num_new_matched_tokens("a", 0) == 0
    s.update_state_after_alloc("a", [[0, 1, 2]], 0)
    (store,) = s.build_step_metadata([StepProgress("a", [[0, 1, 2]], 2 * TPB)]).stores
    assert s.request_finished("a")  # held: the store still reads its blocks
    s.on_worker_results([TransferResult(store.job_id, True)])
    with pytest.raises(ValueError, match=r"request .a. finished .* \(take_finished\(\)\.sending\)"):
        s.add_request("a", block_hashes("p2", 2), 2 * TPB + 1)
    assert s.take_finished().sending == {"a"}  # the old request's report, intact
    s.add_request("a", block_hashes("p2", 2), 2 * TPB + 1)
    assert s.num_requests() == 1
