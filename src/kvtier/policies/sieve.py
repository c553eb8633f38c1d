"""SIEVE: a FIFO queue with a moving hand and a visited bit (Zhang et al., NSDI'24)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from kvtier.base import OffloadKey, ReqContext
from kvtier.policies.base import CachePolicy, checked_protected, register_policy


class _Node:
    __slots__ = ("key", "newer", "older", "pinned", "visited")

    def __init__(self, key: OffloadKey) -> None:
        self.key = key
        self.newer: _Node | None = None
        self.older: _Node | None = None
        self.visited = False
        self.pinned = False


@register_policy(
    "sieve",
    "SIEVE: a hand sweeps the FIFO from old to new, sparing visited keys in place",
)
class SIEVEPolicy(CachePolicy):
    """Keys enter at the head of one FIFO and are never moved. The hand walks from the tail
    toward the head: a visited key loses its bit and stays where it is, the first unvisited
    key is evicted, and the hand stays at that point for the next eviction.

    A pinned key keeps its place and is passed over; unpinning marks it visited.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._nodes: dict[OffloadKey, _Node] = {}
        self._head: _Node | None = None  # newest
        self._tail: _Node | None = None  # oldest
        self._hand: _Node | None = None
        self._num_pinned = 0

    def __len__(self) -> int:
        return len(self._nodes) - self._num_pinned

    def __contains__(self, key: object) -> bool:
        node = self._nodes.get(key)  # type: ignore[call-overload]
        return node is not None and not node.pinned

    def insert(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        nodes = self._nodes
        head = self._head
        for key in keys:
            if key in nodes:
                continue
            node = _Node(key)
            node.older = head
            if head is not None:
                head.newer = node
            else:
                self._tail = node
            head = nodes[key] = node
        self._head = head

    def touch(self, keys: Iterable[OffloadKey], ctx: ReqContext | None) -> None:
        nodes = self._nodes
        for key in keys:
            node = nodes.get(key)
            if node is not None and not node.pinned:
                node.visited = True

    def pin(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            node = self._nodes.get(key)
            if node is not None and not node.pinned:
                node.pinned = True
                self._num_pinned += 1

    def unpin(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        for key in keys:
            node = self._nodes.get(key)
            if node is not None and node.pinned:
                node.pinned = False
                node.visited = True
                self._num_pinned -= 1

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            node = self._nodes.get(key)
            if node is not None:
                self._unlink(node)

    def _unlink(self, node: _Node) -> None:
        if self._hand is node:
            self._hand = node.newer
        if node.newer is not None:
            node.newer.older = node.older
        else:
            self._head = node.older
        if node.older is not None:
            node.older.newer = node.newer
        else:
            self._tail = node.newer
        if node.pinned:
            self._num_pinned -= 1
        del self._nodes[node.key]

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        if protected:
            protected = checked_protected(protected)
            blocked = sum(1 for k in protected if k in self)
        else:
            blocked = 0
        if len(self) - blocked < n:
            return None
        nodes = self._nodes
        victims: list[OffloadKey] = []
        tail = self._tail
        hand = self._hand if self._hand is not None else tail
        while len(victims) < n:
            assert hand is not None
            nxt = hand.newer
            if hand.pinned or (protected and hand.key in protected):
                pass
            elif hand.visited:
                hand.visited = False
            else:
                # Unlink the victim (inline _unlink: the hand is set below, not moved here).
                older = hand.older
                if nxt is not None:
                    nxt.older = older
                else:
                    self._head = older
                if older is not None:
                    older.newer = nxt
                else:
                    tail = self._tail = nxt
                del nodes[hand.key]
                victims.append(hand.key)
            # Past the head the sweep starts again from the tail.
            hand = nxt if nxt is not None else tail
        self._hand = hand
        return victims

    def clear(self) -> None:
        self._nodes.clear()
        self._head = self._tail = self._hand = None
        self._num_pinned = 0

    def table_sizes(self) -> dict[str, int]:
        """Sizes of the node table (candidates and pinned keys) and of the pinned keys."""
        return {"nodes": len(self._nodes), "pinned": self._num_pinned}
