"""LRU, ARC, S3-FIFO and SIEVE against small references written from the published algorithms.

Each reference is a slow list-based restatement of its paper, with only the differences that
docs/policies.md documents (evict before insert, promotion threshold, per-request counting,
pins, protected keys). A seeded random driver plays the manager's part: it evicts before it
inserts (so the tier never holds more than its capacity), pins and unpins, touches with and
without a request, removes, and evicts around protected keys. Victims, membership and the
references' invariants (pinned keys are never victims, ARC's ghost bounds) are checked after
every call.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from helpers import key
from kvtier.base import OffloadKey, ReqContext
from kvtier.policies import ARCPolicy, CachePolicy, LRUPolicy, S3FIFOPolicy, SIEVEPolicy


class Ref:
    """The reference interface: the policy's, with a request id for the ctx."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    def held(self) -> set[OffloadKey]:
        raise NotImplementedError

    def pinned(self) -> set[OffloadKey]:
        raise NotImplementedError

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        raise NotImplementedError

    def touch(self, keys: Sequence[OffloadKey], req: str | None) -> None:
        raise NotImplementedError

    def pin(self, keys: Sequence[OffloadKey]) -> None:
        raise NotImplementedError

    def unpin(self, keys: Sequence[OffloadKey], req: str | None) -> None:
        raise NotImplementedError

    def remove(self, keys: Sequence[OffloadKey]) -> None:
        raise NotImplementedError

    def evict(self, n: int, protected: set[OffloadKey]) -> list[OffloadKey] | None:
        raise NotImplementedError


class LRURef(Ref):
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: list[OffloadKey] = []  # LRU first
        self.pins: set[OffloadKey] = set()

    def held(self) -> set[OffloadKey]:
        return set(self.order)

    def pinned(self) -> set[OffloadKey]:
        return set(self.pins)

    def _use(self, k: OffloadKey) -> None:
        self.order.remove(k)
        self.order.append(k)

    # Documented: a call's keys are applied tail first (the head ends up most recent).
    def insert(self, keys: Sequence[OffloadKey]) -> None:
        for k in reversed(keys):
            if k not in self.order and k not in self.pins:
                self.order.append(k)

    def touch(self, keys: Sequence[OffloadKey], req: str | None) -> None:
        for k in reversed(keys):
            if k in self.order:
                self._use(k)

    def pin(self, keys: Sequence[OffloadKey]) -> None:
        for k in keys:
            if k in self.order:
                self.order.remove(k)
                self.pins.add(k)

    def unpin(self, keys: Sequence[OffloadKey], req: str | None) -> None:
        for k in reversed(keys):
            if k in self.pins:
                self.pins.discard(k)
                self.order.append(k)

    def remove(self, keys: Sequence[OffloadKey]) -> None:
        for k in keys:
            if k in self.order:
                self.order.remove(k)
            self.pins.discard(k)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[OffloadKey] | None:
        victims = [k for k in self.order if k not in protected][:n]
        if len(victims) < n:
            return None
        for k in victims:
            self.order.remove(k)
        return victims


class ARCRef(Ref):
    """Megiddo & Modha (FAST'03), Fig. 4, with kvtier's documented evict-before-insert:
    REPLACE picks T1 when |T1| > p (pinned T1 keys counted, keys set aside by `protected` not),
    and the ghost hit adapts p at insert; the Case IV directory bounds hold after insert."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.t1: list[OffloadKey] = []
        self.t2: list[OffloadKey] = []
        self.b1: list[OffloadKey] = []
        self.b2: list[OffloadKey] = []
        self.pins: dict[OffloadKey, int] = {}
        self.p = 0.0

    def held(self) -> set[OffloadKey]:
        return set(self.t1) | set(self.t2)

    def pinned(self) -> set[OffloadKey]:
        return set(self.pins)

    def pinned_t1(self) -> int:
        return sum(1 for w in self.pins.values() if w == 1)

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        c = self.capacity
        for k in keys:
            if k in self.t1 or k in self.t2 or k in self.pins:
                continue
            if k in self.b1:  # Case II
                d1 = 1.0 if len(self.b1) >= len(self.b2) else len(self.b2) / len(self.b1)
                self.p = min(self.p + d1, float(c))
                self.b1.remove(k)
                self.t2.append(k)
            elif k in self.b2:  # Case III
                d2 = 1.0 if len(self.b2) >= len(self.b1) else len(self.b1) / len(self.b2)
                self.p = max(self.p - d2, 0.0)
                self.b2.remove(k)
                self.t2.append(k)
            else:  # Case IV
                self.t1.append(k)
                while self.b1 and len(self.t1) + self.pinned_t1() + len(self.b1) > c:
                    self.b1.pop(0)
                total = len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2)
                while self.b2 and total + len(self.pins) > 2 * c:
                    self.b2.pop(0)
                    total -= 1

    def touch(self, keys: Sequence[OffloadKey], req: str | None) -> None:
        for k in keys:  # Case I: a hit goes to T2's MRU end
            if k in self.t1:
                self.t1.remove(k)
                self.t2.append(k)
            elif k in self.t2:
                self.t2.remove(k)
                self.t2.append(k)

    def pin(self, keys: Sequence[OffloadKey]) -> None:
        for k in keys:
            if k in self.t1:
                self.t1.remove(k)
                self.pins[k] = 1
            elif k in self.t2:
                self.t2.remove(k)
                self.pins[k] = 2

    def unpin(self, keys: Sequence[OffloadKey], req: str | None) -> None:
        for k in keys:
            if k in self.pins:
                del self.pins[k]
                self.t2.append(k)

    def remove(self, keys: Sequence[OffloadKey]) -> None:
        for k in keys:
            for lst in (self.t1, self.t2):
                if k in lst:
                    lst.remove(k)
            self.pins.pop(k, None)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[OffloadKey] | None:
        if len([k for k in self.t1 + self.t2 if k not in protected]) < n:
            return None
        t1, t2 = list(self.t1), list(self.t2)  # what REPLACE still sees this call
        victims: list[OffloadKey] = []
        pt1 = self.pinned_t1()
        while len(victims) < n:
            if t1 and (len(t1) + pt1 > self.p or not t2):
                k = t1.pop(0)
                if k in protected:
                    continue
                self.t1.remove(k)
                self.b1.append(k)
            else:
                k = t2.pop(0)
                if k in protected:
                    continue
                self.t2.remove(k)
                self.b2.append(k)
            victims.append(k)
        return victims

    def check(self) -> None:
        c = self.capacity
        assert len(self.t1) + self.pinned_t1() + len(self.b1) <= c
        lists = len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2)
        assert lists + len(self.pins) <= 2 * c
        assert 0.0 <= self.p <= c


class S3FIFORef(Ref):
    """Yang et al. (SOSP'23) Algorithm 1 with kvtier's documented choices: promote when
    freq >= 2 (frequency restarts at 0), the queue is chosen again after each step, the ghost
    holds capacity - small target keys, a request raises a key's frequency once."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.target = max(1, int(capacity * 0.1))
        self.ghost_cap = max(1, capacity - self.target)
        self.small: list[OffloadKey] = []  # tail (oldest) first
        self.main: list[OffloadKey] = []
        self.ghost: list[OffloadKey] = []
        self.freq: dict[OffloadKey, int] = {}
        self.pins: dict[OffloadKey, str] = {}
        self.counted: dict[OffloadKey, str] = {}

    def held(self) -> set[OffloadKey]:
        return set(self.small) | set(self.main)

    def pinned(self) -> set[OffloadKey]:
        return set(self.pins)

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        for k in keys:
            if k in self.small or k in self.main or k in self.pins:
                continue
            self.freq[k] = 0
            if k in self.ghost:
                self.ghost.remove(k)
                self.main.append(k)
            else:
                self.small.append(k)

    def _bump(self, k: OffloadKey, req: str | None) -> None:
        if req is not None:
            if self.counted.get(k) == req:
                return
            self.counted[k] = req
        self.freq[k] = min(self.freq[k] + 1, 3)

    def touch(self, keys: Sequence[OffloadKey], req: str | None) -> None:
        done: set[OffloadKey] = set()
        for k in keys:
            if k not in self.small and k not in self.main:
                continue
            if req is None:
                if k in done:
                    continue
                done.add(k)
            self._bump(k, req)

    def pin(self, keys: Sequence[OffloadKey]) -> None:
        for k in keys:
            if k in self.small:
                self.small.remove(k)
                self.pins[k] = "small"
            elif k in self.main:
                self.main.remove(k)
                self.pins[k] = "main"

    def unpin(self, keys: Sequence[OffloadKey], req: str | None) -> None:
        for k in keys:
            if k in self.pins:
                where = self.pins.pop(k)
                self._bump(k, req)
                (self.small if where == "small" else self.main).append(k)

    def remove(self, keys: Sequence[OffloadKey]) -> None:
        for k in keys:
            for lst in (self.small, self.main):
                if k in lst:
                    lst.remove(k)
            self.pins.pop(k, None)
            self.counted.pop(k, None)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[OffloadKey] | None:
        if len([k for k in self.small + self.main if k not in protected]) < n:
            return None
        victims: list[OffloadKey] = []
        held_s: list[OffloadKey] = []
        held_m: list[OffloadKey] = []
        while len(victims) < n:
            if self.small and (len(self.small) >= self.target or not self.main):
                k = self.small.pop(0)
                if k in protected:
                    held_s.append(k)
                elif self.freq[k] >= 2:
                    self.freq[k] = 0
                    self.main.append(k)
                else:
                    self.ghost.append(k)
                    if len(self.ghost) > self.ghost_cap:
                        self.ghost.pop(0)
                    self.counted.pop(k, None)
                    victims.append(k)
            else:
                k = self.main.pop(0)
                if k in protected:
                    held_m.append(k)
                elif self.freq[k] > 0:
                    self.freq[k] -= 1
                    self.main.append(k)
                else:
                    self.counted.pop(k, None)
                    victims.append(k)
        self.small[:0] = held_s
        self.main[:0] = held_m
        return victims

    def check(self) -> None:
        assert len(self.ghost) <= self.ghost_cap
        assert not set(self.ghost) & (self.held() | set(self.pins))


class SIEVERef(Ref):
    """Zhang et al. (NSDI'24): new keys at the head, the hand walks tail -> head clearing
    visited bits and wraps to the tail; after an eviction it stays at the victim's newer
    neighbour. Pinned and protected keys are passed over with their bit; unpin sets it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.q: list[OffloadKey] = []  # tail (oldest) first, pinned keys included
        self.visited: dict[OffloadKey, bool] = {}
        self.pins: set[OffloadKey] = set()
        self.hand: OffloadKey | None = None

    def held(self) -> set[OffloadKey]:
        return set(self.q) - self.pins

    def pinned(self) -> set[OffloadKey]:
        return set(self.pins)

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        for k in keys:
            if k not in self.visited:
                self.q.append(k)
                self.visited[k] = False

    def touch(self, keys: Sequence[OffloadKey], req: str | None) -> None:
        for k in keys:
            if k in self.visited and k not in self.pins:
                self.visited[k] = True

    def pin(self, keys: Sequence[OffloadKey]) -> None:
        for k in keys:
            if k in self.visited:
                self.pins.add(k)

    def unpin(self, keys: Sequence[OffloadKey], req: str | None) -> None:
        for k in keys:
            if k in self.pins:
                self.pins.discard(k)
                self.visited[k] = True

    def _drop(self, k: OffloadKey) -> None:
        i = self.q.index(k)
        if self.hand == k:
            self.hand = self.q[i + 1] if i + 1 < len(self.q) else None
        del self.q[i]
        del self.visited[k]
        self.pins.discard(k)

    def remove(self, keys: Sequence[OffloadKey]) -> None:
        for k in keys:
            if k in self.visited:
                self._drop(k)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[OffloadKey] | None:
        if len(self.held() - protected) < n:
            return None
        victims: list[OffloadKey] = []
        i = 0 if self.hand is None else self.q.index(self.hand)
        while len(victims) < n:
            k = self.q[i]
            if k in self.pins or k in protected:
                i += 1
            elif self.visited[k]:
                self.visited[k] = False
                i += 1
            else:
                del self.q[i]
                del self.visited[k]
                victims.append(k)
            if i >= len(self.q):
                i = 0
        self.hand = self.q[i] if self.q else None
        return victims


REFS: dict[str, type[Ref]] = {"lru": LRURef, "arc": ARCRef, "s3fifo": S3FIFORef, "sieve": SIEVERef}
POLICIES: dict[str, type[CachePolicy]] = {
    "lru": LRUPolicy,
    "arc": ARCPolicy,
    "s3fifo": S3FIFOPolicy,
    "sieve": SIEVEPolicy,
}


def _ctx(req: str | None) -> ReqContext | None:
    return None if req is None else ReqContext(req_id=req)


def _drive(name: str, capacity: int, seed: int, steps: int) -> None:
    rng = random.Random(seed)
    pol = POLICIES[name](capacity)
    ref = REFS[name](capacity)
    universe = [key(i) for i in range(3 * capacity + 4)]
    reqs: list[str | None] = [None, "a", "b", "c"]
    for step in range(steps):
        op = rng.random()
        held, pins = ref.held(), ref.pinned()
        what = ""
        if op < 0.35:
            # A store: make room the manager's way (evict around the call's present keys).
            batch = rng.choices(universe, k=rng.randint(1, 3))
            new = [k for k in dict.fromkeys(batch) if k not in held and k not in pins]
            need = len(held) + len(pins) + len(new) - capacity
            present = {k for k in batch if k in held}
            if need > 0:
                got, want = pol.evict(need, present), ref.evict(need, present)
                what = f"evict({need}) before insert"
                assert got == want, (step, what)
                if got is None:
                    continue
                assert not set(got) & (pins | present)
            pol.insert(batch, None)
            ref.insert(batch)
            what = "insert"
        elif op < 0.55:
            batch = rng.choices(universe, k=rng.randint(1, 4))
            req = rng.choice(reqs)
            pol.touch(batch, _ctx(req))
            ref.touch(batch, req)
            what = "touch"
        elif op < 0.65:
            batch = rng.choices(universe, k=rng.randint(1, 3))
            pol.pin(batch)
            ref.pin(batch)
            what = "pin"
        elif op < 0.77:
            batch = rng.choices(sorted(pins) or universe, k=rng.randint(1, 3))
            req = rng.choice(reqs)
            pol.unpin(batch, _ctx(req))
            ref.unpin(batch, req)
            what = "unpin"
        elif op < 0.82:
            batch = rng.sample(universe, rng.randint(1, 2))
            pol.remove(batch)
            ref.remove(batch)
            what = "remove"
        else:
            n = rng.randint(0, 3)
            # The manager passes a list; pinned keys may be in it.
            protected_list = rng.choices(universe + sorted(pins), k=rng.randint(0, 4))
            protected = set(protected_list)
            got, want = pol.evict(n, protected_list), ref.evict(n, protected)
            what = f"evict({n})"
            assert got == want, (step, what)
            if got is not None:
                assert not set(got) & (pins | protected)
        assert {k for k in universe if k in pol} == ref.held(), (step, what)
        assert len(pol) == len(ref.held()), (step, what)
        check = getattr(ref, "check", None)
        if check is not None:
            check()


@pytest.mark.parametrize("name", sorted(REFS))
@pytest.mark.parametrize("capacity", [1, 3, 10, 25])
def test_policy_follows_its_published_algorithm(name: str, capacity: int) -> None:
    for seed in range(6):
        _drive(name, capacity, seed, 600)


def test_arc_ghost_bounds_and_p_follow_the_paper() -> None:
    # Drive ARC through a ghost-heavy pattern and compare p and list sizes with the reference.
    for seed in range(5):
        rng = random.Random(seed)
        c = 8
        pol, ref = ARCPolicy(c), ARCRef(c)
        universe = [key(i) for i in range(40)]
        for _ in range(2000):
            k = rng.choice(universe[: rng.choice([12, 40])])
            if k in pol:
                pol.touch([k], None)
                ref.touch([k], None)
                continue
            if len(pol) >= c:
                assert pol.evict(1, ()) == ref.evict(1, set())
            pol.insert([k], None)
            ref.insert([k])
            ref.check()
            assert pol.target_t1 == ref.p
            sizes = pol.table_sizes()
            assert (sizes["t1"], sizes["t2"], sizes["b1"], sizes["b2"]) == (
                len(ref.t1),
                len(ref.t2),
                len(ref.b1),
                len(ref.b2),
            )


@pytest.mark.parametrize(("name", "victim"), [("lru", 2), ("arc", 0), ("s3fifo", 0), ("sieve", 0)])
def test_order_within_one_call_is_as_documented(name: str, victim: int) -> None:
    # docs/policies.md "Order within a call": LRU applies a call's keys tail first (the head
    # ends most recent); ARC, S3-FIFO and SIEVE in the order given (the head leaves first).
    pol = POLICIES[name](3)
    ks = [key(0), key(1), key(2)]
    pol.insert(ks, None)
    assert pol.evict(1, ()) == [ks[victim]]


def test_s3fifo_small_target_rounds_down_and_ignores_pinned_keys() -> None:
    # docs/policies.md: target max(1, int(0.1 * capacity)); pinned small keys do not count.
    assert S3FIFOPolicy(15)._small_target == 1
    assert S3FIFOPolicy(1828)._small_target == 182
    pol = S3FIFOPolicy(20)  # target 2
    x, a, b = key(0), key(1), key(2)
    pol.insert([x], None)
    assert pol.evict(1, ()) == [x]  # main is empty: from small, into the ghost
    pol.insert([x], None)  # a ghost hit: into main
    pol.insert([a, b], None)
    pol.pin([a])
    # Small holds one candidate (a is pinned): below its target, so main gives the victim.
    assert pol.evict(1, ()) == [x]
