"""Least recently used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

from kvtier.base import OffloadKey, ReqContext
from kvtier.policies.base import CachePolicy, register_policy


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

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    # A call's keys come head first. They are applied tail first so that a prefix's head ends
    # up most recent: its tail is useless without it, so the tail should leave first.

    def insert(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        order = self._order
        for key in reversed(keys):
            order[key] = None

    def touch(self, keys: Iterable[OffloadKey], ctx: ReqContext | None) -> None:
        order = self._order
        for key in reversed(list(keys)):
            if key in order:
                order.move_to_end(key)

    def pin(self, keys: Iterable[OffloadKey]) -> None:
        order = self._order
        for key in keys:
            order.pop(key, None)

    def unpin(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        self.insert(keys, ctx)

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        self.pin(keys)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        if n > len(self._order):
            return None
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
