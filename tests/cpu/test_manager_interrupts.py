"""An interrupt (KeyboardInterrupt from Ctrl-C) landing anywhere inside a manager call leaves the
manager consistent, and as before the call or as after it completed: never in between. For
`lookup`, `touch`, `complete_store(success=False)`, `reset_cache` and `on_reset_flushed`; the
hot-path calls (`prepare_load`, `complete_load`, `prepare_store`, `complete_store`) are left
interruptible, as the manager's docstring says, since an atomic commit made them 10-30% slower;
`reset_cache` then recovers the whole pool.

The interrupt is injected at every point of `manager.py`'s frames where CPython can deliver one
(`helpers.interrupt_at`); a twin manager, driven identically without interrupts, gives the
state after the call.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

import pytest

import kvtier.cpu.manager as manager_module
from helpers import interrupt_at, key, keys
from kvtier.base import ReqContext
from kvtier.cpu import CPUOffloadingManager
from kvtier.cpu.spec import CPULoadStoreSpec

MANAGER_FILE = manager_module.__file__
CTX = ReqContext("r1")
_FREE, _PENDING, _READY = -2, -1, 0


def loaded(policy: str, max_events: int) -> CPUOffloadingManager:
    """8 slots: keys 1-4 ready (1 pinned twice, 2 once), 5 and 6 being written, one slot on
    the free list (a failed store), one never used."""
    m = CPUOffloadingManager(8, policy, enable_events=True, max_pending_events=max_events)
    for ids in ((1, 2), (3, 4)):
        out = m.prepare_store(keys(*ids), CTX)
        assert out is not None
        m.complete_store(out.keys_to_store, CTX)
    m.prepare_load(keys(1, 2), CTX)
    m.prepare_load(keys(1), CTX)
    assert m.prepare_store(keys(5, 6, 7), CTX) is not None
    m.complete_store(keys(7), CTX, success=False)
    return m


def reset_with_transfers_in_flight(policy: str, max_events: int) -> CPUOffloadingManager:
    """`loaded`, reset: the pinned and pending keys' slots are quarantined."""
    m = loaded(policy, max_events)
    m.reset_cache()
    return m


Call = Callable[[CPUOffloadingManager], object]
CALLS: dict[str, tuple[Callable[[str, int], CPUOffloadingManager], Call]] = {
    "lookup_hit": (loaded, lambda m: m.lookup(key(3), CTX)),
    "lookup_miss": (loaded, lambda m: m.lookup(key(99), CTX)),
    "lookup_pending": (loaded, lambda m: m.lookup(key(5), CTX)),
    "touch": (loaded, lambda m: m.touch(keys(3, 4), CTX)),
    "complete_store_failed": (loaded, lambda m: m.complete_store(keys(6, 5), CTX, False)),
    "reset_cache": (loaded, lambda m: m.reset_cache()),
    "on_reset_flushed": (reset_with_transfers_in_flight, lambda m: m.on_reset_flushed()),
}


def assert_consistent(m: CPUOffloadingManager) -> None:
    """The manager's tables agree with each other, with its counters and with the policy:
    every slot is in exactly one place, no key can be handed a slot another key holds, and a
    key is an eviction candidate exactly when it is ready and not pinned."""
    slot_of, ref, free, quarantined = m._slot_of, m._ref, m._free, m._quarantined
    mapped = list(slot_of.values())
    places = mapped + free + quarantined
    assert sorted(places) == list(range(m._next_fresh)), "a slot lost or in two places"
    assert all(ref[s] == _FREE for s in free + quarantined + list(range(m._next_fresh, 8)))
    assert all(ref[s] != _FREE for s in mapped)
    assert m._num_pending == sum(ref[s] == _PENDING for s in mapped)
    assert m._num_pinned == sum(ref[s] > 0 for s in mapped)
    candidates = {k for k, s in slot_of.items() if ref[s] == _READY}
    assert {k for k in slot_of if k in m.policy} == candidates
    assert len(m.policy) == len(candidates)


def state(m: CPUOffloadingManager) -> bytes:
    """What the manager holds: its tables, counters and the net effect of its pending events
    (a merge of them changes their form, not what they tell), and the policy's candidates."""
    first: dict[bytes, bool] = {}
    last: dict[bytes, bool] = {}
    for event in m._events or ():
        for k in event.keys:
            first.setdefault(k, event.removed)
            last[k] = event.removed
    events = sorted((k, r) for k, r in last.items() if r == first[k])
    policy = sorted(k for k in m._slot_of if k in m.policy)
    tables = (m._slot_of, m._ref, m._free, m._quarantined, m._next_fresh)
    return pickle.dumps((*tables, m._num_pinned, m._num_pending, m.get_stats(), events, policy))


@pytest.mark.parametrize("max_events", [100, 1], ids=["events", "events_merged"])
@pytest.mark.parametrize("call", CALLS)
def test_an_interrupt_at_any_point_leaves_the_state_before_or_after_the_call(
    policy_name: str, call: str, max_events: int
) -> None:
    setup, run = CALLS[call]
    twin = setup(policy_name, max_events)
    before = state(twin)
    run(twin)
    after = state(twin)
    assert after != before or call.startswith(("lookup", "touch"))
    points: list[str] = []
    for n in range(1000):
        m = setup(policy_name, max_events)
        fired: list[str] = []
        try:
            with interrupt_at(n, fired, MANAGER_FILE):
                run(m)
        except KeyboardInterrupt:
            assert fired
        if not fired:
            break  # every point was tried: the call ran to its end
        points.append(fired[0])
        try:
            assert_consistent(m)
            assert state(m) in (before, after), "neither the state before nor after the call"
        except AssertionError as e:
            raise AssertionError(f"after an interrupt at {fired[0]}") from e
    else:
        pytest.fail("the call never ran to its end")
    assert state(m) == after
    assert len(points) >= 2


HOT_CALLS: dict[str, Call] = {
    "prepare_load": lambda m: m.prepare_load(keys(3, 4), CTX),
    "complete_load": lambda m: m.complete_load(keys(1, 2), CTX),
    "prepare_store_evicting": lambda m: m.prepare_store(keys(20, 21, 22), CTX),
    "complete_store": lambda m: m.complete_store(keys(5, 6), CTX),
}


@pytest.mark.parametrize("call", HOT_CALLS)
def test_a_reset_after_an_interrupted_hot_path_call_recovers_every_slot(
    policy_name: str, call: str
) -> None:
    points = 0
    for n in range(1000):
        m = loaded(policy_name, 100)
        fired: list[str] = []
        try:
            with interrupt_at(n, fired, MANAGER_FILE):
                HOT_CALLS[call](m)
        except KeyboardInterrupt:
            assert fired
        if not fired:
            break
        points += 1
        m.reset_cache()
        m.on_reset_flushed()
        try:
            assert_consistent(m)
            # Every slot can be handed out again, each once.
            out = m.prepare_store(keys(*range(100, 108)), CTX)
            assert out is not None and isinstance(out.store_spec, CPULoadStoreSpec)
            assert sorted(out.store_spec.block_ids.tolist()) == list(range(8))
        except AssertionError as e:
            raise AssertionError(f"after an interrupt at {fired[0]}") from e
    else:
        pytest.fail("the call never ran to its end")
    assert points >= 2
