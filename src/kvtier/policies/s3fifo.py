"""S3-FIFO: three static FIFO queues (Yang et al., SOSP'23)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

from kvtier.base import OffloadKey, ReqContext
from kvtier.policies.base import CachePolicy, register_policy

_MAX_FREQ = 3
_SMALL = 0
_MAIN = 1


@register_policy(
    "s3fifo",
    "S3-FIFO: a small probationary FIFO filters one-hit wonders before a main CLOCK-like FIFO",
)
class S3FIFOPolicy(CachePolicy):
    """New keys enter a small FIFO (10% of capacity); a key reused while there moves to the
    main FIFO, the others leave and are remembered in a ghost FIFO. A ghost hit enters main
    directly. Main evicts like CLOCK with a 2-bit frequency: a reused key is reinserted with
    its count decremented.
    """

    def __init__(self, capacity: int, small_ratio: float = 0.1, promote_freq: int = 2) -> None:
        super().__init__(capacity)
        capacity = self.capacity  # validated, and a plain int
        if not 0.0 < small_ratio < 1.0:
            raise ValueError(f"small_ratio={small_ratio} is invalid; expected 0 < ratio < 1")
        self._small_target = max(1, int(capacity * small_ratio))
        self._ghost_cap = max(1, capacity - self._small_target)
        # Frequencies stop at _MAX_FREQ: a threshold above it would promote nothing, one
        # below 1 everything (no filter at all).
        if (
            isinstance(promote_freq, bool)
            or not isinstance(promote_freq, int)
            or not (1 <= promote_freq <= _MAX_FREQ)
        ):
            raise ValueError(
                f"promote_freq={promote_freq!r} is invalid; expected an integer from 1 to "
                f"{_MAX_FREQ} (frequencies stop at {_MAX_FREQ})"
            )
        self._promote_freq = promote_freq
        # Queues map key -> access frequency (0..3); the first item is the oldest (tail).
        self._small: OrderedDict[OffloadKey, int] = OrderedDict()
        self._main: OrderedDict[OffloadKey, int] = OrderedDict()
        self._ghost: OrderedDict[OffloadKey, None] = OrderedDict()
        # Pinned key -> (queue, frequency), so unpinning puts it back where it was.
        self._pinned: dict[OffloadKey, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._main

    def insert(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        small, main, ghost, pinned = self._small, self._main, self._ghost, self._pinned
        for key in keys:
            if key in small or key in main or key in pinned:
                continue
            if key in ghost:
                del ghost[key]
                main[key] = 0
            else:
                small[key] = 0

    def touch(self, keys: Iterable[OffloadKey], ctx: ReqContext | None) -> None:
        # A hit only bumps a counter: S3-FIFO never reorders on a hit (assigning to a key
        # an OrderedDict holds keeps its place).
        small, main = self._small, self._main
        for key in keys:
            freq = small.get(key)
            if freq is not None:
                if freq < _MAX_FREQ:
                    small[key] = freq + 1
                continue
            freq = main.get(key)
            if freq is not None and freq < _MAX_FREQ:
                main[key] = freq + 1

    def pin(self, keys: Iterable[OffloadKey]) -> None:
        small, main, pinned = self._small, self._main, self._pinned
        for key in keys:
            if key in small:
                pinned[key] = (_SMALL, small.pop(key))
            elif key in main:
                pinned[key] = (_MAIN, main.pop(key))

    def unpin(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        small, main, pinned = self._small, self._main, self._pinned
        for key in keys:
            entry = pinned.pop(key, None)
            if entry is None:
                continue
            queue, freq = entry
            # The key left its place while pinned; it returns at the head, counted as a hit.
            (small if queue == _SMALL else main)[key] = min(freq + 1, _MAX_FREQ)

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        small, main, pinned = self._small, self._main, self._pinned
        for key in keys:
            small.pop(key, None)
            main.pop(key, None)
            pinned.pop(key, None)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        small, main, ghost = self._small, self._main, self._ghost
        if protected:
            if not isinstance(protected, (set, frozenset, dict)):
                protected = set(protected)
            blocked = sum(1 for k in protected if k in small or k in main)
        else:
            blocked = 0
        if len(small) + len(main) - blocked < n:
            return None
        victims: list[OffloadKey] = []
        held_small: list[tuple[OffloadKey, int]] = []
        held_main: list[tuple[OffloadKey, int]] = []
        small_target, promote = self._small_target, self._promote_freq
        ghost_cap = self._ghost_cap
        while len(victims) < n:
            if small and (len(small) >= small_target or not main):
                key, freq = small.popitem(last=False)
                if protected and key in protected:
                    held_small.append((key, freq))
                elif freq >= promote:
                    # Reused while on probation: worth a place in main; frequency restarts.
                    main[key] = 0
                else:
                    ghost[key] = None
                    if len(ghost) > ghost_cap:
                        ghost.popitem(last=False)
                    victims.append(key)
            else:
                key, freq = main.popitem(last=False)
                if protected and key in protected:
                    held_main.append((key, freq))
                elif freq > 0:
                    main[key] = freq - 1
                else:
                    victims.append(key)
        # Protected keys return to the tail they were taken from, in their order.
        for queue, held in ((small, held_small), (main, held_main)):
            for key, freq in reversed(held):
                queue[key] = freq
                queue.move_to_end(key, last=False)
        return victims

    def clear(self) -> None:
        self._small.clear()
        self._main.clear()
        self._ghost.clear()
        self._pinned.clear()

    def table_sizes(self) -> dict[str, int]:
        """Sizes of the small, main and ghost queues and of the pinned keys."""
        return {
            "small": len(self._small),
            "main": len(self._main),
            "ghost": len(self._ghost),
            "pinned": len(self._pinned),
        }
