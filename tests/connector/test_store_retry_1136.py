"""A store that finds no room is offered again at the request's next step, as vLLM's own
connector does: the slots that loads pin and stores write free up as those transfers end."""

from __future__ import annotations

from engine_sim import block_hashes
from kvtier.base import TransferResult
from kvtier.connector import OffloadingScheduler, StepProgress
from kvtier.connector.metadata import StepMetadata
from kvtier.cpu import CPUOffloadingManager

C = block_hashes("c", 3)


def _done(s: OffloadingScheduler, meta: StepMetadata) -> None:
    s.on_worker_results([TransferResult(j.job_id, True) for j in (*meta.loads, *meta.stores)])


def _tier_with_a_load_in_flight(groups: int) -> tuple[OffloadingScheduler, CPUOffloadingManager]:
    """Three slots per group: `a` stored one chunk, and `b`'s load of it (planned, not yet
    done) pins that chunk, so two slots per group are free and none can be evicted."""
    m = CPUOffloadingManager(3 * groups)
    s = OffloadingScheduler(m, tokens_per_block=4, groups=tuple(range(groups)))
    a = block_hashes("a", 1)
    s.add_request("a", a, 5)
    assert s.get_num_new_matched_tokens("a", 0) == 0
    _done(s, s.build_step_metadata([StepProgress("a", [[0, 1]] * groups, 4)]))
    assert not s.request_finished("a")
    s.add_request("b", block_hashes("b", 1, a), 9)
    assert s.get_num_new_matched_tokens("b", 0) == 4
    s.update_state_after_alloc("b", [[2, 3, 4]] * groups, 4)
    return s, m


def _c_step(s: OffloadingScheduler, groups: int, computed: int) -> StepMetadata:
    """A step in which `c` (three chunks of prompt) has `computed` tokens done."""
    return s.build_step_metadata([StepProgress("c", [[5, 6, 7, 8]] * groups, computed)])


def _add_c(s: OffloadingScheduler) -> None:
    s.add_request("c", C, 13)
    assert s.get_num_new_matched_tokens("c", 0) == 0


def test_a_store_turned_away_for_room_is_stored_once_the_load_ends() -> None:
    for groups in (1, 2):
        s, m = _tier_with_a_load_in_flight(groups)
        _add_c(s)
        meta = _c_step(s, groups, 12)  # three chunks per group; two slots per group free
        assert meta.stores == []
        assert len(meta.loads) == groups
        assert m.get_stats().stores_no_room == 3 * groups
        _done(s, meta)  # b's load ends: a's chunk may be evicted now
        assert not s.request_finished("b")
        meta = _c_step(s, groups, 12)
        assert len(meta.stores) == groups, "c's chunks were not offered again"
        assert all(j.device_blocks.tolist() == [5, 6, 7] for j in meta.stores)
        _done(s, meta)
        assert not s.request_finished("c")
        # A later request with c's prefix is served from the tier.
        s.add_request("d", block_hashes("d", 1, C), 17)
        assert s.get_num_new_matched_tokens("d", 0) == 12


def test_the_retry_also_offers_the_chunks_computed_since() -> None:
    s, m = _tier_with_a_load_in_flight(1)
    s.add_request("e", block_hashes("e", 1), 5)  # its store takes one of the two free slots
    assert s.get_num_new_matched_tokens("e", 0) == 0
    _add_c(s)
    first = s.build_step_metadata(
        [StepProgress("e", [[9, 10]], 4), StepProgress("c", [[5, 6, 7, 8]], 8)]
    )
    assert [j.req_id for j in first.stores] == ["e"]  # c's two chunks: one slot left
    _done(s, first)  # b's load and e's store end
    meta = _c_step(s, 1, 12)  # c has computed a third chunk since
    assert [j.device_blocks.tolist() for j in meta.stores] == [[5, 6, 7]]
    _done(s, meta)
    assert not s.request_finished("c")
    s.add_request("d", block_hashes("d", 1, C), 17)
    assert s.get_num_new_matched_tokens("d", 0) == 12
    stats = m.get_stats()
    assert (stats.pinned, stats.pending_writes, stats.used_slots) == (0, 0, 3)


def test_a_request_that_ends_while_turned_away_leaves_nothing_behind() -> None:
    s, m = _tier_with_a_load_in_flight(1)
    _add_c(s)
    meta = _c_step(s, 1, 12)
    assert meta.stores == []
    assert not s.request_finished("c")  # nothing in flight: its blocks go back at once
    _done(s, meta)
    assert not s.request_finished("b")
    meta = s.build_step_metadata([])
    assert meta.stores == [] and meta.loads == []
    stats = m.get_stats()
    assert (stats.pinned, stats.pending_writes, stats.used_slots) == (0, 0, 1)


def test_an_offer_larger_than_the_tier_is_not_offered_again() -> None:
    m = CPUOffloadingManager(2)
    s = OffloadingScheduler(m, tokens_per_block=4)
    _add_c(s)
    for _ in range(3):
        assert _c_step(s, 1, 12).stores == []
    stats = m.get_stats()
    assert (stats.used_slots, stats.pending_writes, stats.evictions) == (0, 0, 0)
    # Turned away with nothing pinned or being written: three chunks never fit two slots.
    assert stats.stores_no_room == 3
    assert not s.request_finished("c")


def test_a_store_is_tried_again_only_once_room_has_grown() -> None:
    s, m = _tier_with_a_load_in_flight(1)
    _add_c(s)
    meta = _c_step(s, 1, 12)
    assert meta.stores == [] and m.get_stats().stores_no_room == 3
    for _ in range(3):  # b's load is still in flight: nothing can have freed a slot
        assert _c_step(s, 1, 12).stores == []
    assert m.get_stats().stores_no_room == 3
    # Another request's store takes one of the two free slots: less room than before.
    s.add_request("e", block_hashes("e", 1), 5)
    assert s.get_num_new_matched_tokens("e", 0) == 0
    e_meta = s.build_step_metadata([StepProgress("e", [[9, 10]], 4)])
    assert len(e_meta.stores) == 1
    assert _c_step(s, 1, 12).stores == [] and m.get_stats().stores_no_room == 3
    # b's load ends, but e's store is in flight: as much room as when c was turned away.
    _done(s, meta)
    assert _c_step(s, 1, 12).stores == [] and m.get_stats().stores_no_room == 3
    _done(s, e_meta)  # e's store ends too: its chunk and a's may be evicted
    stored = _c_step(s, 1, 12).stores
    assert [j.device_blocks.tolist() for j in stored] == [[5, 6, 7]]
    assert m.get_stats().stores_no_room == 3
