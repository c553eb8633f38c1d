"""Defects found by an adversarial review of CPUOffloadingManager and admission (model fuzzing
with every policy, plugin subclasses and bad calls; scripts kept out of the repository).

- A cache-policy plugin whose `pin` raised part-way left `prepare_load`'s keys pinned in the
  manager with no spec returned: no `complete_load` could ever release them.
- A plugin whose `evict` raised, or answered None (no room) after taking keys out, left those
  ready keys outside the policy: never evictable, the pool smaller for good.
- Bad key collections (None, an int) and unhashable keys gave bare Python errors ("'NoneType'
  object is not iterable", "unhashable type: 'bytearray'") naming neither value nor what was
  expected; `complete_store` given a key twice did not name it; a `num_slots` too large was a
  bare MemoryError or OverflowError.
- The policy registries accepted a class that is not a policy (the manager then failed at its
  first store) and a name that is not a str (`registered_policies()` then failed to sort).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

import pytest

from helpers import MANAGER_KEY_CALLS, key, keys
from kvtier.admission import AdmissionPolicy, register_admission_policy
from kvtier.base import OffloadKey, ReqContext
from kvtier.cpu import CPUOffloadingManager
from kvtier.policies import (
    CachePolicy,
    LRUPolicy,
    register_policy,
    registered_policies,
)

CTX = ReqContext("r1")


def core(m: CPUOffloadingManager) -> tuple[object, ...]:
    return (
        dict(m._slot_of),
        list(m._ref),
        list(m._free),
        m._next_fresh,
        m.get_stats(),
        len(m.policy),
    )


def fill(m: CPUOffloadingManager, *ids: int) -> None:
    out = m.prepare_store(keys(*ids), CTX)
    assert out is not None
    m.complete_store(out.keys_to_store, CTX)


def assert_all_evictable(m: CPUOffloadingManager) -> None:
    """Every slot can be reclaimed: a store of `num_slots` new keys finds room."""
    stats = m.get_stats()
    assert stats.pinned == 0 and stats.ready == len(m.policy) == stats.used_slots
    out = m.prepare_store(keys(*range(100, 100 + m.num_slots)), ReqContext("later"))
    assert out is not None and len(out.keys_to_store) == m.num_slots


def plugin_of(policy_name: str, **methods: Callable[..., Any]) -> type[CachePolicy]:
    """A subclass of a built-in policy: a plugin to the manager, whose answers it checks."""
    return type("Plugin", (registered_policies()[policy_name],), dict(methods))


# -- a plugin's pin that raises ----------------------------------------------------------------


def test_a_pin_that_raises_part_way_leaves_no_pin(policy_name: str) -> None:
    armed = [True]

    def pin(self: CachePolicy, keys: Iterable[OffloadKey]) -> None:
        keys = list(keys)
        super(cls, self).pin(keys[:1])  # type: ignore[misc]
        if armed[0]:
            raise RuntimeError("pin failed part-way")
        super(cls, self).pin(keys[1:])  # type: ignore[misc]

    cls = plugin_of(policy_name, pin=pin)
    m = CPUOffloadingManager(3, cls)
    fill(m, 1, 2, 3)
    before = core(m)
    with pytest.raises(RuntimeError, match="part-way"):
        m.prepare_load(keys(1, 2, 2), CTX)
    # The keys were left pinned (ref counts 1, 2, 0 ready) with no spec returned.
    assert core(m) == before
    armed[0] = False
    m.prepare_load(keys(1, 2), CTX)
    m.complete_load(keys(1, 2), CTX)
    assert_all_evictable(m)


# -- a plugin's evict that raises or answers None after taking keys out ------------------------


@pytest.mark.parametrize("answer", ["raise", "none"])
def test_an_evict_that_fails_after_taking_keys_out_loses_none(
    policy_name: str, answer: str
) -> None:
    armed = [True]

    def evict(self: CachePolicy, n: int, protected: Collection[OffloadKey]) -> Any:
        victims = super(cls, self).evict(n, protected)  # type: ignore[misc]
        if not armed[0]:
            return victims
        armed[0] = False
        if answer == "raise":
            raise RuntimeError("evict failed after taking its victims")
        return None

    cls = plugin_of(policy_name, evict=evict)
    m = CPUOffloadingManager(2, cls, enable_events=True)
    fill(m, 1, 2)
    m.take_events()
    slots_before = (dict(m._slot_of), list(m._ref), list(m._free))
    error = RuntimeError if answer == "raise" else ValueError
    with pytest.raises(error, match="evict failed" if answer == "raise" else "returned None"):
        m.prepare_store(keys(3), CTX)
    assert (dict(m._slot_of), list(m._ref), list(m._free)) == slots_before
    assert m.get_stats().ready == len(m.policy) == 2  # was 1: a key lost to the policy
    assert list(m.take_events()) == []
    assert_all_evictable(m)


def test_an_evict_that_answers_none_without_taking_anything_is_still_no_room() -> None:
    # Only a None that changed the policy is refused: a plain "no room" stays one.
    def evict(self: CachePolicy, n: int, protected: Collection[OffloadKey]) -> Any:
        return None

    m = CPUOffloadingManager(2, type("NoRoom", (LRUPolicy,), {"evict": evict}))
    fill(m, 1, 2)
    assert m.prepare_store(keys(3), CTX) is None
    assert m.get_stats().stores_no_room == 1 and len(m.policy) == 2


# -- errors that name the bad value --------------------------------------------------------------

CALLS = MANAGER_KEY_CALLS


def loaded(policy_name: str) -> CPUOffloadingManager:
    """Key 1 ready and pinned, key 2 ready, key 3 being written."""
    m = CPUOffloadingManager(4, policy_name, enable_events=True)
    fill(m, 1, 2)
    assert m.prepare_store(keys(3), CTX) is not None
    m.prepare_load(keys(1), CTX)
    m.take_events()
    return m


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("bad", [None, 7, 2.5], ids=["none", "int", "float"])
def test_keys_that_are_not_a_collection_are_named(policy_name: str, call: str, bad: object) -> None:
    m = loaded(policy_name)
    before = core(m)
    # Was "'NoneType' object is not iterable" (or 'int', 'float').
    with pytest.raises(TypeError, match=rf"keys={bad!r} has type .*expected a collection"):
        CALLS[call](m, bad)
    assert core(m) == before


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize(
    "bad", [bytearray(key(1)), [1, 2], {"k": 1}], ids=["bytearray", "list", "dict"]
)
def test_an_unhashable_key_is_named_by_every_call(policy_name: str, call: str, bad: object) -> None:
    m = loaded(policy_name)
    before = core(m)
    # prepare_load, complete_load and complete_store said "unhashable type: 'bytearray'".
    ordered = [key(3), bad] if call == "complete_store" else [key(1), bad]
    with pytest.raises(TypeError, match=rf"offload keys are bytes; got {type(bad).__name__} "):
        CALLS[call](m, ordered)
    assert core(m) == before
    assert list(m.take_events()) == []


def test_complete_store_names_the_key_it_got_twice(policy_name: str) -> None:
    m = loaded(policy_name)
    before = core(m)
    with pytest.raises(ValueError, match=rf"same key twice \({key(3).hex()}\); expected each"):
        m.complete_store([key(3), key(3)], CTX)
    assert core(m) == before


@pytest.mark.parametrize("num_slots", [2**62, 2**64], ids=["memory", "overflow"])
def test_a_num_slots_too_large_is_a_value_error_naming_it(policy_name: str, num_slots: int) -> None:
    # Was a bare MemoryError, or OverflowError "cannot fit 'int' into an index-sized integer".
    with pytest.raises(ValueError, match=rf"^num_slots={num_slots} is too large"):
        CPUOffloadingManager(num_slots, policy_name)


# -- the registries --------------------------------------------------------------------------


class _NotAPolicy:
    def __init__(self, capacity: int = 1) -> None:
        self.capacity = capacity


def test_registering_a_class_that_is_not_a_cache_policy_is_refused() -> None:
    before = registered_policies()
    with pytest.raises(TypeError, match=r"'not-a-policy': .*_NotAPolicy.* is not a kvtier"):
        register_policy("not-a-policy", "nothing")(_NotAPolicy)  # type: ignore[type-var]
    assert registered_policies() == before


def test_registering_a_class_that_is_not_an_admission_policy_is_refused() -> None:
    from kvtier.admission import registered_admission_policies

    before = registered_admission_policies()
    with pytest.raises(TypeError, match=r"'not-admission': .*_NotAPolicy.* is not a kvtier"):
        register_admission_policy("not-admission", "nothing")(_NotAPolicy)  # type: ignore[type-var]
    assert registered_admission_policies() == before


@pytest.mark.parametrize("name", [None, 3, ""], ids=["none", "int", "empty"])
def test_a_policy_name_that_is_not_a_str_is_refused(name: Any) -> None:
    # A None name was registered, and registered_policies() (`kvtier policies`) then failed:
    # "'<' not supported between instances of 'NoneType' and 'str'".
    before = registered_policies()
    cls = type("Named", (LRUPolicy,), {})
    with pytest.raises(TypeError, match=r"cache policy name .* expected a non-empty str"):
        register_policy(name, "nothing")(cls)
    assert registered_policies() == before

    class Admits(AdmissionPolicy):
        def admit(self, keys: Any, ctx: ReqContext) -> list[OffloadKey]:
            return list(keys)

    with pytest.raises(TypeError, match=r"admission policy name .* expected a non-empty str"):
        register_admission_policy(name, "nothing")(Admits)


# -- every bad call leaves the whole state, policy and admission included, as it was ----------


def deep(obj: object, depth: int = 0) -> object:
    """An order-keeping, comparable picture of an object graph (the manager, its policy,
    its admission), to tell that a refused call changed nothing anywhere."""
    if isinstance(obj, (int, float, str, bytes, bool, type(None))) or depth > 8:
        return obj if depth <= 8 else "..."
    if isinstance(obj, dict):
        return [(deep(k, depth + 1), deep(v, depth + 1)) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [deep(v, depth + 1) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted(map(repr, obj))
    attrs = dict(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(obj, name):
                attrs[name] = getattr(obj, name)
    if not attrs:
        return repr(obj)
    return sorted((k, deep(v, depth + 1)) for k, v in attrs.items() if not callable(v))


@pytest.mark.parametrize("plugin", [False, True], ids=["builtin", "plugin"])
def test_refused_calls_change_nothing_in_a_random_run(policy_name: str, plugin: bool) -> None:
    import random

    rng = random.Random(policy_name)
    cls = plugin_of(policy_name) if plugin else policy_name
    m = CPUOffloadingManager(4, cls, store_threshold=2, enable_events=True)
    universe = keys(*range(10))
    pinned: list[OffloadKey] = []
    bad_keys: list[Any] = [bytearray(b"k"), [1], None, 7, {"a": 1}]
    bad_colls: list[Any] = [None, 7, key(1), "k"]
    for step in range(400):
        ctx = ReqContext(f"r{step % 3}")
        op = rng.randrange(6)
        if op == 0:
            out = m.prepare_store(rng.sample(universe, rng.randint(1, 3)), ctx)
            if out is not None and out.keys_to_store:
                m.complete_store(out.keys_to_store, ctx, success=rng.random() < 0.8)
        elif op == 1:
            ready = [k for k in universe if m.lookup(k, ctx).name == "HIT"]
            if ready:
                job = rng.sample(ready, 1)
                m.prepare_load(job, ctx)
                pinned += job
        elif op == 2 and pinned:
            m.complete_load([pinned.pop(rng.randrange(len(pinned)))], ctx)
        elif op == 3:
            m.touch(rng.sample(universe, 2), ctx)
        else:
            call = rng.choice(sorted(CALLS))
            arg = rng.choice(bad_colls) if op == 4 else [*universe[:1], rng.choice(bad_keys)]
            before = deep(m)
            with pytest.raises((TypeError, ValueError)):
                CALLS[call](m, arg)
            assert deep(m) == before, (step, call, arg)
    for k in pinned:
        m.complete_load([k], CTX)
    stats = m.get_stats()
    assert stats.pinned == stats.pending_writes == 0
    assert stats.ready == len(m.policy) == stats.used_slots
