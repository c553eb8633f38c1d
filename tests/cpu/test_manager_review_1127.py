"""Review of CPUOffloadingManager against its contract (DESIGN §2): defects found by a random
model check and by reading, each with the scenario that showed it."""

from __future__ import annotations

import pickle
import random
from collections.abc import Collection
from typing import Any

import pytest

from helpers import key, keys
from kvtier.base import LookupResult, OffloadKey, ReqContext
from kvtier.cpu import CPUOffloadingManager
from kvtier.policies.lru import LRUPolicy


class _DropsOneMore(LRUPolicy):
    """A plugin's bug: returns the right victims, and silently drops its oldest other
    candidate too."""

    def evict(self, n: int, protected: Collection[OffloadKey]) -> Any:
        victims = super().evict(n, protected)
        if victims is not None and self._order:
            self._order.popitem(last=False)
        return victims


class _KeepsItsVictims(LRUPolicy):
    """A plugin's bug: returns the right victims but keeps them as candidates."""

    def evict(self, n: int, protected: Collection[OffloadKey]) -> Any:
        victims = super().evict(n, protected)
        if victims is not None:
            self.insert(victims, None)
        return victims


@pytest.mark.parametrize("policy", [_DropsOneMore, _KeepsItsVictims])
def test_a_plugin_evict_that_drops_or_keeps_other_candidates_is_refused(policy: type) -> None:
    """Its answer alone looked right, so the eviction went ahead: a dropped key stayed ready but
    was never evictable again (the pool one slot smaller for good: every later store of 3 keys
    found no room), and a kept victim was a key gone from the tier, so each later evict naming
    it was refused."""
    ctx = ReqContext("a")
    m = CPUOffloadingManager(3, policy)
    for i in range(3):
        out = m.prepare_store([key(i)], ctx)
        assert out is not None
        m.complete_store(out.keys_to_store, ctx)
    before = (dict(m._slot_of), list(m._ref), m.get_stats())
    with pytest.raises(ValueError, match=rf"{policy.__name__}.* went from 3 candidates to"):
        m.prepare_store([key(10)], ctx)
    # Unchanged: every key still held, ready and among the policy's candidates.
    assert (dict(m._slot_of), list(m._ref), m.get_stats()) == before
    assert len(m.policy) == m.get_stats().ready == 3
    assert all(k in m.policy for k in keys(0, 1, 2))
    assert all(m.lookup(k, ctx) is LookupResult.HIT for k in keys(0, 1, 2))


def _state(m: CPUOffloadingManager) -> bytes:
    """Everything the manager holds, its policy's and admission's internals included (their
    order too, which table sizes do not show), but the count of stores turned away."""
    state = dict(vars(m))
    state.pop("_stores_no_room")
    return pickle.dumps(state)


def _refused_call(
    m: CPUOffloadingManager,
    which: int,
    good: list[OffloadKey],
    bad: Any,
    ctx: ReqContext,
    absent: list[OffloadKey],
) -> None:
    """One call the manager must refuse: a key, a context or a success flag that is wrong, or a
    load of keys not ready."""
    if which == 0:
        m.prepare_store([*good, bad], ctx)
    elif which == 1:
        m.prepare_load([*good, bad], ctx)
    elif which == 2:
        m.complete_load([*good, bad], ctx)
    elif which == 3:
        m.complete_store([*good, bad], ctx)
    elif which == 4:
        m.touch([*good, bad], ctx)
    elif which == 5:
        m.prepare_store(good, bad)
    elif which == 6:
        m.complete_store(good, ctx, success=bad)
    else:
        m.prepare_load([*absent, bad], ctx)


@pytest.mark.parametrize("seed", range(3))
def test_refused_calls_and_stores_without_room_change_nothing_inside(
    policy_name: str, seed: int
) -> None:
    """A random run: every call refused for bad input, and every store that finds no room,
    leaves the manager, its cache policy and its admission policy exactly as they were (their
    internal order included); the events replay to the keys the tier holds."""
    rng = random.Random(seed)
    universe = keys(*range(12))
    m = CPUOffloadingManager(
        rng.choice([1, 3, 5]),
        policy_name,
        store_threshold=rng.choice([0, 2]),
        enable_events=True,
        max_pending_events=rng.choice([1, 1000]),
    )
    ctx = ReqContext("r0")
    stores: list[list[OffloadKey]] = []
    loads: list[list[OffloadKey]] = []
    view: set[OffloadKey] = set()
    no_room = 0
    for step in range(600):
        op = rng.randrange(8)
        ready = [k for k, s in m._slot_of.items() if m._ref[s] == 0]
        if op < 3:
            before = _state(m)
            out = m.prepare_store([rng.choice(universe) for _ in range(rng.randint(1, 4))], ctx)
            if out is None:
                no_room += 1
                assert _state(m) == before, f"a store without room changed state at {step}"
            elif out.keys_to_store:
                stores.append(out.keys_to_store)
        elif op == 3 and stores:
            m.complete_store(stores.pop(rng.randrange(len(stores))), ctx, rng.random() < 0.8)
        elif op == 4 and ready:
            loads.append([rng.choice(ready) for _ in range(rng.randint(1, 2))])
            m.prepare_load(loads[-1], ctx)
        elif op == 5 and loads:
            m.complete_load(loads.pop(rng.randrange(len(loads))), ctx)
        elif op == 6:
            m.touch([rng.choice(universe)], ctx)
            if rng.random() < 0.05:
                m.reset_cache()
                m.on_reset_flushed()  # every job of before the reset dropped
                stores.clear()
                loads.clear()
            if rng.random() < 0.2:
                ctx = ReqContext(f"r{step}")
        else:
            before = _state(m)
            bad: Any = rng.choice([1, "k", None, bytearray(b"k")])
            good = [rng.choice(universe)]
            absent = [k for k in universe if k not in ready][:1]
            with pytest.raises((TypeError, ValueError)):
                _refused_call(m, rng.randrange(8), good, bad, ctx, absent)
            assert _state(m) == before, f"a refused call changed state at {step}"
        if rng.random() < 0.3:
            for event in m.take_events():
                (view.difference_update if event.removed else view.update)(event.keys)
            held = {k for k, s in m._slot_of.items() if m._ref[s] >= 0}
            assert view == held, f"events disagree with the tier at {step}"
    assert no_room > 0, "no store found the tier without room: the run tested too little"
