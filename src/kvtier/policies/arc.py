"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

from kvtier.base import OffloadKey, ReqContext
from kvtier.policies.base import CachePolicy, checked_protected, register_policy

_T1 = 1
_T2 = 2


@register_policy(
    "arc",
    "adaptive replacement cache: balances recency (T1) against frequency (T2) with ghost lists",
)
class ARCPolicy(CachePolicy):
    """Evicts from the once-used list T1 or the reused list T2, whichever is over its adaptive
    target `p`; ghost hits in B1 (evicted from T1) grow `p`, ghost hits in B2 shrink it.

    The manager evicts before it inserts, so the ghost hit that textbook ARC sees before its
    REPLACE step is seen here at `insert`, one eviction later (docs/policies.md).
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # Each OrderedDict is LRU first; values unused.
        self._t1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._t2: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b2: OrderedDict[OffloadKey, None] = OrderedDict()
        # Pinned keys remember their list so unpinning can count as a hit from it.
        self._pinned: dict[OffloadKey, int] = {}
        self._pinned_t1 = 0
        self._p = 0.0

    @property
    def target_t1(self) -> float:
        """ARC's adaptive target size `p` of T1."""
        return self._p

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def insert(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        # Hot path: locals and local size counters only, and the ghost bounds enforced inline
        # where a key enters T1 (the only place they can be exceeded), so no helper call.
        t1, t2, b1, b2, pinned = self._t1, self._t2, self._b1, self._b2, self._pinned
        c = self.capacity
        c2 = 2 * c
        n_t1 = len(t1) + self._pinned_t1
        n_b1, n_b2 = len(b1), len(b2)
        n_rest = len(pinned) - self._pinned_t1 + len(t2)  # keys held outside T1
        for key in keys:
            if key in t1 or key in t2 or key in pinned:
                continue
            if key in b1:
                # A key evicted from T1 came back: T1 was too small.
                self._p = min(float(c), self._p + max(n_b2 / n_b1, 1.0))
                del b1[key]
                n_b1 -= 1
                t2[key] = None
                n_rest += 1
            elif key in b2:
                self._p = max(0.0, self._p - max(n_b1 / n_b2, 1.0))
                del b2[key]
                n_b2 -= 1
                t2[key] = None
                n_rest += 1
            else:
                t1[key] = None
                n_t1 += 1
                # ARC's directory bounds: |T1| + |B1| <= c and the four lists together <= 2c.
                while n_b1 and n_t1 + n_b1 > c:
                    b1.popitem(last=False)
                    n_b1 -= 1
                while n_b2 and n_rest + n_t1 + n_b1 + n_b2 > c2:
                    b2.popitem(last=False)
                    n_b2 -= 1

    def touch(self, keys: Iterable[OffloadKey], ctx: ReqContext | None) -> None:
        t1, t2 = self._t1, self._t2
        for key in keys:
            if key in t1:
                del t1[key]
                t2[key] = None
            elif key in t2:
                t2.move_to_end(key)

    def pin(self, keys: Iterable[OffloadKey]) -> None:
        t1, t2, pinned = self._t1, self._t2, self._pinned
        for key in keys:
            if key in t1:
                del t1[key]
                pinned[key] = _T1
                self._pinned_t1 += 1
            elif key in t2:
                del t2[key]
                pinned[key] = _T2

    def unpin(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        t2, pinned = self._t2, self._pinned
        for key in keys:
            where = pinned.pop(key, None)
            if where is None:
                continue
            if where == _T1:
                self._pinned_t1 -= 1
            # Unpinning is a use, and a used key belongs at the MRU end of T2.
            t2[key] = None

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        t1, t2, pinned = self._t1, self._t2, self._pinned
        for key in keys:
            t1.pop(key, None)
            t2.pop(key, None)
            if pinned.pop(key, None) == _T1:
                self._pinned_t1 -= 1

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        if protected:
            protected = checked_protected(protected)
            blocked = sum(1 for k in protected if k in t1 or k in t2)
            if len(t1) + len(t2) - blocked < n:
                return None
            return self._evict_around(n, protected)
        if len(t1) + len(t2) < n:
            return None
        victims: list[OffloadKey] = []
        append = victims.append
        p, pinned_t1 = self._p, self._pinned_t1
        n_t1, n_t2 = len(t1), len(t2)
        for _ in range(n):
            # REPLACE: take from T1 when it exceeds its target (or T2 has nothing to give).
            if n_t1 and (n_t1 + pinned_t1 > p or not n_t2):
                key = t1.popitem(last=False)[0]
                b1[key] = None
                n_t1 -= 1
            else:
                key = t2.popitem(last=False)[0]
                b2[key] = None
                n_t2 -= 1
            append(key)
        return victims

    def _evict_around(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey]:
        # evict() with keys to pass over; the caller checked that n victims exist.
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        p, pinned_t1 = self._p, self._pinned_t1
        victims: list[OffloadKey] = []
        skipped1: list[OffloadKey] = []
        skipped2: list[OffloadKey] = []
        while len(victims) < n:
            if t1 and (len(t1) + pinned_t1 > p or not t2):
                key = t1.popitem(last=False)[0]
                if key in protected:
                    skipped1.append(key)
                    continue
                b1[key] = None
            else:
                key = t2.popitem(last=False)[0]
                if key in protected:
                    skipped2.append(key)
                    continue
                b2[key] = None
            victims.append(key)
        # Protected keys go back to the LRU end they were taken from, in order.
        for src, skipped in ((t1, skipped1), (t2, skipped2)):
            for key in reversed(skipped):
                src[key] = None
                src.move_to_end(key, last=False)
        return victims

    def clear(self) -> None:
        for table in (self._t1, self._t2, self._b1, self._b2):
            table.clear()
        self._pinned.clear()
        self._pinned_t1 = 0
        self._p = 0.0

    def table_sizes(self) -> dict[str, int]:
        """Sizes of T1, T2, the ghosts B1 and B2, and the pinned keys."""
        return {
            "t1": len(self._t1),
            "t2": len(self._t2),
            "b1": len(self._b1),
            "b2": len(self._b2),
            "pinned": len(self._pinned),
        }
