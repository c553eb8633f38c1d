"""Least recently used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

from kvtier.base import OffloadKey, ReqContext
from kvtier.policies.base import CachePolicy, checked_protected, register_policy


@register_policy(
    "lru",
    "least recently used: evicts the chunk used longest ago (a prefix's tail before its head)",
)
class LRUPolicy(CachePolicy):
    """Evicts the candidate used least recently; an unpinned key counts as just used."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # Oldest first; values unused. OrderedDict gives O(1) move-to-end and delete.
        self._order: OrderedDict[OffloadKey, None] = OrderedDict()
        # Pinned keys, so that unpin returns only those, never a key removed (or cleared)
        # while pinned.
        self._pinned: set[OffloadKey] = set()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    # A call's keys come head first. They are applied tail first so that a prefix's head ends
    # up most recent: its tail is useless without it, so the tail should leave first.

    def insert(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        order, pinned = self._order, self._pinned
        if pinned:
            # A pinned key is held already: inserting it again must not make it a candidate
            # (a victim while a transfer reads it), as every other policy ignores it.
            for key in reversed(keys):
                if key not in pinned:
                    order[key] = None
            return
        for key in reversed(keys):
            order[key] = None

    def touch(self, keys: Iterable[OffloadKey], ctx: ReqContext | None) -> None:
        order = self._order
        for key in reversed(list(keys)):
            if key in order:
                order.move_to_end(key)

    def prefix_extended(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        # Not `touch`: a subclass may count a use there, and one whose use does not move a key
        # (FIFO) still needs its prefix in the order a single call would have left it.
        order = self._order
        for key in reversed(keys):
            if key in order:
                order.move_to_end(key)

    def pin(self, keys: Iterable[OffloadKey]) -> None:
        order, pinned = self._order, self._pinned
        for key in keys:
            if key in order:
                del order[key]
                pinned.add(key)

    def unpin(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        order, pinned = self._order, self._pinned
        for key in reversed(keys):
            if key in pinned:
                pinned.discard(key)
                order[key] = None

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        order, pinned = self._order, self._pinned
        for key in keys:
            order.pop(key, None)
            pinned.discard(key)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        if n > len(self._order):
            return None
        if protected:
            protected = checked_protected(protected)  # the manager passes a list: O(1) lookups
        victims: list[OffloadKey] = []
        for key in self._order:
            if key not in protected:
                victims.append(key)
                if len(victims) == n:
                    break
        else:
            return None
        for key in victims:
            del self._order[key]
        return victims

    def clear(self) -> None:
        self._order.clear()
        self._pinned.clear()

    def table_sizes(self) -> dict[str, int]:
        return {"candidates": len(self._order), "pinned": len(self._pinned)}
