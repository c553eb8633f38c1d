"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

from kvtier.base import OffloadKey, ReqContext
from kvtier.policies.base import CachePolicy, register_policy

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
        c = self.capacity
        for key in keys:
            if key in self._t1 or key in self._t2 or key in self._pinned:
                continue
            if key in self._b1:
                # A key evicted from T1 came back: T1 was too small.
                self._p = min(float(c), self._p + max(len(self._b2) / len(self._b1), 1.0))
                del self._b1[key]
                self._t2[key] = None
            elif key in self._b2:
                self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))
                del self._b2[key]
                self._t2[key] = None
            else:
                self._t1[key] = None
                self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        # ARC's directory bounds: |T1| + |B1| <= c and the four lists together <= 2c.
        c = self.capacity
        t1 = len(self._t1) + self._pinned_t1
        while self._b1 and t1 + len(self._b1) > c:
            self._b1.popitem(last=False)
        total = len(self._pinned) + len(self) + len(self._b1) + len(self._b2)
        while self._b2 and total > 2 * c:
            self._b2.popitem(last=False)
            total -= 1

    def touch(self, keys: Iterable[OffloadKey], ctx: ReqContext | None) -> None:
        for key in keys:
            if key in self._t1:
                del self._t1[key]
                self._t2[key] = None
            elif key in self._t2:
                self._t2.move_to_end(key)

    def pin(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            if key in self._t1:
                del self._t1[key]
                self._pinned[key] = _T1
                self._pinned_t1 += 1
            elif key in self._t2:
                del self._t2[key]
                self._pinned[key] = _T2

    def unpin(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        for key in keys:
            where = self._pinned.pop(key, None)
            if where is None:
                continue
            if where == _T1:
                self._pinned_t1 -= 1
            # Unpinning is a use, and a used key belongs at the MRU end of T2.
            self._t2[key] = None

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            self._t1.pop(key, None)
            self._t2.pop(key, None)
            if self._pinned.pop(key, None) == _T1:
                self._pinned_t1 -= 1

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        blocked = sum(1 for k in protected if k in self._t1 or k in self._t2)
        if len(self) - blocked < n:
            return None
        victims: list[OffloadKey] = []
        skipped1: list[OffloadKey] = []
        skipped2: list[OffloadKey] = []
        while len(victims) < n:
            # REPLACE: take from T1 when it exceeds its target (or T2 has nothing to give).
            t1_size = len(self._t1) + self._pinned_t1
            from_t1 = bool(self._t1) and (t1_size > self._p or not self._t2)
            src, ghost, skipped = (
                (self._t1, self._b1, skipped1) if from_t1 else (self._t2, self._b2, skipped2)
            )
            key, _ = src.popitem(last=False)
            if key in protected:
                skipped.append(key)
                continue
            ghost[key] = None
            victims.append(key)
        # Protected keys go back to the LRU end they were taken from, in order.
        for src, skipped in ((self._t1, skipped1), (self._t2, skipped2)):
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
