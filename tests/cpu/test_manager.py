"""Scenario tests of CPUOffloadingManager, run against every registered cache policy."""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Iterable

import numpy as np
import pytest

from helpers import key, keys
from kvtier.admission import ReuseAdmission
from kvtier.base import LookupResult, OffloadingEvent, OffloadKey, ReqContext
from kvtier.cpu import CPUOffloadingManager

CTX = ReqContext("req")


def stored(m: CPUOffloadingManager, *ids: int, ctx: ReqContext = CTX) -> list[int]:
    """Store `ids` successfully and return their slots."""
    out = m.prepare_store(keys(*ids), ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)
    return [int(s) for s in out.store_spec.block_ids]  # type: ignore[attr-defined]


def snapshot(m: CPUOffloadingManager) -> tuple[object, ...]:
    """Everything observable about the manager's contents (not the count of keys turned away
    for want of room, which a refused store raises)."""
    return (
        dict(m._slot_of),
        list(m._ref),
        list(m._free),
        m._next_fresh,
        dataclasses.replace(m.get_stats(), stores_no_room=0),
        len(m.policy),
    )


def test_slot_ids_are_co_indexed_with_keys(policy_name: str) -> None:
    m = CPUOffloadingManager(8, policy_name)
    slots = stored(m, 10, 11, 12)
    assert len(set(slots)) == 3
    spec = m.prepare_load(keys(12, 10), CTX)
    assert spec.block_ids.tolist() == [slots[2], slots[0]]


def test_fresh_slots_first_then_recycled(policy_name: str) -> None:
    m = CPUOffloadingManager(3, policy_name)
    assert stored(m, 1, 2) == [0, 1]
    assert stored(m, 3) == [2]
    out = m.prepare_store(keys(4), CTX)
    assert out is not None and len(out.evicted_keys) == 1
    victim_slot = {key(1): 0, key(2): 1, key(3): 2}[out.evicted_keys[0]]
    assert out.store_spec.block_ids.tolist() == [victim_slot]  # type: ignore[attr-defined]


def test_lookup_states(policy_name: str) -> None:
    m = CPUOffloadingManager(4, policy_name)
    assert m.lookup(key(1), CTX) is LookupResult.MISS
    out = m.prepare_store(keys(1), CTX)
    assert out is not None
    assert m.lookup(key(1), CTX) is LookupResult.HIT_PENDING
    m.complete_store(keys(1), CTX)
    assert m.lookup(key(1), CTX) is LookupResult.HIT


def test_store_of_present_keys_stores_and_evicts_nothing(policy_name: str) -> None:
    m = CPUOffloadingManager(2, policy_name)
    stored(m, 1, 2)
    before = snapshot(m)
    out = m.prepare_store(keys(1, 2), CTX)
    assert out is not None
    assert out.keys_to_store == [] and out.evicted_keys == []
    assert snapshot(m) == before


def test_present_keys_of_the_call_are_protected(policy_name: str) -> None:
    m = CPUOffloadingManager(2, policy_name)
    stored(m, 1, 2)
    # Key 1 is in the call, so only key 2 may make room for key 3.
    out = m.prepare_store(keys(1, 3), CTX)
    assert out is not None
    assert out.keys_to_store == keys(3)
    assert out.evicted_keys == keys(2)
    assert m.lookup(key(1), CTX) is LookupResult.HIT


def test_fail_fast_when_everything_is_pinned(policy_name: str) -> None:
    m = CPUOffloadingManager(2, policy_name, enable_events=True)
    stored(m, 1, 2)
    m.prepare_load(keys(1, 2), CTX)
    list(m.take_events())
    before = snapshot(m)
    assert m.prepare_store(keys(3, 4), CTX) is None
    assert snapshot(m) == before
    assert m.get_stats().stores_no_room == 2  # the keys turned away for want of room
    assert list(m.take_events()) == []


def test_pending_writes_are_never_victims(policy_name: str) -> None:
    m = CPUOffloadingManager(2, policy_name)
    assert m.prepare_store(keys(1, 2), CTX) is not None
    assert m.prepare_store(keys(3), CTX) is None
    assert m.get_stats().pending_writes == 2


def test_eviction_is_all_or_nothing(policy_name: str) -> None:
    m = CPUOffloadingManager(3, policy_name)
    stored(m, 1, 2, 3)
    m.prepare_load(keys(1), CTX)
    before = snapshot(m)
    # Three new keys need three victims; only two are evictable.
    assert m.prepare_store(keys(4, 5, 6), CTX) is None
    assert snapshot(m) == before and m.get_stats().stores_no_room == 3
    out = m.prepare_store(keys(4, 5), CTX)
    assert out is not None and sorted(out.evicted_keys) == sorted(keys(2, 3))


def test_pinned_keys_survive_and_unpin_restores_evictability(policy_name: str) -> None:
    m = CPUOffloadingManager(2, policy_name)
    stored(m, 1, 2)
    m.prepare_load(keys(1), CTX)
    m.prepare_load(keys(1), CTX)
    out = m.prepare_store(keys(3), CTX)
    assert out is not None and out.evicted_keys == keys(2)
    m.complete_store(keys(3), CTX)
    m.complete_load(keys(1), CTX)
    assert m.get_stats().pinned == 1  # still pinned by the second load
    m.complete_load(keys(1), CTX)
    assert m.get_stats().pinned == 0
    out = m.prepare_store(keys(4, 5), CTX)
    assert out is not None and sorted(out.evicted_keys) == sorted(keys(1, 3))


def test_failed_store_leaves_no_trace(policy_name: str) -> None:
    m = CPUOffloadingManager(2, policy_name, enable_events=True)
    stored(m, 1)
    list(m.take_events())
    out = m.prepare_store(keys(2), CTX)
    assert out is not None
    m.complete_store(keys(2), CTX, success=False)
    assert m.lookup(key(2), CTX) is LookupResult.MISS
    assert list(m.take_events()) == []
    stats = m.get_stats()
    assert (stats.used_slots, stats.pending_writes, stats.failed_stores) == (1, 0, 1)
    # The slot is free again: two more keys fit after evicting only one.
    out = m.prepare_store(keys(3, 4), CTX)
    assert out is not None and out.evicted_keys == keys(1)


def test_events_removed_before_stored_that_reuses_room(policy_name: str) -> None:
    m = CPUOffloadingManager(1, policy_name, enable_events=True)
    stored(m, 1)
    stored(m, 2)
    assert list(m.take_events()) == [
        OffloadingEvent(keys(1), "CPU", removed=False),
        OffloadingEvent(keys(1), "CPU", removed=True),
        OffloadingEvent(keys(2), "CPU", removed=False),
    ]
    assert list(m.take_events()) == []


def test_events_disabled_by_default(policy_name: str) -> None:
    m = CPUOffloadingManager(2, policy_name)
    stored(m, 1)
    assert list(m.take_events()) == []


def _apply(view: set[OffloadKey], events: Iterable[OffloadingEvent]) -> None:
    """What a router does with the events; a stored key it holds or a removed key it does
    not hold would mean an event was lost or invented."""
    for event in events:
        for k in event.keys:
            if event.removed:
                assert k in view, f"removed {k.hex()} was never announced"
                view.remove(k)
            else:
                assert k not in view, f"stored {k.hex()} twice"
                view.add(k)


def test_merged_events_keep_only_the_net_change(policy_name: str) -> None:
    m = CPUOffloadingManager(1, policy_name, enable_events=True, max_pending_events=2)
    stored(m, 1)
    assert list(m.take_events()) == [OffloadingEvent(keys(1), "CPU", removed=False)]
    stored(m, 2)  # removes 1, stores 2
    stored(m, 3)  # removes 2, stores 3: four events, merged at the third
    # 2 was stored and removed unseen, so it cancels out; 1 and 3 changed for a consumer.
    assert list(m.take_events()) == [
        OffloadingEvent(keys(1), "CPU", removed=True),
        OffloadingEvent(keys(3), "CPU", removed=False),
    ]
    assert m.events_merged == 1


@pytest.mark.parametrize("seed", [0, 1])
def test_events_not_taken_are_merged_without_losing_any(policy_name: str, seed: int) -> None:
    rng = random.Random(seed)
    slots = 6
    eager = CPUOffloadingManager(slots, policy_name, enable_events=True)
    lazy = CPUOffloadingManager(slots, policy_name, enable_events=True, max_pending_events=3)
    eager_view: set[OffloadKey] = set()
    lazy_view: set[OffloadKey] = set()
    for step in range(400):
        ids = rng.sample(range(30), rng.randint(1, 3))
        fail = rng.random() < 0.1
        for m in (eager, lazy):
            if step % 97 == 96:
                m.reset_cache()
                continue
            out = m.prepare_store(keys(*ids), CTX)
            if out is not None and out.keys_to_store:
                m.complete_store(out.keys_to_store, CTX, success=not fail)
        _apply(eager_view, eager.take_events())
        if rng.random() < 0.05:
            _apply(lazy_view, lazy.take_events())
        pending = lazy.table_sizes()["events"]
        assert pending <= 3
        # Merged: at most 2 * slots keys; then at most 3 events, each at most `slots` keys.
        assert sum(len(e.keys) for e in lazy._events or ()) <= 5 * slots
    _apply(lazy_view, lazy.take_events())
    resident = set(eager._slot_of)
    assert eager_view == resident == set(lazy._slot_of) == lazy_view
    assert lazy.events_merged > 0 and eager.events_merged == 0


def test_reset_with_loads_pinned_quarantines_their_slots(policy_name: str) -> None:
    m = CPUOffloadingManager(3, policy_name, enable_events=True)
    slots = stored(m, 1, 2)
    m.prepare_load(keys(1), CTX)
    assert m.prepare_store(keys(3), CTX) is not None  # a write in flight too
    list(m.take_events())
    m.reset_cache()
    assert list(m.take_events()) == [OffloadingEvent(keys(1, 2), "CPU", removed=True)]
    for i in (1, 2, 3):
        assert m.lookup(key(i), CTX) is LookupResult.MISS
    stats = m.get_stats()
    assert (stats.pinned, stats.pending_writes, stats.used_slots) == (0, 0, 2)
    # Only key 2's slot is free: slot of key 1 (pinned) and key 3 (pending) are quarantined.
    out = m.prepare_store(keys(4, 5), CTX)
    assert out is None
    out = m.prepare_store(keys(4), CTX)
    assert out is not None and out.store_spec.block_ids.tolist() == [slots[1]]  # type: ignore[attr-defined]
    m.complete_store(keys(4), CTX)
    m.on_reset_flushed()
    assert m.get_stats().used_slots == 1
    assert m.prepare_store(keys(5, 6), CTX) is not None


def test_stats_count_hits_misses_loads_evictions(policy_name: str) -> None:
    m = CPUOffloadingManager(2, policy_name)
    stored(m, 1, 2)
    m.lookup(key(1), CTX)
    m.lookup(key(9), CTX)
    m.prepare_load(keys(1), CTX)
    m.complete_load(keys(1), CTX)
    stored(m, 3)
    s = m.get_stats()
    assert (s.hits, s.misses, s.loads, s.stores, s.evictions) == (1, 1, 1, 3, 1)
    assert s.usage == 1.0


def test_admission_skips_are_counted_and_cost_nothing(policy_name: str) -> None:
    m = CPUOffloadingManager(2, policy_name, store_threshold=2)
    a, b = ReqContext("a"), ReqContext("b")
    out = m.prepare_store(keys(1), a)
    assert out is not None and out.keys_to_store == []
    assert m.prepare_store(keys(1), a) is not None  # same request: still one sighting
    assert m.get_stats().stores_skipped == 2
    out = m.prepare_store(keys(1), b)
    assert out is not None and out.keys_to_store == keys(1)


def test_custom_admission_object() -> None:
    m = CPUOffloadingManager(2, admission=ReuseAdmission(3))
    for req in "abc":
        out = m.prepare_store(keys(1), ReqContext(req))
        assert out is not None
    assert out is not None and out.keys_to_store == keys(1)


# -- bad arguments: a clear error and no change -------------------------------------------------


@pytest.mark.parametrize("num_slots", [0, -1, 1.5, None, True])
def test_bad_num_slots(num_slots: object) -> None:
    with pytest.raises(ValueError, match=re.escape(f"num_slots={num_slots!r}")):
        CPUOffloadingManager(num_slots)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, 1.5, float("nan"), "10"])
def test_bad_max_pending_events(bad: object) -> None:
    with pytest.raises(ValueError, match=re.escape(f"max_pending_events={bad!r}")):
        CPUOffloadingManager(4, enable_events=True, max_pending_events=bad)  # type: ignore[arg-type]


def test_unknown_policy_lists_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown cache policy 'nope'.*lru"):
        CPUOffloadingManager(4, "nope")


def test_bad_calls_leave_the_manager_unchanged(policy_name: str) -> None:
    m = CPUOffloadingManager(4, policy_name)
    stored(m, 1, 2)
    m.prepare_store(keys(3), CTX)
    before = snapshot(m)
    with pytest.raises(ValueError, match=r"cannot load key .* absent"):
        m.prepare_load([key(1), key(9)], CTX)
    with pytest.raises(ValueError, match="still being written"):
        m.prepare_load(keys(1, 3), CTX)
    with pytest.raises(ValueError, match="no load pinned"):
        m.complete_load(keys(1), CTX)
    with pytest.raises(ValueError, match="no store pending"):
        m.complete_store(keys(3, 1), CTX)
    with pytest.raises(ValueError, match="same key twice"):
        m.complete_store(keys(3, 3), CTX)
    with pytest.raises(TypeError, match="offload keys are bytes"):
        m.prepare_store([key(5), "k"], CTX)  # type: ignore[list-item]
    assert snapshot(m) == before
    m.prepare_load(keys(1), CTX)
    with pytest.raises(ValueError, match="no load pinned"):
        m.complete_load(keys(1, 1), CTX)


def test_from_config_carries_policy_admission_and_events() -> None:
    from kvtier.config import KVTierConfig

    cfg = KVTierConfig(cache_policy="arc", store_threshold=2, enable_events=True)
    m = CPUOffloadingManager.from_config(4, cfg)
    ctx = ReqContext("r")
    # Admission on second sighting: the first offer stores nothing, the second stores the key.
    first = m.prepare_store(keys(1), ctx)
    assert first is not None and first.keys_to_store == []
    second = m.prepare_store(keys(1), ReqContext("s"))
    assert second is not None and second.keys_to_store == keys(1)
    m.complete_store(keys(1), ReqContext("s"))
    assert [e.keys for e in m.take_events()] == [keys(1)]
    quiet = CPUOffloadingManager.from_config(4, cfg, enable_events=False)
    quiet.prepare_store(keys(1), ctx)
    assert list(quiet.take_events()) == []
    assert type(m.policy) is type(CPUOffloadingManager(4, "arc").policy)
    assert type(m.policy) is not type(CPUOffloadingManager(4, "lru").policy)


@pytest.mark.parametrize("bad", [5, "k", None])
def test_non_bytes_keys_get_a_value_error_naming_them(policy_name: str, bad: object) -> None:
    m = CPUOffloadingManager(4, policy_name)
    stored(m, 1)
    m.prepare_store(keys(2), CTX)
    before = snapshot(m)
    # Formatting the key with `.hex()` raised AttributeError for an int or str key.
    with pytest.raises(ValueError, match=f"cannot load key {re.escape(repr(bad))}"):
        m.prepare_load([key(1), bad], CTX)  # type: ignore[list-item]
    with pytest.raises(ValueError, match=f"complete_load of key {re.escape(repr(bad))}"):
        m.complete_load([bad], CTX)  # type: ignore[list-item]
    with pytest.raises(ValueError, match=f"complete_store of key {re.escape(repr(bad))}"):
        m.complete_store([key(2), bad], CTX)  # type: ignore[list-item]
    assert snapshot(m) == before


@pytest.mark.parametrize("bad", ["no", None, 1, 0.0])
def test_complete_store_refuses_a_success_that_is_not_a_bool(policy_name: str, bad: object) -> None:
    m = CPUOffloadingManager(4, policy_name, enable_events=True)
    m.prepare_store(keys(1), CTX)
    before = snapshot(m)
    # "no" used to count as success: key 1 was announced and served, though never written.
    with pytest.raises(ValueError, match=re.escape(f"success={bad!r}")):
        m.complete_store(keys(1), CTX, bad)  # type: ignore[arg-type]
    assert snapshot(m) == before
    assert list(m.take_events()) == []
    assert m.lookup(key(1), CTX) is LookupResult.HIT_PENDING
    m.complete_store(keys(1), CTX, np.bool_(True))  # type: ignore[arg-type]  # a numpy bool is a bool
    assert m.lookup(key(1), CTX) is LookupResult.HIT


def test_one_shot_iterators_of_keys_are_read_once(policy_name: str) -> None:
    m = CPUOffloadingManager(2, policy_name, enable_events=True)
    # Iterators are not the declared Collection: the manager must still read them once.
    out = m.prepare_store(iter(keys(1, 2)), CTX)  # type: ignore[arg-type]
    assert out is not None
    # complete_store read its keys twice: slots became readable, unannounced, never evictable.
    m.complete_store(iter(out.keys_to_store), CTX)  # type: ignore[arg-type]
    assert [e.keys for e in m.take_events()] == [keys(1, 2)]
    assert m.get_stats().stores == 2 and len(m.policy) == 2
    # prepare_load read its keys twice: slots were handed out with nothing pinned.
    spec = m.prepare_load(iter(keys(1)), CTX)  # type: ignore[arg-type]
    assert len(spec) == 1 and m.get_stats().pinned == 1
    # prepare_store read its keys again to protect the present ones while evicting.
    out = m.prepare_store(iter(keys(1, 3)), CTX)  # type: ignore[arg-type]
    assert out is not None and out.evicted_keys == keys(2)
    m.complete_load(iter(keys(1)), CTX)  # type: ignore[arg-type]
    assert m.get_stats().pinned == 0


def test_an_empty_complete_store_announces_nothing(policy_name: str) -> None:
    m = CPUOffloadingManager(2, policy_name, enable_events=True, max_pending_events=2)
    for _ in range(3):
        m.complete_store([], CTX)
    # Empty `stored` events used to fill the backlog and force a merge.
    assert list(m.take_events()) == []
    assert m.events_merged == 0


def test_events_do_not_share_the_callers_evicted_keys(policy_name: str) -> None:
    m = CPUOffloadingManager(1, policy_name, enable_events=True)
    stored(m, 1)
    list(m.take_events())
    out = m.prepare_store(keys(2), CTX)
    assert out is not None and out.evicted_keys == keys(1)
    out.evicted_keys.clear()  # the caller's list to consume
    m.complete_store(keys(2), CTX)
    assert list(m.take_events()) == [
        OffloadingEvent(keys(1), "CPU", removed=True),
        OffloadingEvent(keys(2), "CPU", removed=False),
    ]
