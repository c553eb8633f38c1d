"""Prefix-aware GreedyDual-Frequency eviction for KV-cache blocks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

from kvtier.base import OffloadKey, ReqContext
from kvtier.policies.base import CachePolicy, register_policy


@register_policy(
    "kvaware",
    "prefix-aware GreedyDual-Frequency: a block's credit is its use count (remembered past "
    "eviction), credits age as victims are taken, a request's deepest block goes first",
)
class KVAwarePolicy(CachePolicy):
    """Evicts the block with the lowest credit. A use sets a block's credit to the current
    floor `L` plus its use count; each eviction raises `L` to the victim's credit, so blocks
    that stop being used age out however often they were used before.

    Use counts outlive eviction in a history bounded to `history_factor * capacity` keys: a
    conversation's blocks come back at its next turn, usually long after an LRU window would
    have forgotten them, and the count is what says they are the conversation's. The deepest
    block of a request enters at the floor itself: a prefix hit on it needs every ancestor
    and the next turn to end on exactly the same token, so it is the least likely to serve.

    Credits are integers kept in buckets (one LRU queue per credit); the floor only rises,
    so finding the victim is amortised O(1) with counts capped at `max_count`.
    """

    def __init__(self, capacity: int, history_factor: int = 8, max_count: int = 64) -> None:
        super().__init__(capacity)
        if history_factor < 1:
            raise ValueError(f"history_factor={history_factor} is invalid; expected >= 1")
        if max_count < 1:
            raise ValueError(f"max_count={max_count} is invalid; expected >= 1")
        self._history_cap = history_factor * capacity
        self._max_count = max_count
        self._credit: dict[OffloadKey, int] = {}
        self._buckets: dict[int, OrderedDict[OffloadKey, None]] = {}
        self._floor = 0
        self._pinned: set[OffloadKey] = set()
        # Use counts of resident and evicted keys, least recently used first.
        self._counts: OrderedDict[OffloadKey, int] = OrderedDict()
        self._tail_req: str | None = None
        self._tail_key: OffloadKey | None = None

    def __len__(self) -> int:
        return len(self._credit)

    def __contains__(self, key: object) -> bool:
        return key in self._credit

    def _is_tail(self, key: OffloadKey, ctx: ReqContext | None) -> bool:
        if ctx is None or not ctx.key_positions:
            return False
        if ctx.req_id != self._tail_req:
            # Once per request: O(request length), not O(pool).
            positions = ctx.key_positions
            self._tail_req = ctx.req_id
            self._tail_key = max(positions, key=positions.__getitem__)
        return key == self._tail_key

    def _use(self, key: OffloadKey) -> int:
        counts = self._counts
        count = min(counts.pop(key, 0) + 1, self._max_count)
        counts[key] = count
        # At most one pass: if held keys alone exceed the bound (more keys held than the
        # capacity promised), the history holds just them rather than looping forever.
        for _ in range(len(counts)):
            if len(counts) <= self._history_cap:
                break
            old, old_count = counts.popitem(last=False)
            if old in self._credit or old in self._pinned:
                # Held keys keep their count; the bound is on what is remembered past eviction.
                counts[old] = old_count
        return count

    def _place(self, key: OffloadKey, ctx: ReqContext | None) -> None:
        count = self._use(key)
        credit = self._floor if self._is_tail(key, ctx) else self._floor + count
        self._credit[key] = credit
        bucket = self._buckets.get(credit)
        if bucket is None:
            bucket = self._buckets[credit] = OrderedDict()
        bucket[key] = None

    def _unplace(self, key: OffloadKey) -> bool:
        credit = self._credit.pop(key, None)
        if credit is None:
            return False
        bucket = self._buckets[credit]
        del bucket[key]
        if not bucket:
            del self._buckets[credit]
        return True

    def insert(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        for key in keys:
            if key not in self._credit and key not in self._pinned:
                self._place(key, ctx)

    def touch(self, keys: Iterable[OffloadKey], ctx: ReqContext | None) -> None:
        for key in keys:
            if self._unplace(key):
                self._place(key, ctx)

    def pin(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            if self._unplace(key):
                self._pinned.add(key)

    def unpin(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        for key in keys:
            if key in self._pinned:
                self._pinned.discard(key)
                self._place(key, ctx)

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            self._pinned.discard(key)
            self._unplace(key)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        blocked = sum(1 for k in protected if k in self._credit)
        if len(self) - blocked < n:
            return None
        victims: list[OffloadKey] = []
        credit = self._floor
        buckets = self._buckets
        # The floor may only pass credits that hold no key at all, or protected keys would
        # be stranded below it where no later scan looks.
        raise_floor = True
        while len(victims) < n:
            bucket = buckets.get(credit)
            found = False
            if bucket is not None:
                for key in bucket:
                    if key not in protected:
                        victims.append(key)
                        found = True
                        break
                else:
                    raise_floor = False
            if not found:
                # Credits never drop below the floor, so the next candidate is above it.
                credit += 1
                continue
            self._unplace(victims[-1])
            if raise_floor:
                self._floor = credit
        return victims

    def clear(self) -> None:
        self._credit.clear()
        self._buckets.clear()
        self._pinned.clear()
        self._counts.clear()
        self._floor = 0
        self._tail_req = self._tail_key = None

    def on_request_finished(self, ctx: ReqContext) -> None:
        if ctx.req_id == self._tail_req:
            self._tail_req = self._tail_key = None

    def table_sizes(self) -> dict[str, int]:
        """Sizes of the credit table, the credit buckets, the pinned keys and the history."""
        return {
            "credits": len(self._credit),
            "buckets": len(self._buckets),
            "pinned": len(self._pinned),
            "history": len(self._counts),
        }
