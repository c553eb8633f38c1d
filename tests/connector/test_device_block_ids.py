"""Device block ids from the engine are checked before any job is planned: a float was
truncated to another block (a store then announced that block's KV as the chunk's, and a later
request loaded it as good KV), and a negative id reached the worker, which only failed the job."""

from __future__ import annotations

import pytest

from engine_sim import block_hashes
from kvtier.base import TransferResult
from kvtier.connector import OffloadingScheduler, StepProgress
from kvtier.cpu import CPUOffloadingManager

TPB = 4


def _scheduler() -> tuple[CPUOffloadingManager, OffloadingScheduler]:
    m = CPUOffloadingManager(8)
    return m, OffloadingScheduler(m, tokens_per_block=TPB)


@pytest.mark.parametrize("bad", [1.5, -1, 2.0, "1"], ids=["fraction", "negative", "float", "str"])
def test_a_bad_block_id_in_a_store_is_refused_with_nothing_reserved(bad: object) -> None:
    m, s = _scheduler()
    s.add_request("a", block_hashes("a", 2), 2 * TPB + 1)
    assert s.get_num_new_matched_tokens("a", 0) == 0
    s.update_state_after_alloc("a", [[0, 1, 2]], 0)
    with pytest.raises(ValueError, match=rf"request 'a': group 0 has device block id {bad!r}"):
        s.build_step_metadata([StepProgress("a", [[0, bad, 2]], 2 * TPB)])  # type: ignore[list-item]
    stats = m.get_stats()
    assert (stats.used_slots, stats.pending_writes) == (0, 0)
    assert s.num_jobs_in_flight() == 0
    # Corrected, the same chunks are stored from the right blocks.
    (store,) = s.build_step_metadata([StepProgress("a", [[0, 1, 2]], 2 * TPB)]).stores
    assert store.device_blocks.tolist() == [0, 1]


@pytest.mark.parametrize("bad", [0.5, -3], ids=["fraction", "negative"])
def test_a_bad_block_id_in_a_load_is_refused_and_the_offer_stands(bad: object) -> None:
    m, s = _scheduler()
    hashes = block_hashes("a", 2)
    s.add_request("a", hashes, 2 * TPB + 1)
    s.update_state_after_alloc("a", [[0, 1, 2]], 0)
    (store,) = s.build_step_metadata([StepProgress("a", [[0, 1, 2]], 2 * TPB)]).stores
    s.on_worker_results([TransferResult(store.job_id, True)])
    assert not s.request_finished("a")
    s.add_request("b", hashes, 2 * TPB + 1)
    assert s.get_num_new_matched_tokens("b", 0) == 2 * TPB
    with pytest.raises(ValueError, match=rf"request 'b': group 0 has device block id {bad!r}"):
        s.update_state_after_alloc("b", [[5, bad, 7]], 2 * TPB)  # type: ignore[list-item]
    assert m.get_stats().pinned == 0
    assert s.num_jobs_in_flight() == 0
    s.update_state_after_alloc("b", [[5, 6, 7]], 2 * TPB)
    (load,) = s.build_step_metadata([]).loads
    assert load.device_blocks.tolist() == [5, 6]
