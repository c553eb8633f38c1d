"""The same scenarios against every registered cache policy."""

from __future__ import annotations

import random
import re
from collections.abc import Collection

import numpy as np
import pytest

from kvtier.base import OffloadKey, ReqContext, make_offload_key
from kvtier.policies import CachePolicy, get_policy_cls, make_policy, registered_policies

NAMES = sorted(registered_policies())


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def ctx(req: str, keys: list[OffloadKey]) -> ReqContext:
    return ReqContext(req, key_positions={k: (j + 1) * 16 for j, k in enumerate(keys)})


def filled(name: str, n: int = 8, capacity: int = 8) -> tuple[CachePolicy, list[OffloadKey]]:
    policy = make_policy(name, capacity)
    keys = [key(i) for i in range(n)]
    policy.insert(keys, ctx("r0", keys))
    return policy, keys


def per_key_tables(policy: CachePolicy) -> dict[str, int]:
    """Tables that grow with the keys seen; fixed-size sketches are reported as `sketch*`, and
    keys of live requests (bounded by the engine's requests) as `request_*`."""
    return {
        n: v for n, v in policy.table_sizes().items() if not n.startswith(("sketch", "request_"))
    }


def members(policy: CachePolicy, keys: list[OffloadKey]) -> list[bool]:
    return [k in policy for k in keys]


@pytest.mark.parametrize("name", NAMES)
def test_evict_returns_exactly_n_distinct_held_keys(name: str) -> None:
    policy, keys = filled(name)
    victims = policy.evict(3, set())
    assert victims is not None and len(victims) == 3 and len(set(victims)) == 3
    assert all(v in keys and v not in policy for v in victims)
    assert len(policy) == 5
    assert policy.evict(0, set()) == []


@pytest.mark.parametrize("name", NAMES)
def test_evict_too_many_returns_none_and_changes_nothing(name: str) -> None:
    policy, keys = filled(name)
    policy.touch(keys[:2], None)
    before = (len(policy), members(policy, keys), policy.table_sizes())
    assert policy.evict(9, set()) is None
    assert policy.evict(7, set(keys[:2])) is None
    assert (len(policy), members(policy, keys), policy.table_sizes()) == before
    # The order is unchanged too: the same victims come out as from an untouched twin.
    twin, _ = filled(name)
    twin.touch(keys[:2], None)
    assert policy.evict(8, set()) == twin.evict(8, set())


@pytest.mark.parametrize("name", NAMES)
def test_protected_keys_are_never_victims_and_stay_held(name: str) -> None:
    policy, keys = filled(name)
    protected = set(keys[:4])
    victims = policy.evict(4, protected)
    assert victims is not None and not protected & set(victims)
    assert all(k in policy for k in protected)
    assert sorted(policy.evict(4, set()) or []) == sorted(protected)


@pytest.mark.parametrize("name", NAMES)
def test_protected_keys_given_twice_block_one_candidate(name: str) -> None:
    # The manager passes the keys of a store call already present; a call may repeat a key.
    policy, keys = filled(name)
    victims = policy.evict(7, [keys[0], keys[0]])
    assert victims is not None and keys[0] not in victims and len(set(victims)) == 7
    assert keys[0] in policy and len(policy) == 1


@pytest.mark.parametrize("name", NAMES)
def test_pinned_keys_are_never_victims_until_unpinned(name: str) -> None:
    policy, keys = filled(name)
    policy.pin(keys[:3])
    assert len(policy) == 5 and keys[0] not in policy
    assert policy.evict(6, set()) is None
    victims = policy.evict(5, set())
    assert victims is not None and not set(keys[:3]) & set(victims)
    assert policy.evict(1, set()) is None
    policy.unpin(keys[:3], ctx("r1", keys[:3]))
    assert len(policy) == 3
    assert sorted(policy.evict(3, set()) or []) == sorted(keys[:3])


@pytest.mark.parametrize("name", NAMES)
def test_unknown_keys_are_ignored(name: str) -> None:
    policy, _ = filled(name)
    stranger = key(999)
    policy.touch([stranger], None)
    policy.pin([stranger])
    policy.unpin([stranger], None)
    policy.remove([stranger])
    assert len(policy) == 8 and stranger not in policy


@pytest.mark.parametrize("name", NAMES)
def test_remove_and_clear_forget_keys(name: str) -> None:
    policy, keys = filled(name)
    policy.pin([keys[1]])
    policy.remove([keys[0], keys[1]])
    assert keys[0] not in policy and len(policy) == 6
    assert keys[1] not in policy
    victims = policy.evict(6, set())
    assert victims is not None and keys[0] not in victims and keys[1] not in victims
    policy.insert(keys, None)
    policy.clear()
    assert len(policy) == 0 and all(v == 0 for v in per_key_tables(policy).values())
    assert policy.evict(1, set()) is None


@pytest.mark.parametrize("name", NAMES)
def test_unpin_returns_only_keys_still_pinned(name: str) -> None:
    # vLLM's adapter unpins on mark_evictable, whatever happened to the key meanwhile.
    policy, keys = filled(name)
    policy.pin(keys[:3])
    policy.remove([keys[0]])
    policy.unpin(keys[:3], None)
    assert keys[0] not in policy and keys[1] in policy and len(policy) == 7
    policy.unpin([keys[4]], None)  # held, never pinned: nothing to return
    assert len(policy) == 7
    policy.pin([keys[5]])
    policy.clear()
    policy.unpin([keys[5]], None)
    assert len(policy) == 0 and keys[5] not in policy
    assert policy.evict(1, set()) is None


class CountingSet(set[OffloadKey]):
    """A protected set that counts membership tests."""

    lookups = 0

    def __contains__(self, item: object) -> bool:
        self.lookups += 1
        return super().__contains__(item)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("as_list", [False, True])
def test_evict_with_many_protected_keys_is_linear(name: str, as_list: bool) -> None:
    # The manager protects the keys of a store call already present: a long request's prefix.
    # When they are the oldest, each victim must not rescan them (quadratic in the request).
    n = 2000
    policy = make_policy(name, n)
    keys = [key(i) for i in range(n)]
    for k in keys:  # one per call: the first are the oldest
        policy.insert([k], None)
    protected = CountingSet(keys[: n // 2])
    given: Collection[OffloadKey] = list(protected) if as_list else protected
    victims = policy.evict(n // 4, given)
    assert victims is not None and len(set(victims)) == n // 4
    assert not protected & set(victims)
    assert all(k in policy for k in protected)
    if not as_list:
        assert protected.lookups <= 4 * n, protected.lookups
    assert len(policy) == n - n // 4
    if name in ("lru", "kvaware"):
        # Protection keeps their place: the oldest, next in line once unprotected.
        assert policy.evict(n // 2, set()) == keys[: n // 2]


@pytest.mark.parametrize("name", NAMES)
def test_tables_stay_bounded_under_random_operations(name: str) -> None:
    capacity = 64
    policy = make_policy(name, capacity)
    rng = random.Random(name)
    held: set[OffloadKey] = set()
    pinned: set[OffloadKey] = set()
    for step in range(100_000):
        op = rng.random()
        k = key(rng.randrange(capacity * 20))
        c = ReqContext(str(step // 8), key_positions={k: rng.randint(1, 64) * 16})
        if op < 0.45:
            if k in held or k in pinned:
                policy.touch([k], c)
            else:
                if len(held) + len(pinned) >= capacity:
                    victims = policy.evict(1, {k})
                    if victims is None:
                        continue
                    assert victims[0] in held and victims[0] not in pinned
                    held.discard(victims[0])
                policy.insert([k], c)
                held.add(k)
        elif op < 0.55 and held:
            p = rng.choice(sorted(held)) if op < 0.46 else next(iter(held))
            policy.pin([p])
            held.discard(p)
            pinned.add(p)
        elif op < 0.65 and pinned:
            p = pinned.pop()
            policy.unpin([p], c)
            held.add(p)
        elif op < 0.67 and held:
            r = next(iter(held))
            policy.remove([r])
            held.discard(r)
        else:
            policy.touch([k], c)
        if step % 997 == 0:
            assert len(policy) == len(held)
            assert all(t <= 2 * capacity for t in per_key_tables(policy).values())
    assert len(policy) == len(held)
    assert all(h in policy for h in held) and not any(p in policy for p in pinned)
    assert all(t <= 2 * capacity for t in per_key_tables(policy).values())


def test_unknown_name_lists_registered_policies() -> None:
    with pytest.raises(ValueError) as err:
        make_policy("nope", 4)
    for name in ("lru", "arc", "s3fifo", "sieve", "kvaware"):
        assert name in str(err.value)


def test_module_class_spec_loads_policy() -> None:
    cls = get_policy_cls("kvtier.policies.sieve:SIEVEPolicy")
    assert cls is registered_policies()["sieve"]
    with pytest.raises(ValueError, match="cannot be imported"):
        get_policy_cls("kvtier.policies.sieve:Nope")


@pytest.mark.parametrize("spec", [":SIEVEPolicy", ".sieve:SIEVEPolicy", "kvtier..x:C"])
def test_a_malformed_module_path_is_named_in_the_error(spec: str) -> None:
    # importlib raises ValueError or TypeError for these, with a message that omits the spec.
    with pytest.raises(ValueError, match=re.escape(f"cache policy {spec!r} cannot be imported")):
        get_policy_cls(spec)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [0, -3, 2.5, 8.0, float("nan"), float("inf"), True, "8", None])
def test_bad_capacity_is_rejected(name: str, bad: object) -> None:
    # A float size is refused, not rounded; NaN would disable every bound compared with it.
    with pytest.raises(ValueError, match=re.escape(f"capacity={bad!r} is invalid")):
        make_policy(name, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", NAMES)
def test_integer_like_capacity_is_accepted(name: str) -> None:
    policy = make_policy(name, np.int64(4))  # type: ignore[arg-type]
    assert policy.capacity == 4 and type(policy.capacity) is int
