"""Prefix-aware eviction for KV-cache blocks: a frequency filter, switched on and off by two
miniature simulations, in front of GreedyDual-Frequency.

The design and its measurements are in docs/policies.md ("The KV-aware policy").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

from kvtier.base import OffloadKey, ReqContext
from kvtier.policies.base import CachePolicy, register_policy

_M64 = (1 << 64) - 1
# Odd 64-bit multipliers: one per sketch row, one to pick the keys the shadow models see.
_ROWS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
_SAMPLE = 0xA24BAED4963EE407
_HALVE = bytes(v >> 1 for v in range(256))
_MAX_COUNT = 15
# Where a pinned key returns at unpin.
_MAIN, _WINDOW, _WINDOW_TAIL = 0, 1, 2
# (admit every block leaving the window, apply the deepest-block rule, credit by count), one
# shadow each. The first is the starting mode; the last two are LRU with and without the rule.
_MODES = (
    (True, True, True),
    (False, True, True),
    (True, False, True),
    (False, False, True),
    (True, False, False),
    (True, True, False),
)
_MODE_NAMES = ("adaptive", "filter", "open")


def key_hash(key: object) -> int:
    """A hash of `key` that is the same in every process (`hash()` of bytes is salted)."""
    if type(key) is bytes:
        return hash(int.from_bytes(key, "big"))
    return hash(key)


class FrequencySketch:
    """Count-min sketch of recent access counts: 4 rows of `width` one-byte counters capped at
    15, all halved every `period` accesses so that old popularity fades. Fixed size."""

    def __init__(self, width: int, period: int) -> None:
        bits = max(4, (width - 1).bit_length())
        self.width = 1 << bits
        self._shift = 64 - bits
        self._table = bytearray(4 * self.width)
        self._period = max(1, period)
        self._added = 0

    def _cells(self, h: int) -> tuple[int, int, int, int]:
        s, w = self._shift, self.width
        r0, r1, r2, r3 = _ROWS
        return (
            ((h * r0) & _M64) >> s,
            w + (((h * r1) & _M64) >> s),
            2 * w + (((h * r2) & _M64) >> s),
            3 * w + (((h * r3) & _M64) >> s),
        )

    def estimate(self, h: int) -> int:
        """Recent access count of hash `h` (an over-estimate only through collisions)."""
        t = self._table
        a, b, c, d = self._cells(h)
        return min(t[a], t[b], t[c], t[d])

    def add(self, h: int) -> int:
        """Count one access of hash `h` and return its new estimate."""
        t = self._table
        a, b, c, d = self._cells(h)
        low = min(t[a], t[b], t[c], t[d])
        if low < _MAX_COUNT:
            # Conservative update: only the counters at the minimum rise.
            low += 1
            for i in (a, b, c, d):
                if t[i] < low:
                    t[i] = low
        self._added += 1
        if self._added >= self._period:
            self._table = self._table.translate(_HALVE)
            self._added //= 2
        return low

    def clear(self) -> None:
        """Forget every count."""
        self._table = bytearray(len(self._table))
        self._added = 0

    def __len__(self) -> int:
        return len(self._table)


@register_policy(
    "kvaware",
    "prefix-aware: a frequency filter (switched by shadow simulations) before "
    "GreedyDual-Frequency; a request's deepest block goes first, heads outlive their tails",
)
class KVAwarePolicy(CachePolicy):
    """New blocks enter a small LRU window. A block leaving the window competes with the main
    area's victim: it is admitted when its recent access count (a count-min sketch, which
    remembers blocks long after they are evicted) beats the victim's, or always when the
    filter is switched off. The main area is GreedyDual-Frequency: a use sets a block's credit
    to the floor plus its count, eviction takes the lowest credit and raises the floor to it.

    Shadow copies of the policy, each in one fixed mode, replay a hash-sampled subset of the
    keys at a proportionally smaller capacity (miniature simulation); the policy takes the
    mode of the shadow with the most recent hits.

    Prefix structure: a request's deepest block (usually partial, so rarely reused) enters
    the window last in line and passes it only by beating the victim's count, then sits at
    the floor; a call's keys are applied tail first so a prefix's head outlives its tail.
    Whether the filter, the deepest-block rule and the use counts pay is left to six shadows
    (the four filter/rule combinations with counts, and two without counts, which make the
    main area plain LRU): the policy follows whichever has the most recent hits.

    `mode="filter"` or `"open"` fixes the filter (rule on, no shadows), for comparisons.
    Every per-key table is bounded by the capacity (the shadows by their own, smaller one);
    the sketch has `4 * sketch_width * capacity` one-byte counters, rounded up to a power of 2.
    """

    def __init__(
        self,
        capacity: int,
        window: float = 0.01,
        sketch_width: int = 32,
        model_size: int = 256,
        mode: str = "adaptive",
        *,
        _shared: FrequencySketch | None = None,
        _admit_all: bool = True,
        _tail_first: bool = True,
        _counts: bool = True,
    ) -> None:
        super().__init__(capacity)
        if not 0.0 < window < 1.0:
            raise ValueError(f"window={window} is invalid; expected 0 < window < 1")
        if sketch_width < 1:
            raise ValueError(f"sketch_width={sketch_width} is invalid; expected >= 1")
        if model_size < 1:
            raise ValueError(f"model_size={model_size} is invalid; expected >= 1")
        if mode not in _MODE_NAMES:
            raise ValueError(f"mode={mode!r} is invalid; expected one of {_MODE_NAMES}")
        self._win_target = max(1, int(window * capacity))
        # Window keys -> whether the key is its request's deepest block; oldest first.
        self._win: OrderedDict[OffloadKey, bool] = OrderedDict()
        self._credit: dict[OffloadKey, int] = {}
        self._buckets: dict[int, OrderedDict[OffloadKey, None]] = {}
        self._floor = 0
        self._pinned: dict[OffloadKey, int] = {}
        self._tail_req: str | None = None
        self._tail_key: OffloadKey | None = None
        self._admit_all = _admit_all if mode == "adaptive" else mode == "open"
        self._tail_first = _tail_first if mode == "adaptive" else True
        self._counts = _counts if mode == "adaptive" else True
        self._mode = 0
        self._models: tuple[KVAwarePolicy, ...] | None = None
        self._owns_sketch = _shared is None
        if _shared is not None:
            self._sketch = _shared
            return
        # Counts fade over 32 capacities' worth of accesses: long enough to span the gap
        # between a conversation's turns in a cache that cannot hold the conversation.
        width = sketch_width * capacity
        self._sketch = FrequencySketch(width, width)
        if mode != "adaptive":
            return
        shift = max(0, (capacity // model_size).bit_length() - 1)
        self._sample_shift = 64 - shift if shift else 0
        mcap = max(1, capacity >> shift)
        self._models = tuple(
            KVAwarePolicy(
                mcap, window, _shared=self._sketch, _admit_all=a, _tail_first=t, _counts=f
            )
            for a, t, f in _MODES
        )
        self._model_hits = [0.0] * len(_MODES)
        self._admit_all, self._tail_first, self._counts = _MODES[0]
        self._keep = 1.0 - 1.0 / (8 * mcap)  # hits fade over 8 shadow capacities

    @property
    def filtering(self) -> bool:
        """Whether blocks leaving the window must beat the main victim's count to stay."""
        return not self._admit_all

    def __len__(self) -> int:
        return len(self._win) + len(self._credit)

    def __contains__(self, key: object) -> bool:
        return key in self._win or key in self._credit

    # -- per-access bookkeeping ------------------------------------------------------------

    def _is_tail(self, key: OffloadKey, ctx: ReqContext | None) -> bool:
        if ctx is None or not ctx.key_positions or not self._tail_first:
            return False
        if ctx.req_id != self._tail_req:
            # Once per request: O(request length).
            positions = ctx.key_positions
            self._tail_req = ctx.req_id
            self._tail_key = max(positions, key=positions.__getitem__)
        return key == self._tail_key

    def _seen(self, key: OffloadKey, ctx: ReqContext | None) -> int:
        """Count an access of `key`, feed the shadows if it is sampled; its recent count."""
        h = key_hash(key)
        if not self._owns_sketch:
            return self._sketch.estimate(h)
        count = self._sketch.add(h)
        models = self._models
        if models is not None and (
            not self._sample_shift or not ((h * _SAMPLE) & _M64) >> self._sample_shift
        ):
            keep, hits = self._keep, self._model_hits
            for i, model in enumerate(models):
                hits[i] = hits[i] * keep + model._replay(key, ctx)
            best = max(range(len(hits)), key=hits.__getitem__)
            # Only a strictly better shadow moves the policy: ties keep the current mode.
            if hits[best] > hits[self._mode]:
                self._mode = best
                self._admit_all, self._tail_first, self._counts = _MODES[best]
        return count

    def _replay(self, key: OffloadKey, ctx: ReqContext | None) -> int:
        """Shadow use: one access as a cache of `capacity` slots sees it; 1 on a hit."""
        if key in self:
            self.touch((key,), ctx)
            return 1
        if len(self) >= self.capacity:
            self.evict(1, ())
        self.insert((key,), ctx)
        return 0

    def _place(self, key: OffloadKey, count: int, tail: bool) -> None:
        # Without counts every use earns the same credit: the main area is then plain LRU.
        gain = 0 if tail else max(count, 1) if self._counts else 1
        credit = self._floor + gain
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

    # -- the CachePolicy interface ---------------------------------------------------------

    def insert(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        win, credit, pinned = self._win, self._credit, self._pinned
        for key in reversed(keys):
            if key in win or key in credit or key in pinned:
                continue
            self._seen(key, ctx)
            tail = self._is_tail(key, ctx)
            win[key] = tail
            if tail:
                win.move_to_end(key, last=False)

    def touch(self, keys: Iterable[OffloadKey], ctx: ReqContext | None) -> None:
        win = self._win
        for key in reversed(list(keys)):
            if key in win:
                win.move_to_end(key)
                self._seen(key, ctx)
            elif self._unplace(key):
                self._place(key, self._seen(key, ctx), self._is_tail(key, ctx))

    def pin(self, keys: Iterable[OffloadKey]) -> None:
        win = self._win
        for key in keys:
            tail = win.pop(key, None)
            if tail is not None:
                self._pinned[key] = _WINDOW_TAIL if tail else _WINDOW
            elif self._unplace(key):
                self._pinned[key] = _MAIN

    def unpin(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        for key in reversed(keys):
            where = self._pinned.pop(key, None)
            if where is None:
                continue
            count = self._seen(key, ctx)
            if where == _MAIN:
                self._place(key, count, self._is_tail(key, ctx))
            else:
                self._win[key] = where == _WINDOW_TAIL

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            self._pinned.pop(key, None)
            self._win.pop(key, None)
            self._unplace(key)

    def _main_victim(self, protected: Collection[OffloadKey]) -> OffloadKey | None:
        # Credits lie in [floor, floor + 15]: placed there, and the floor only rises. The
        # floor may pass only credits with no key at all, or protected keys would be stranded.
        buckets = self._buckets
        raise_floor = True
        for credit in range(self._floor, self._floor + _MAX_COUNT + 1):
            bucket = buckets.get(credit)
            if bucket is None:
                continue
            for key in bucket:
                if key not in protected:
                    if raise_floor:
                        self._floor = credit
                    return key
            raise_floor = False
        return None

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        if protected and not isinstance(protected, (set, frozenset, dict)):
            protected = set(protected)  # O(1) membership, and a repeated key counts once
        blocked = sum(1 for k in protected if k in self) if protected else 0
        if len(self) - blocked < n:
            return None
        victims: list[OffloadKey] = []
        win, target, sketch = self._win, self._win_target, self._sketch
        while len(victims) < n:
            # A window over its size (the tier was filling) hands its surplus to main.
            while len(win) > target:
                moved, tail = win.popitem(last=False)
                self._place(moved, sketch.estimate(key_hash(moved)), tail)
            cand = _first(win, protected) if len(win) == target else None
            victim = self._main_victim(protected) if self._credit else None
            if cand is not None and victim is not None:
                tail = win.pop(cand)
                count = sketch.estimate(key_hash(cand))
                if (self._admit_all and not tail) or count > sketch.estimate(key_hash(victim)):
                    self._unplace(victim)
                    self._place(cand, count, tail)
                    victims.append(victim)
                else:
                    victims.append(cand)
            elif victim is not None:
                self._unplace(victim)
                victims.append(victim)
            else:
                cand = _first(win, protected)
                assert cand is not None, "the count check above guarantees a candidate"
                del win[cand]
                victims.append(cand)
        return victims

    def clear(self) -> None:
        self._win.clear()
        self._credit.clear()
        self._buckets.clear()
        self._pinned.clear()
        self._floor = 0
        self._tail_req = self._tail_key = None
        if self._owns_sketch:
            self._sketch.clear()
        if self._models is not None:
            for model in self._models:
                model.clear()
            self._model_hits = [0.0] * len(_MODES)
            self._admit_all, self._tail_first, self._counts = _MODES[0]

    def on_request_finished(self, ctx: ReqContext) -> None:
        if ctx.req_id == self._tail_req:
            self._tail_req = self._tail_key = None
        if self._models is not None:
            for model in self._models:
                model.on_request_finished(ctx)

    def table_sizes(self) -> dict[str, int]:
        """Per-key tables (window, credits, pinned, each shadow's keys), the credit buckets
        (at most 16), and the fixed-size sketch's counters (`sketch_counters`)."""
        sizes = {
            "window": len(self._win),
            "credits": len(self._credit),
            "buckets": len(self._buckets),
            "pinned": len(self._pinned),
        }
        if self._models is not None:
            for i, model in enumerate(self._models):
                sizes[f"shadow{i}"] = len(model)
            sizes["sketch_counters"] = len(self._sketch)
        return sizes


def _first(
    table: OrderedDict[OffloadKey, bool], protected: Collection[OffloadKey]
) -> OffloadKey | None:
    for key in table:
        if key not in protected:
            return key
    return None
