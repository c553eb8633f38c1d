"""Reference models of LRU, SIEVE, S3-FIFO and ARC, driven side by side with the policies.

Each model is a plain, slow restatement of its algorithm as docs/policies.md describes it,
written from the papers (lists and dicts, no fast paths), with kvtier's documented choices:

- LRU: a call's keys are applied tail first (its head ends up most recent); unpin is a use.
- SIEVE (Zhang et al., NSDI'24): new keys at the head; the hand walks from the tail toward the
  head, clears visited bits, leaves survivors in place and after an eviction stays at the
  victim's newer neighbour (past the head: the tail). Pinned and protected keys keep their
  place and their bit; unpin sets the bit.
- S3-FIFO (Yang et al., SOSP'23): small FIFO of 10% of capacity, main FIFO, ghost FIFO of
  capacity minus the small target, frequencies capped at 3. A small key with `freq >= 2` is
  promoted to main's head with frequency 0; main reinserts a used key with `freq - 1`; a ghost
  hit inserts into main. Each step of an eviction picks its queue anew: small when it holds
  at least its target (or main is empty), else main. (This is kvtier's choice, not in the
  docs: the paper's Algorithm 1 keeps evicting from small, promoting, until one key leaves.
  Mooncake's figures are the same either way.) Pinned keys leave their queue and return at
  its head with `freq + 1`. A key's frequency rises once per request: a touch or unpin by
  the request that raised it last leaves it as it is; without a request, once per call. A
  request is remembered (a token) from its first use of a key the policy holds; one that
  names only other keys is not.
- ARC (Megiddo & Modha, FAST'03), evict before insert: REPLACE takes T1's LRU when
  `|T1| + pinned T1 > p` (or T2 is empty), else T2's; `p` adapts on the ghost hit at insert;
  ghost bounds (|T1| + |B1| <= c, all four lists <= 2c, pinned keys counted) are enforced
  when a key enters T1. Pinned keys leave their list; unpin is a hit (T2's MRU end).

Protected keys of `evict(n, protected)` are never victims and keep their place. Where a scan
meets one it is set aside for the rest of the call (S3-FIFO: it is neither promoted nor
aged; ARC: it no longer counts in its list's size for this call's REPLACE decisions, unlike
a pinned T1 key), and the keys set aside return to the end they were taken from, in order.

Unknown keys are ignored by touch, pin and remove; unpin returns only keys still pinned;
insert ignores keys the policy already holds, pinned ones included.

The differential test drives each policy and its model with the same seeded random operation
sequences (a manager's use and misuse both) and compares victims, membership and table sizes
after every operation. kvaware, which has no simple model, is checked against the contract.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Protocol

import pytest

from kvtier.base import OffloadKey, ReqContext, make_offload_key
from kvtier.policies import (
    ARCPolicy,
    CachePolicy,
    KVAwarePolicy,
    LRUPolicy,
    S3FIFOPolicy,
    SIEVEPolicy,
)
from kvtier.policies.kvaware_sketch import MAX_COUNT


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


class Model(Protocol):
    """The part of `CachePolicy` a model implements."""

    def __len__(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...
    def insert(self, keys: Sequence[OffloadKey]) -> None: ...
    def touch(self, keys: Sequence[OffloadKey], req: str | None = None) -> None: ...
    def pin(self, keys: Sequence[OffloadKey]) -> None: ...
    def unpin(self, keys: Sequence[OffloadKey], req: str | None = None) -> None: ...
    def remove(self, keys: Sequence[OffloadKey]) -> None: ...
    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None: ...
    def clear(self) -> None: ...
    def table_sizes(self) -> dict[str, int]: ...


# -- LRU ----------------------------------------------------------------------------------


class LRUModel:
    def __init__(self, capacity: int) -> None:
        self.order: list[OffloadKey] = []  # least recent first
        self.pinned: set[OffloadKey] = set()

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, key: object) -> bool:
        return key in self.order

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        for k in reversed(keys):
            if k not in self.order and k not in self.pinned:
                self.order.append(k)

    def touch(self, keys: Sequence[OffloadKey], req: str | None = None) -> None:
        for k in reversed(keys):
            if k in self.order:
                self.order.remove(k)
                self.order.append(k)

    def pin(self, keys: Sequence[OffloadKey]) -> None:
        for k in keys:
            if k in self.order:
                self.order.remove(k)
                self.pinned.add(k)

    def unpin(self, keys: Sequence[OffloadKey], req: str | None = None) -> None:
        for k in reversed(keys):
            if k in self.pinned:
                self.pinned.discard(k)
                self.order.append(k)

    def remove(self, keys: Sequence[OffloadKey]) -> None:
        for k in keys:
            if k in self.order:
                self.order.remove(k)
            self.pinned.discard(k)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        free = [k for k in self.order if k not in protected]
        if len(free) < n:
            return None
        victims = free[:n]
        for k in victims:
            self.order.remove(k)
        return victims

    def clear(self) -> None:
        self.order.clear()
        self.pinned.clear()

    def table_sizes(self) -> dict[str, int]:
        return {"candidates": len(self.order), "pinned": len(self.pinned)}


# -- SIEVE --------------------------------------------------------------------------------


class SIEVEModel:
    def __init__(self, capacity: int) -> None:
        self.queue: list[OffloadKey] = []  # tail (oldest) first, head (newest) last
        self.visited: dict[OffloadKey, bool] = {}
        self.pinned: set[OffloadKey] = set()
        self.hand: OffloadKey | None = None  # None: start at the tail

    def __len__(self) -> int:
        return len(self.queue) - len(self.pinned)

    def __contains__(self, key: object) -> bool:
        return key in self.visited and key not in self.pinned

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        for k in keys:
            if k not in self.visited:
                self.queue.append(k)
                self.visited[k] = False

    def touch(self, keys: Sequence[OffloadKey], req: str | None = None) -> None:
        for k in keys:
            if k in self:
                self.visited[k] = True

    def pin(self, keys: Sequence[OffloadKey]) -> None:
        for k in keys:
            if k in self.visited:
                self.pinned.add(k)

    def unpin(self, keys: Sequence[OffloadKey], req: str | None = None) -> None:
        for k in keys:
            if k in self.pinned:
                self.pinned.discard(k)
                self.visited[k] = True

    def _drop(self, k: OffloadKey) -> None:
        i = self.queue.index(k)
        if self.hand == k:
            self.hand = self.queue[i + 1] if i + 1 < len(self.queue) else None
        del self.queue[i]
        del self.visited[k]
        self.pinned.discard(k)

    def remove(self, keys: Sequence[OffloadKey]) -> None:
        for k in keys:
            if k in self.visited:
                self._drop(k)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        if sum(1 for k in self.queue if k in self and k not in protected) < n:
            return None
        victims: list[OffloadKey] = []
        while len(victims) < n:
            i = 0 if self.hand is None else self.queue.index(self.hand)
            while True:
                k = self.queue[i]
                if k in self.pinned or k in protected:
                    pass
                elif self.visited[k]:
                    self.visited[k] = False
                else:
                    break
                i = (i + 1) % len(self.queue)
            self.hand = k
            self._drop(k)  # the hand moves on to the victim's newer neighbour
            victims.append(k)
        return victims

    def clear(self) -> None:
        self.queue.clear()
        self.visited.clear()
        self.pinned.clear()
        self.hand = None

    def table_sizes(self) -> dict[str, int]:
        return {"nodes": len(self.queue), "pinned": len(self.pinned)}


# -- S3-FIFO ------------------------------------------------------------------------------

_SMALL, _MAIN = "small", "main"


class _Entry:
    def __init__(self, key: OffloadKey, freq: int) -> None:
        self.key, self.freq = key, freq


class S3FIFOModel:
    MAX_FREQ = 3
    PROMOTE = 2

    def __init__(self, capacity: int) -> None:
        self.small_target = max(1, int(capacity * 0.1))
        self.ghost_cap = max(1, capacity - self.small_target)
        # Tail (oldest) first.
        self.small: list[_Entry] = []
        self.main: list[_Entry] = []
        self.ghost: list[OffloadKey] = []
        self.pinned: dict[OffloadKey, tuple[str, int]] = {}
        self.counted_by: dict[OffloadKey, str] = {}  # held or pinned key -> its last counter
        self.live: list[str] = []  # requests seen and not finished, oldest first (65,536 at most)

    def _counts(self, k: OffloadKey, req: str | None) -> bool:
        """Whether a use of `k` by `req` raises its frequency (once per request)."""
        if req is None:
            return True
        self._seen(req)
        if self.counted_by.get(k) == req:
            return False
        self.counted_by[k] = req
        return True

    def _find(self, k: object) -> tuple[list[_Entry], _Entry] | None:
        for queue in (self.small, self.main):
            for entry in queue:
                if entry.key == k:
                    return queue, entry
        return None

    def __len__(self) -> int:
        return len(self.small) + len(self.main)

    def __contains__(self, key: object) -> bool:
        return self._find(key) is not None

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        for k in keys:
            if k in self or k in self.pinned:
                continue
            if k in self.ghost:
                self.ghost.remove(k)
                self.main.append(_Entry(k, 0))
            else:
                self.small.append(_Entry(k, 0))

    def _seen(self, req: str) -> None:
        """A use of a held key by request `req`: remembered as live."""
        if req not in self.live:
            self.live = [*self.live[-65_535:], req]

    def touch(self, keys: Sequence[OffloadKey], req: str | None = None) -> None:
        for k in keys if req is not None else list(dict.fromkeys(keys)):
            found = self._find(k)
            if found is not None and self._counts(k, req):
                found[1].freq = min(found[1].freq + 1, self.MAX_FREQ)

    def pin(self, keys: Sequence[OffloadKey]) -> None:
        for k in keys:
            found = self._find(k)
            if found is not None:
                queue, entry = found
                queue.remove(entry)
                self.pinned[k] = (_SMALL if queue is self.small else _MAIN, entry.freq)

    def unpin(self, keys: Sequence[OffloadKey], req: str | None = None) -> None:
        for k in keys:
            if k in self.pinned:
                name, freq = self.pinned.pop(k)
                queue = self.small if name == _SMALL else self.main
                if self._counts(k, req):
                    freq = min(freq + 1, self.MAX_FREQ)
                queue.append(_Entry(k, freq))

    def remove(self, keys: Sequence[OffloadKey]) -> None:
        for k in keys:
            found = self._find(k)
            if found is not None:
                found[0].remove(found[1])
            self.pinned.pop(k, None)
            self.counted_by.pop(k, None)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        if sum(1 for e in (*self.small, *self.main) if e.key not in protected) < n:
            return None
        victims: list[OffloadKey] = []
        aside_small: list[_Entry] = []
        aside_main: list[_Entry] = []
        while len(victims) < n:
            if self.small and (len(self.small) >= self.small_target or not self.main):
                entry = self.small.pop(0)
                if entry.key in protected:
                    aside_small.append(entry)
                elif entry.freq >= self.PROMOTE:
                    self.main.append(_Entry(entry.key, 0))
                else:
                    self.ghost.append(entry.key)
                    if len(self.ghost) > self.ghost_cap:
                        self.ghost.pop(0)
                    self.counted_by.pop(entry.key, None)
                    victims.append(entry.key)
            else:
                entry = self.main.pop(0)
                if entry.key in protected:
                    aside_main.append(entry)
                elif entry.freq > 0:
                    self.main.append(_Entry(entry.key, entry.freq - 1))
                else:
                    self.counted_by.pop(entry.key, None)
                    victims.append(entry.key)
        self.small[:0] = aside_small
        self.main[:0] = aside_main
        return victims

    def clear(self) -> None:
        self.small.clear()
        self.main.clear()
        self.ghost.clear()
        self.pinned.clear()
        self.counted_by.clear()
        self.live.clear()

    def table_sizes(self) -> dict[str, int]:
        return {
            "small": len(self.small),
            "main": len(self.main),
            "ghost": len(self.ghost),
            "pinned": len(self.pinned),
            "counted_by": len(self.counted_by),
            "request_tokens": len(self.live),
        }


# -- ARC ----------------------------------------------------------------------------------


class ARCModel:
    def __init__(self, capacity: int) -> None:
        self.c = capacity
        # LRU end first.
        self.t1: list[OffloadKey] = []
        self.t2: list[OffloadKey] = []
        self.b1: list[OffloadKey] = []
        self.b2: list[OffloadKey] = []
        self.pinned: dict[OffloadKey, str] = {}
        self.p = 0.0

    def pinned_t1(self) -> int:
        return sum(1 for where in self.pinned.values() if where == "t1")

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        for k in keys:
            if k in self or k in self.pinned:
                continue
            if k in self.b1:
                self.p = min(float(self.c), self.p + max(len(self.b2) / len(self.b1), 1.0))
                self.b1.remove(k)
                self.t2.append(k)
            elif k in self.b2:
                self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
                self.b2.remove(k)
                self.t2.append(k)
            else:
                self.t1.append(k)
                while self.b1 and len(self.t1) + self.pinned_t1() + len(self.b1) > self.c:
                    self.b1.pop(0)
                while self.b2 and sum(self.table_sizes().values()) > 2 * self.c:
                    self.b2.pop(0)

    def touch(self, keys: Sequence[OffloadKey], req: str | None = None) -> None:
        for k in keys:
            if k in self.t1:
                self.t1.remove(k)
                self.t2.append(k)
            elif k in self.t2:
                self.t2.remove(k)
                self.t2.append(k)

    def pin(self, keys: Sequence[OffloadKey]) -> None:
        for k in keys:
            for name, lst in (("t1", self.t1), ("t2", self.t2)):
                if k in lst:
                    lst.remove(k)
                    self.pinned[k] = name

    def unpin(self, keys: Sequence[OffloadKey], req: str | None = None) -> None:
        for k in keys:
            if self.pinned.pop(k, None) is not None:
                self.t2.append(k)

    def remove(self, keys: Sequence[OffloadKey]) -> None:
        for k in keys:
            for lst in (self.t1, self.t2):
                if k in lst:
                    lst.remove(k)
            self.pinned.pop(k, None)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        if sum(1 for k in (*self.t1, *self.t2) if k not in protected) < n:
            return None
        victims: list[OffloadKey] = []
        aside: dict[str, list[OffloadKey]] = {"t1": [], "t2": []}
        pinned_t1 = self.pinned_t1()
        while len(victims) < n:
            if self.t1 and (len(self.t1) + pinned_t1 > self.p or not self.t2):
                k = self.t1.pop(0)
                if k in protected:
                    aside["t1"].append(k)
                    continue
                self.b1.append(k)
            else:
                k = self.t2.pop(0)
                if k in protected:
                    aside["t2"].append(k)
                    continue
                self.b2.append(k)
            victims.append(k)
        self.t1[:0] = aside["t1"]
        self.t2[:0] = aside["t2"]
        return victims

    def clear(self) -> None:
        for lst in (self.t1, self.t2, self.b1, self.b2):
            lst.clear()
        self.pinned.clear()
        self.p = 0.0

    def table_sizes(self) -> dict[str, int]:
        return {
            "t1": len(self.t1),
            "t2": len(self.t2),
            "b1": len(self.b1),
            "b2": len(self.b2),
            "pinned": len(self.pinned),
        }


# -- the differential driver --------------------------------------------------------------

MODELS: dict[str, tuple[Callable[[int], CachePolicy], Callable[[int], Model]]] = {
    "lru": (LRUPolicy, LRUModel),
    "sieve": (SIEVEPolicy, SIEVEModel),
    "s3fifo": (S3FIFOPolicy, S3FIFOModel),
    "arc": (ARCPolicy, ARCModel),
}
CAPACITIES = (1, 2, 3, 5, 8, 13, 24)


class Driver:
    """Random operations, as a manager makes them (mostly) and misuses them (sometimes)."""

    def __init__(self, rng: random.Random, capacity: int) -> None:
        self.rng = rng
        self.capacity = capacity
        self.universe = [key(i) for i in range(3 * capacity + 3)]
        self.held: set[OffloadKey] = set()  # candidates, as the manager would track them
        self.pinned: set[OffloadKey] = set()
        self.req = 0

    def ctx(self, keys: Iterable[OffloadKey]) -> ReqContext:
        self.req += self.rng.random() < 0.3
        return ReqContext(
            f"r{self.req}",
            key_positions={k: self.rng.randint(1, 8) * 16 for k in keys},
        )

    def some(self, n_max: int = 4, pool: Sequence[OffloadKey] | None = None) -> list[OffloadKey]:
        pool = self.universe if pool is None or not pool else pool
        keys = [self.rng.choice(pool) for _ in range(self.rng.randint(1, n_max))]
        if self.rng.random() < 0.2:
            keys.append(keys[0])  # a key twice in one call
        return keys

    def protected(self) -> Collection[OffloadKey]:
        keys = self.rng.sample(self.universe, self.rng.randint(0, len(self.universe) // 2))
        if keys and self.rng.random() < 0.3:
            keys.append(keys[-1])  # given twice: counts once
        return keys if self.rng.random() < 0.5 else set(keys)

    def op(self) -> tuple[str, tuple[object, ...]]:
        """One operation: (name, arguments); the test runs it and updates `held`/`pinned`."""
        r = self.rng.random()
        held = sorted(self.held)
        pinned = sorted(self.pinned)
        if r < 0.35:
            return "store", (self.some(),)
        if r < 0.55:
            return "touch", (self.some(pool=held if self.rng.random() < 0.8 else None),)
        if r < 0.63:
            return "pin", (self.some(2, pool=held if self.rng.random() < 0.8 else None),)
        if r < 0.71:
            return "unpin", (self.some(2, pool=pinned if self.rng.random() < 0.8 else None),)
        if r < 0.76:
            return "remove", (self.some(2),)
        if r < 0.80 and (held or pinned):
            return "insert_held", (self.some(2, pool=held + pinned),)  # a misuse: ignored
        if r < 0.995:
            n = self.rng.randint(0, len(self.held) + 1)
            return "evict", (n, self.protected())
        return "clear", ()


def snapshot(policy: CachePolicy | Model, universe: Sequence[OffloadKey]) -> object:
    return len(policy), [k in policy for k in universe], policy.table_sizes()


def run_differential(name: str, seed: int, capacity: int, steps: int) -> None:
    policy_cls, model_cls = MODELS[name]
    policy, model = policy_cls(capacity), model_cls(capacity)
    rng = random.Random(f"{name}-{seed}-{capacity}")
    d = Driver(rng, capacity)
    for step in range(steps):
        op, args = d.op()
        where = f"{name} seed={seed} capacity={capacity} step={step} op={op}{args}"
        if op == "store":
            # The manager's prepare_store + complete_store: make room, then insert new keys.
            (keys,) = args
            assert isinstance(keys, list)
            new = list(dict.fromkeys(k for k in keys if k not in d.held | d.pinned))
            need = len(d.held) + len(d.pinned) + len(new) - capacity
            if need > 0:
                present = [k for k in keys if k in d.held or k in d.pinned]
                got, want = policy.evict(need, present), model.evict(need, present)
                assert got == want, where
                if got is None:
                    continue
                d.held.difference_update(got)
            c = d.ctx(keys)
            policy.insert(new, c)
            model.insert(new)
            d.held.update(new)
        elif op in ("touch", "insert_held"):
            (keys,) = args
            assert isinstance(keys, list)
            if op == "touch":
                c = d.ctx(keys)
                policy.touch(keys, c)
                model.touch(keys, c.req_id)
            else:
                policy.insert(keys, d.ctx(keys))
                model.insert(keys)
        elif op == "pin":
            (keys,) = args
            assert isinstance(keys, list)
            policy.pin(keys)
            model.pin(keys)
            moved = d.held.intersection(keys)
            d.held -= moved
            d.pinned |= moved
        elif op == "unpin":
            (keys,) = args
            assert isinstance(keys, list)
            c = d.ctx(keys)
            policy.unpin(keys, c)
            model.unpin(keys, c.req_id)
            moved = d.pinned.intersection(keys)
            d.pinned -= moved
            d.held |= moved
        elif op == "remove":
            (keys,) = args
            assert isinstance(keys, list)
            policy.remove(keys)
            model.remove(keys)
            d.held.difference_update(keys)
            d.pinned.difference_update(keys)
        elif op == "evict":
            n, protected = args
            assert isinstance(n, int) and isinstance(protected, Collection)
            before = snapshot(policy, d.universe)
            got, want = policy.evict(n, protected), model.evict(n, protected)
            assert got == want, where
            if got is None:
                assert snapshot(policy, d.universe) == before, where
            else:
                assert len(got) == n and len(set(got)) == n, where
                assert not set(got) & set(protected), where
                assert set(got) <= d.held, where
                d.held.difference_update(got)
        else:
            policy.clear()
            model.clear()
            d.held.clear()
            d.pinned.clear()
        assert snapshot(policy, d.universe) == snapshot(model, d.universe), where
        assert {k for k in d.universe if k in policy} == d.held, where
        # Every per-key table is bounded (docs/policies.md): ARC's lists by 2c together and
        # T1 + B1 by c, S3-FIFO's ghost by the capacity less the small queue's target.
        sizes = policy.table_sizes()
        # Per-key tables; live requests are bounded by the engine's requests instead.
        assert all(v <= 2 * capacity for n, v in sizes.items() if n != "request_tokens"), where
        if isinstance(policy, ARCPolicy):
            assert isinstance(model, ARCModel)
            assert policy.target_t1 == model.p, where
            assert sum(sizes.values()) <= 2 * capacity, where
            assert sizes["t1"] + model.pinned_t1() + sizes["b1"] <= capacity, where
        if isinstance(model, S3FIFOModel):
            assert sizes["ghost"] <= model.ghost_cap, where
    # The whole order, drained: pins returned, then every candidate by eviction.
    policy.unpin(sorted(d.pinned), None)
    model.unpin(sorted(d.pinned))
    assert policy.evict(len(model), ()) == model.evict(len(model), ())


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("capacity", CAPACITIES)
def test_policy_matches_its_reference_model(name: str, capacity: int) -> None:
    for seed in range(3):
        run_differential(name, seed, capacity, steps=400)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_pinned_key_inserted_again_stays_pinned(name: str) -> None:
    # A key the policy holds, pinned or not, is not new: insert ignores it. Otherwise a key a
    # transfer reads could be chosen as a victim.
    policy = MODELS[name][0](4)
    a, b = key(1), key(2)
    policy.insert([a, b], None)
    policy.pin([a])
    policy.insert([a], None)
    assert a not in policy and len(policy) == 1
    assert policy.evict(2, ()) is None
    assert policy.evict(1, ()) == [b]
    policy.unpin([a], None)
    assert policy.evict(1, ()) == [a]


# -- kvaware: the contract ----------------------------------------------------------------


def kvaware_state(policy: KVAwarePolicy) -> object:
    """Everything an evict that returns None must leave as it was."""
    own = (
        list(policy._win.items()),
        dict(policy._credit),
        {c: list(b) for c, b in policy._buckets.items()},
        policy._floor,
        dict(policy._pinned),
        bytes(policy._sketch._table),
        policy._mode,
    )
    models = tuple(kvaware_state(m) for m in policy._models or ())
    return own, models


def check_kvaware_bounds(policy: KVAwarePolicy) -> None:
    sizes = policy.table_sizes()
    cap = policy.capacity
    assert sizes["window"] + sizes["credits"] + sizes["pinned"] <= cap, sizes
    assert sizes["buckets"] <= MAX_COUNT + 1, sizes
    for name, size in sizes.items():
        if name.startswith("shadow") or name == "replica":
            assert size <= max(1, cap), sizes
    assert sizes["request_keys_live"] <= 512 * max(2 * cap, 1024), sizes
    assert set(policy._credit) == {k for b in policy._buckets.values() for k in b}
    assert all(b for b in policy._buckets.values())
    assert not set(policy._pinned) & (set(policy._win) | set(policy._credit))


@pytest.mark.parametrize("capacity", (1, 2, 3, 8, 40))
@pytest.mark.parametrize("mode", ("adaptive", "filter", "open"))
def test_kvaware_keeps_the_contract_under_random_operations(capacity: int, mode: str) -> None:
    policy = KVAwarePolicy(capacity, mode=mode)
    rng = random.Random(f"kvaware-{capacity}-{mode}")
    d = Driver(rng, capacity)
    for step in range(1500):
        op, args = d.op()
        where = f"kvaware {mode} capacity={capacity} step={step} op={op}{args}"
        if op == "store":
            (keys,) = args
            assert isinstance(keys, list)
            new = list(dict.fromkeys(k for k in keys if k not in d.held | d.pinned))
            need = len(d.held) + len(d.pinned) + len(new) - capacity
            if need > 0:
                present = [k for k in keys if k in d.held or k in d.pinned]
                available = len(d.held - set(present))
                before = kvaware_state(policy)
                got = policy.evict(need, present)
                if got is None:
                    assert available < need, where
                    assert kvaware_state(policy) == before, where
                    continue
                assert len(got) == need and len(set(got)) == need, where
                assert set(got) <= d.held - set(present), where
                d.held.difference_update(got)
            policy.insert(new, d.ctx(keys))
            d.held.update(new)
        elif op == "touch":
            (keys,) = args
            assert isinstance(keys, list)
            policy.touch(keys, d.ctx(keys))
        elif op == "insert_held":
            (keys,) = args
            assert isinstance(keys, list)
            policy.insert(keys, d.ctx(keys))
        elif op == "pin":
            (keys,) = args
            assert isinstance(keys, list)
            policy.pin(keys)
            moved = d.held.intersection(keys)
            d.held -= moved
            d.pinned |= moved
        elif op == "unpin":
            (keys,) = args
            assert isinstance(keys, list)
            c = d.ctx(keys)
            policy.unpin(keys, c)
            moved = d.pinned.intersection(keys)
            d.pinned -= moved
            d.held |= moved
            if rng.random() < 0.3:
                policy.on_request_finished(c)
        elif op == "remove":
            (keys,) = args
            assert isinstance(keys, list)
            policy.remove(keys)
            d.held.difference_update(keys)
            d.pinned.difference_update(keys)
        elif op == "evict":
            n, protected = args
            assert isinstance(n, int) and isinstance(protected, Collection)
            available = len(d.held - set(protected))
            before = kvaware_state(policy)
            got = policy.evict(n, protected)
            if got is None:
                assert available < n, where
                assert kvaware_state(policy) == before, where
            else:
                assert n <= available and len(got) == max(n, 0), where
                assert len(set(got)) == len(got), where
                assert set(got) <= d.held - set(protected), where
                d.held.difference_update(got)
        else:
            policy.clear()
            d.held.clear()
            d.pinned.clear()
            assert all(v == 0 for n, v in policy.table_sizes().items() if n != "sketch_counters")
        assert len(policy) == len(d.held), where
        assert {k for k in d.universe if k in policy} == d.held, where
        check_kvaware_bounds(policy)


def test_kvaware_evict_of_more_than_it_holds_changes_nothing_even_when_protected() -> None:
    policy = KVAwarePolicy(8, mode="filter")
    keys = [key(i) for i in range(8)]
    for k in keys:
        policy.insert([k], ReqContext("r", key_positions={k: 16}))
    policy.evict(1, ())  # the window's surplus moves to main
    policy.touch(keys[2:5], None)
    before = kvaware_state(policy)
    assert policy.evict(6, keys[:3] + keys[:1]) is None
    assert policy.evict(8, ()) is None
    assert kvaware_state(policy) == before
