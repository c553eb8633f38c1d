"""kvaware review (2026-11-27): keys that are bytes subclasses, and a seeded call-sequence fuzz
of the CachePolicy contract, `clear()` against a fresh policy and the per-request tables."""

from __future__ import annotations

import random

import numpy as np
import pytest

from helpers import outputs_under_hash_seeds
from kvtier.base import OffloadKey, ReqContext, make_offload_key
from kvtier.policies import KVAwarePolicy
from kvtier.policies.kvaware import key_hash
from kvtier.policies.kvaware_sketch import MAX_COUNT


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


class SubKey(bytes):
    """A bytes subclass, as numpy.bytes_ is: equal to, and a dict key for, the plain key."""


# -- keys that are bytes subclasses ----------------------------------------------------------


@pytest.mark.parametrize("wrap", [np.bytes_, SubKey])
def test_a_bytes_subclass_key_counts_with_the_equal_plain_key(wrap: type[bytes]) -> None:
    # The policy holds them as one key; its sketch counted them in different counters.
    policy = KVAwarePolicy(64, mode="filter")
    k = key(7)
    policy.touch([k], None)
    policy.touch([OffloadKey(wrap(k))], None)
    assert key_hash(wrap(k)) == key_hash(k)
    assert policy._sketch.estimate_key(k) == policy._sketch.estimate_key(wrap(k)) == 2


def test_a_bytes_subclass_key_hashes_the_same_in_every_process() -> None:
    code = (
        "import numpy as np; from kvtier.base import make_offload_key;"
        "from kvtier.policies.kvaware import key_hash;"
        "print(key_hash(np.bytes_(make_offload_key((7).to_bytes(8, 'big'), 0))))"
    )
    assert outputs_under_hash_seeds(code, ("1", "2")) == {f"{key_hash(key(7))}\n"}


def _victims(keys: list[OffloadKey]) -> list[bytes]:
    """Victims of a skewed flat replay over `keys` in a small, collision-prone filter policy."""
    policy = KVAwarePolicy(40, sketch_width=1, mode="filter")
    rng = random.Random(1)
    out: list[bytes] = []
    for step in range(3000):
        k = rng.choice(keys[: 50 + step // 20])
        if k in policy:
            policy.touch([k], None)
            continue
        if len(policy) >= policy.capacity:
            got = policy.evict(1, ())
            assert got is not None
            out += [bytes(v) for v in got]
        policy.insert([k], None)
    return out


def test_bytes_subclass_keys_are_evicted_as_the_plain_keys_are() -> None:
    plain = [key(i) for i in range(400)]
    assert _victims([OffloadKey(np.bytes_(k)) for k in plain]) == _victims(plain)


# -- the contract under random call sequences -------------------------------------------------


def _state(p: KVAwarePolicy) -> object:
    """What later decisions depend on (the deepest-key caches left out)."""
    own = (
        list(p._win.items()),
        dict(p._credit),
        {c: list(b) for c, b in p._buckets.items()},
        p._floor,
        dict(p._pinned),
        bytes(p._sketch._table),
        p._sketch._added,
        (p._mode, p._admit_all, p._tail_first, p._counts),
        (list(getattr(p, "_model_hits", [])), p._replica_hits, p._lru_hold, p._since_switch),
        {r: set(s) for r, s in p._counted.items()},
        {r: set(s) for r, s in p._counted_late.items()},
        list(p._finished),
        (p._counted_req, set(p._counted_keys)),
    )
    replica = _state(p._replica) if p._replica is not None else None
    return own, tuple(_state(m) for m in p._models or ()), replica


def _check_bounds(p: KVAwarePolicy) -> None:
    cap, s = p.capacity, p.table_sizes()
    assert s["window"] + s["credits"] + s["pinned"] <= cap, s
    assert s["buckets"] <= MAX_COUNT + 1, s
    assert s["request_tails"] <= 512, s
    assert s["request_finished"] <= min(4096, 2 * cap), s
    assert len(p._counted) + len(p._counted_late) <= 512
    per_request = max(2 * cap, 1024)
    assert all(len(v) <= per_request for v in p._counted.values())
    assert all(len(v) <= per_request for v in p._counted_late.values())
    assert all(v <= min(cap, 511) for n, v in s.items() if n.startswith(("shadow", "replica")))
    assert all(p._floor <= c <= p._floor + MAX_COUNT for c in p._credit.values())


def call(op: str, *args: object) -> tuple[str, tuple[object, ...]]:
    return op, args


def _fuzz(seed: int, capacity: int, mode: str, steps: int) -> None:
    rng = random.Random(f"review-1127-{seed}")
    policy = KVAwarePolicy(capacity, mode=mode)
    fresh: KVAwarePolicy | None = None  # built at the last clear, given the same calls since
    universe = [key(i) for i in range(3 * capacity + 5)]
    # Few ids (reused after they finish) or more than the 512 live ones remembered.
    req_ids = [f"r{i}" for i in range(rng.choice([3, 700]))]
    tables: dict[str, dict[OffloadKey, int]] = {}
    held: set[OffloadKey] = set()
    pinned: set[OffloadKey] = set()

    def ctx(keys: list[OffloadKey]) -> ReqContext | None:
        if rng.random() < 0.25:
            return None
        rid = rng.choice(req_ids)
        table = tables.setdefault(rid, {})
        if rng.random() < 0.3:
            table = tables[rid] = {}  # a request's new table (an id reused)
        for k in keys:
            table.setdefault(k, (len(table) + 1) * 16)  # tables grow by appending
        return ReqContext(rid, key_positions=table)

    def some(n_max: int, pool: list[OffloadKey]) -> list[OffloadKey]:
        ks = [rng.choice(pool or universe) for _ in range(rng.randint(1, n_max))]
        if rng.random() < 0.25:
            ks.append(rng.choice(ks))  # a key twice in one call
        return ks

    for step in range(steps):
        r, hs, ps = rng.random(), sorted(held), sorted(pinned)
        if r < 0.3:
            ks = some(6, [])
            new = [k for k in dict.fromkeys(ks) if k not in held and k not in pinned]
            need = len(held) + len(pinned) + len(new) - capacity
            if need > 0:  # the manager makes room first
                op, args = call("evict", need, [k for k in ks if k in held or k in pinned])
            else:
                op, args = call("insert", ks, ctx(ks))
        elif r < 0.5:
            x = rng.random()
            ks = some(5, hs if x < 0.6 else ps if x < 0.75 else [])
            op, args = call("touch", ks, ctx(ks))
        elif r < 0.58:
            op, args = call("pin", some(3, hs if rng.random() < 0.7 else []))
        elif r < 0.66:
            ks = some(3, ps if rng.random() < 0.7 else [])
            op, args = call("unpin", ks, ctx(ks))
        elif r < 0.7:
            op, args = call("remove", some(3, []))
        elif r < 0.74 and (hs or ps):
            ks = some(3, hs + ps)
            op, args = call("insert", ks, ctx(ks))  # held keys only: ignored
        elif r < 0.8:
            op, args = call("on_request_finished", ReqContext(rng.choice(req_ids)))
        elif r < 0.997:
            protected = rng.sample(universe, rng.randint(0, len(universe) // 2))
            if protected and rng.random() < 0.3:
                protected.append(protected[0])
            n = rng.randint(0, len(held) + 1)
            op, args = call("evict", n, protected if rng.random() < 0.5 else set(protected))
        else:
            op, args = call("clear")
        where = f"seed={seed} capacity={capacity} mode={mode} step={step} op={op}"

        before = _state(policy)
        got = getattr(policy, op)(*args)
        if fresh is not None:
            assert getattr(fresh, op)(*args) == got, where

        keys = args[0] if op in ("insert", "touch", "pin", "unpin", "remove") else []
        assert isinstance(keys, list)
        unchanged = (
            (op == "insert" and all(k in held or k in pinned for k in keys))
            or (op == "touch" and all(k in pinned for k in keys))
            or (op == "pin" and not held.intersection(keys))
            or (op == "unpin" and not pinned.intersection(keys))
            or (op == "remove" and not (held | pinned).intersection(keys))
        )
        if unchanged:
            assert _state(policy) == before, where
        if op == "insert":
            held.update(k for k in keys if k not in pinned)
        elif op == "pin":
            pinned |= held.intersection(keys)
            held -= pinned
        elif op == "unpin":
            held |= pinned.intersection(keys)
            pinned -= held
        elif op == "remove":
            held.difference_update(keys)
            pinned.difference_update(keys)
        elif op == "evict":
            wanted, shielded = args
            assert isinstance(wanted, int) and isinstance(shielded, (list, set))
            available = held - set(shielded)
            if got is None:
                assert len(available) < wanted and _state(policy) == before, where
            else:
                assert len(got) == wanted == len(set(got)) and set(got) <= available, where
                held.difference_update(got)
        elif op == "clear":
            held.clear()
            pinned.clear()
            fresh = KVAwarePolicy(capacity, mode=mode)
            assert _state(policy) == _state(fresh), where
        assert len(policy) == len(held), where
        assert all((k in policy) == (k in held) for k in universe), where
        if fresh is not None:
            assert policy.table_sizes() == fresh.table_sizes(), where
        _check_bounds(policy)


@pytest.mark.parametrize(
    ("seed", "capacity", "mode"),
    [(0, 1, "adaptive"), (1, 5, "adaptive"), (2, 40, "adaptive"), (3, 8, "filter"), (4, 3, "open")],
)
def test_kvaware_keeps_the_contract_and_its_bounds_under_random_calls(
    seed: int, capacity: int, mode: str
) -> None:
    _fuzz(seed, capacity, mode, steps=1200)
