"""Least Hit Density eviction (Beckmann et al., NSDI'18) with classes a prefix cache knows.

The design and its measurements are in docs/policies.md ("The hit-density policy").
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

import numpy as np

from kvtier.base import OffloadKey, ReqContext
from kvtier.policies.base import CachePolicy, register_policy
from kvtier.policies.kvaware import FrequencySketch, key_hash

_AGES = 128  # age buckets per class; ages past the horizon share the last one
# Recent access count (1..15 from the sketch; 0 only through collisions) -> count bucket.
_COUNT_BUCKET = (0, 0, 1, 2, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5)
_COUNTS = 6
_DEPTHS = 4
_CLASSES = _COUNTS * 2 * _DEPTHS
_HOT = (_COUNTS - 1) * 2 * _DEPTHS  # classes from here on: 10 or more recent accesses
_REUSE_OCTAVES = 48  # log2 histogram of reuse distances, in accesses
_M64 = (1 << 64) - 1
_SAMPLE = 0xA24BAED4963EE407  # odd multiplier that picks the tracked keys
_SEED = 0x4C4844  # "LHD": a constant seed keeps every run reproducible


def _depth_bucket(position: int | None, block_tokens: int) -> int:
    # Block index in its prefix: the first block (shared by many requests), the next three,
    # up to 16, beyond. Unknown depth counts as deep.
    if position is None:
        return _DEPTHS - 1
    block = (position - 1) // block_tokens
    return 0 if block <= 0 else 1 if block < 4 else 2 if block < 16 else 3


@register_policy(
    "hitdensity",
    "Least Hit Density: evicts the sampled chunk with the fewest expected hits per slot and "
    "access, learned per class (recent count, deepest block of its request, depth) and age",
)
class HitDensityPolicy(CachePolicy):
    """Evicts, among `sample` candidates drawn at random, the one with the lowest hit density:
    the probability that it is used again within the horizon, divided by the time it is
    expected to hold its slot until then, given its class and its age (accesses since its
    last use).

    A key's class is fixed at its last use: its recent access count (a count-min sketch that
    outlives eviction), whether it was the deepest block of its request, and its depth in the
    prefix. The densities are learned from a hash-sampled subset of all keys, resident or not
    (at most `2 * capacity` tracked), so a class the tier evicts early still shows what it
    would earn if kept. The horizon is `reach` times the `quantile` of the tracked reuse
    distances, rounded to a power of two; densities are recomputed every `interval` accesses
    from counters that decay by `decay` each time. Every per-key table holds at most
    `2 * capacity` keys; the per-class tables and the sketch have a fixed size.
    """

    def __init__(
        self,
        capacity: int,
        sample: int = 32,
        interval: int = 4096,
        decay: float = 0.98,
        reach: float = 4.0,
        quantile: float = 0.5,
        sketch_width: int = 32,
        block_tokens: int = 512,
    ) -> None:
        super().__init__(capacity)
        if sample < 1:
            raise ValueError(f"sample={sample} is invalid; expected >= 1")
        if interval < 1:
            raise ValueError(f"interval={interval} is invalid; expected >= 1")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay={decay} is invalid; expected 0 <= decay < 1")
        if reach <= 0.0:
            raise ValueError(f"reach={reach} is invalid; expected > 0")
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile={quantile} is invalid; expected 0 < quantile <= 1")
        if sketch_width < 1:
            raise ValueError(f"sketch_width={sketch_width} is invalid; expected >= 1")
        if block_tokens < 1:
            raise ValueError(f"block_tokens={block_tokens} is invalid; expected >= 1")
        self._sample = sample
        self._interval = interval
        self._decay = decay
        self._reach = reach
        self._quantile = quantile
        self._block_tokens = block_tokens
        width = sketch_width * capacity
        self._sketch = FrequencySketch(width, width)
        self._hits = np.zeros((_CLASSES, _AGES))
        self._expired = np.zeros((_CLASSES, _AGES))
        self._reuse = np.zeros(_REUSE_OCTAVES)
        # Dense candidate arrays: a random index is a random candidate, and swap-remove
        # keeps insert and remove O(1).
        self._keys: list[OffloadKey] = []
        self._stamp: list[int] = []
        self._cls: list[int] = []
        self._index: dict[OffloadKey, int] = {}
        self._pinned: set[OffloadKey] = set()  # an unpin is a use: class and age restart
        # Tracked keys -> (class, last use), least recently used first.
        self._track: OrderedDict[OffloadKey, tuple[int, int]] = OrderedDict()
        self._tail_req: str | None = None
        self._tail_key: OffloadKey | None = None
        self._start()

    def _start(self) -> None:
        """Set the learned state to its initial value."""
        self._rng = random.Random(_SEED)
        self._now = self._since = 0
        # Age unit 2**shift accesses; the horizon is _AGES units. Start at 16 capacities.
        self._shift = max(0, (16 * self.capacity // _AGES).bit_length() - 1)
        self._track_bits = 0  # track keys whose sampled hash has this many leading zeros
        self._set_rate()
        # Until something is learned, older is worth less: the policy starts LRU-like.
        row = [1.0 / (a + 1) for a in range(_AGES)]
        self._density = [row] * _CLASSES

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    # -- learning --------------------------------------------------------------------------

    def _age(self, stamp: int) -> int:
        age = (self._now - stamp) >> self._shift
        return age if age < _AGES else _AGES - 1

    def _access(self, key: OffloadKey, ctx: ReqContext | None) -> int:
        """Count one access of `key`, learn from it if it is tracked; return its class."""
        h = key_hash(key)
        count = self._sketch.add(h)
        tail = 0
        depth = _DEPTHS - 1
        if ctx is not None and ctx.key_positions:
            positions = ctx.key_positions
            if ctx.req_id != self._tail_req:
                self._tail_req = ctx.req_id  # once per request: O(request length)
                self._tail_key = max(positions, key=positions.__getitem__)
            tail = 1 if key == self._tail_key else 0
            depth = _depth_bucket(positions.get(key), self._block_tokens)
        cls = (_COUNT_BUCKET[count] * 2 + tail) * _DEPTHS + depth
        self._now += 1
        bits = self._track_bits
        if not bits or not ((h * _SAMPLE) & _M64) >> (64 - bits):
            self._observe(key, cls)
        self._since += 1
        if self._since >= self._interval:
            self._recompute()
        return cls

    def _observe(self, key: OffloadKey, cls: int) -> None:
        # What each class earns if kept: the reuse ages of tracked keys, resident or not.
        track, now = self._track, self._now
        prev = track.pop(key, None)
        if prev is not None:
            c, t = prev
            distance = now - t
            if c < _HOT:  # the hottest keys would swamp the distribution when sampled
                self._reuse[min(distance.bit_length(), _REUSE_OCTAVES - 1)] += 1.0
            age = distance >> self._shift
            if age < _AGES - 1:
                self._hits[c, age] += 1.0
            else:
                self._expired[c, _AGES - 1] += 1.0  # a reuse past the horizon is no hit
        track[key] = (cls, now)
        if len(track) > 2 * self.capacity:
            k, (c, t) = next(iter(track.items()))
            del track[k]
            self._expired[c, self._age(t)] += 1.0

    def _recompute(self) -> None:
        self._since = 0
        self._adapt_horizon()
        hits, expired = self._hits, self._expired
        # LHD: hits after age a over the slot-time spent from age a until a hit or expiry.
        hits_after = np.cumsum(hits[:, ::-1], axis=1)[:, ::-1]
        ends_after = np.cumsum((hits + expired)[:, ::-1], axis=1)[:, ::-1]
        lifetime = np.cumsum(ends_after[:, ::-1], axis=1)[:, ::-1]
        density = np.zeros_like(hits_after)
        np.divide(hits_after, lifetime, out=density, where=lifetime > 1e-9)
        self._density = density.tolist()
        hits *= self._decay
        expired *= self._decay
        self._reuse *= self._decay

    def _adapt_horizon(self) -> None:
        reuse = np.cumsum(self._reuse)
        if reuse[-1] > 0:
            octave = int(np.searchsorted(reuse, reuse[-1] * self._quantile))
            target = self._reach * (1 << octave)  # the quantile's octave, at its upper end
            shift = max(0, int(target / _AGES).bit_length() - 1)
            # One factor of two per recomputation, rescaling the counters to the new unit.
            if shift > self._shift:
                for t in (self._hits, self._expired):
                    merged = t[:, 0::2] + t[:, 1::2]
                    t[:, : _AGES // 2] = merged
                    t[:, _AGES // 2 :] = 0.0
                self._shift += 1
            elif shift < self._shift:
                for t in (self._hits, self._expired):
                    last = t[:, _AGES // 2 :].sum(axis=1)
                    t[:] = np.repeat(t[:, : _AGES // 2] / 2, 2, axis=1)
                    t[:, -1] += last
                self._shift -= 1
        self._set_rate()

    def _set_rate(self) -> None:
        # About 2 * capacity tracked keys are seen within two horizons: sample 1 in
        # horizon / capacity keys (at most one key is seen per access).
        horizon = _AGES << self._shift
        self._track_bits = max(0, (horizon // self.capacity).bit_length() - 1)

    # -- the candidate array ---------------------------------------------------------------

    def _add(self, key: OffloadKey, cls: int) -> None:
        self._index[key] = len(self._keys)
        self._keys.append(key)
        self._stamp.append(self._now)
        self._cls.append(cls)

    def _drop(self, i: int) -> None:
        keys, stamp, cls = self._keys, self._stamp, self._cls
        del self._index[keys[i]]
        last = len(keys) - 1
        if i != last:
            moved = keys[last]
            keys[i], stamp[i], cls[i] = moved, stamp[last], cls[last]
            self._index[moved] = i
        keys.pop()
        stamp.pop()
        cls.pop()

    # -- the CachePolicy interface ---------------------------------------------------------

    def insert(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        index, pinned = self._index, self._pinned
        for key in keys:
            if key not in index and key not in pinned:
                self._add(key, self._access(key, ctx))

    def touch(self, keys: Iterable[OffloadKey], ctx: ReqContext | None) -> None:
        index = self._index
        for key in keys:
            i = index.get(key)
            if i is not None:
                self._cls[i] = self._access(key, ctx)
                self._stamp[i] = self._now

    def pin(self, keys: Iterable[OffloadKey]) -> None:
        index = self._index
        for key in keys:
            i = index.get(key)
            if i is not None:
                self._pinned.add(key)
                self._drop(i)

    def unpin(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        for key in keys:
            if key in self._pinned:
                self._pinned.discard(key)
                self._add(key, self._access(key, ctx))

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            self._pinned.discard(key)
            i = self._index.get(key)
            if i is not None:
                self._drop(i)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        if protected and not isinstance(protected, (set, frozenset, dict)):
            protected = set(protected)  # O(1) membership, and a repeated key counts once
        index = self._index
        blocked = sum(1 for k in protected if k in index) if protected else 0
        if len(self._keys) - blocked < n:
            return None
        keys, stamp, cls, density = self._keys, self._stamp, self._cls, self._density
        rand = self._rng.random
        now, shift, last_age, sample = self._now, self._shift, _AGES - 1, self._sample
        victims: list[OffloadKey] = []
        for _ in range(n):
            size = len(keys)
            best = -1
            best_density = 0.0
            for _ in range(min(sample, size)):
                i = int(rand() * size)
                age = (now - stamp[i]) >> shift
                # Past the horizon no hit is expected: those go first, oldest first.
                d = density[cls[i]][age] if age < last_age else -age
                if (best < 0 or d < best_density) and keys[i] not in protected:
                    best, best_density = i, d
            if best < 0:
                # Every sampled key was protected: take the first one that is not.
                best = next(i for i, k in enumerate(keys) if k not in protected)
            victims.append(keys[best])
            self._drop(best)
        return victims

    def clear(self) -> None:
        self._keys.clear()
        self._stamp.clear()
        self._cls.clear()
        self._index.clear()
        self._pinned.clear()
        self._track.clear()
        self._sketch.clear()
        self._hits[:] = 0.0
        self._expired[:] = 0.0
        self._reuse[:] = 0.0
        self._tail_req = self._tail_key = None
        self._start()

    def on_request_finished(self, ctx: ReqContext) -> None:
        if ctx.req_id == self._tail_req:
            self._tail_req = self._tail_key = None

    def table_sizes(self) -> dict[str, int]:
        """Per-key tables (candidates, their index, pinned, tracked keys) and the fixed-size
        sketch (`sketch_counters`) and per-class, per-age counters (`sketch_classes`)."""
        return {
            "candidates": len(self._keys),
            "index": len(self._index),
            "pinned": len(self._pinned),
            "tracked": len(self._track),
            "sketch_counters": len(self._sketch),
            "sketch_classes": int(self._hits.size),
        }
