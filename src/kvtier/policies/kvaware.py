"""Prefix-aware eviction for KV-cache blocks: a frequency filter and a deepest-block rule,
switched on and off by six miniature simulations, in front of GreedyDual-Frequency; plain LRU
until a simulation shows something better, and again when following them costs hits.

The design is in docs/policies.md ("The KV-aware policy"), its measurements on other traces
and the variants tried in docs/kvaware-evaluation.md.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from itertools import islice
from numbers import Real

from kvtier.base import OffloadKey, ReqContext, checked_fraction, checked_int
from kvtier.policies.base import CachePolicy, checked_protected, register_policy
from kvtier.policies.kvaware_sketch import (
    M64,
    MAX_COUNT,
    MAX_WIDTH,
    FrequencySketch,
    checked_keys,
    key_hash,
)

__all__ = ["FrequencySketch", "KVAwarePolicy", "key_hash"]

# Picks the keys the shadow models see (an odd 64-bit multiplier).
_SAMPLE = 0xA24BAED4963EE407
# Where a pinned key returns at unpin.
_MAIN, _WINDOW, _WINDOW_TAIL = 0, 1, 2
# (admit every block leaving the window, apply the deepest-block rule, credit by count), one
# shadow each. The last two are LRU without and with the rule.
_MODES = (
    (True, True, True),
    (False, True, True),
    (True, False, True),
    (False, False, True),
    (True, False, False),
    (True, True, False),
)
# Requests whose counted keys are remembered (engines run a few hundred at once), and keys per
# request (at least; or 2 per slot). Beyond either, keys are forgotten and may be counted
# again, which only overstates a count a little; a caller that never finishes its requests, or
# gives every call one request id, cannot grow the tables without bound.
_LIVE_REQUESTS = 512
_LIVE_KEYS = 1024
# Ids of requests finished lately (strings only). An engine's store or load of a request may
# complete after the request ended (`on_request_finished`); such a late report must not make
# the request live again: its counted keys are kept apart and dropped first, and its
# `key_positions` table is not kept, so finished requests neither hold memory nor push the
# live ones' counted keys out. The last min(2 * capacity, 4096) finished requests are
# remembered (2 per slot: every per-key table's bound); a report later than that is taken for
# a live request's, as before.
_FINISHED = 4096
# The mode the policy runs in until a shadow has earned more hits: plain LRU, so that a trace
# whose evidence never arrives (or arrives late) is served no worse than by LRU.
_START = 4
_MODE_NAMES = ("adaptive", "filter", "open")
# Guard of small tiers (benchmarks/policy_stress.py): when the replica of the policy trails the
# LRU shadow by this share of the LRU shadow's recent hits, the policy returns to LRU and holds
# it for this many shadow capacities of accesses. It does not judge a mode in its first
# capacities: a count mode invests (keeps blocks LRU would not) before it earns.
_GUARD_MARGIN = 0.02
_GUARD_HOLD = 32
_GUARD_GRACE = 4


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
    main area plain LRU): the policy follows whichever has the most recent hits. It starts
    as plain LRU and leaves it only when a shadow has earned strictly more hits, so a trace
    that never shows the other modes' worth is served as LRU serves it. Below
    `2 * model_size` slots the shadows are exact, and a replica of the policy itself (it
    switches when the policy does) shows what switching costs: when it trails the LRU shadow,
    the policy holds LRU for a while.

    `mode="filter"` or `"open"` fixes the filter (rule on, no shadows), for comparisons.
    Every per-key table is bounded by the capacity (the shadows by their own, smaller one);
    the sketch has `4 * sketch_width * capacity` one-byte counters, rounded up to a power of 2.
    Keys are bytes (`OffloadKey`): the sketch needs a hash that is the same in every process,
    so any other key is refused, by name, before a call changes anything.
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
        capacity = self.capacity  # validated, and a plain int
        # A str raised "'<' not supported", naming neither the setting nor the range.
        window = checked_fraction("window", window)
        sketch_width = checked_int("sketch_width", sketch_width)
        model_size = checked_int("model_size", model_size)
        if sketch_width * capacity > MAX_WIDTH:
            # bytearray raised "cannot fit 'int' into an index-sized integer", naming neither.
            # A MemoryError, as the manager reads one: its num_slots is then what is too large.
            raise MemoryError(
                f"sketch_width={sketch_width} x capacity={capacity} is "
                f"{sketch_width * capacity} counters per sketch row; expected at most 2**60"
            )
        if mode not in _MODE_NAMES:
            raise ValueError(f"mode={mode!r} is invalid; expected one of {_MODE_NAMES}")
        self._win_target = max(1, int(window * capacity))
        # Window keys -> whether the key is its request's deepest block; oldest first.
        self._win: OrderedDict[OffloadKey, bool] = OrderedDict()
        self._credit: dict[OffloadKey, int] = {}
        self._buckets: dict[int, OrderedDict[OffloadKey, None]] = {}
        self._floor = 0
        self._pinned: dict[OffloadKey, int] = {}
        # The deepest key of the last `key_positions` table read, and how much of the table
        # it covers: an engine grows one table per request, appending the chunks it stores.
        self._tail_req: str | None = None
        self._tail_pos: dict[OffloadKey, int] | None = None
        self._tail_key: OffloadKey | None = None
        self._tail_len = 0
        # The same per live request (table, length covered, deepest key), oldest first: an
        # engine step calls for many requests in turn, and each switch would read a whole table.
        self._tails: OrderedDict[str, tuple[dict[OffloadKey, int], int, OffloadKey]] = OrderedDict()
        # Per live request, its deepest key inserted so far: the deepest-block rule waits for
        # the request's end. An engine that stores a prompt over several steps (chunked
        # prefill) inserts each step's last chunk as the request's deepest; sent out first,
        # it cut the prompt at that chunk (a lookup stops at the first miss).
        # With the key: per shadow (and the replica, last) whether the rule is due to it at
        # the end, as it would have applied it when it replayed the store (None: not sampled).
        self._unsettled: OrderedDict[str, tuple[OffloadKey, tuple[bool, ...] | None]] = (
            OrderedDict()
        )
        # Per live request, (keys, last key, sampled keys) of its last `prefix_extended`.
        self._prefix_samples: OrderedDict[str, tuple[int, OffloadKey, list[OffloadKey]]] = (
            OrderedDict()
        )
        # Keys already counted per live request: an engine reports one use of a chunk more than
        # once (a device hit when the request arrives and again when it ends; a load's unpin
        # and the same end-of-request touch), and a use must count once, as in a replay.
        self._counted: OrderedDict[str, set[OffloadKey]] = OrderedDict()
        self._counted_req: str | None = None
        self._counted_keys: set[OffloadKey] = set()
        # The same for reports that arrived after their request finished, and those requests.
        self._counted_late: OrderedDict[str, set[OffloadKey]] = OrderedDict()
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._finished_max = min(_FINISHED, 2 * capacity)
        self._counted_max = max(2 * capacity, _LIVE_KEYS)
        self._admit_all = _admit_all if mode == "adaptive" else mode == "open"
        self._tail_first = _tail_first if mode == "adaptive" else True
        self._counts = _counts if mode == "adaptive" else True
        self._mode = 0
        self._models: tuple[KVAwarePolicy, ...] | None = None
        self._replica: KVAwarePolicy | None = None
        self._replica_hits = 0.0
        self._lru_hold = 0
        self._since_switch = 0
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
        # A key is sampled when the top `shift` bits of its 64-bit product with _SAMPLE are
        # zero: one mask test instead of a mask and a shift per access.
        self._sample_mask = M64 ^ (M64 >> shift)
        mcap = max(1, capacity >> shift)
        self._models = tuple(
            KVAwarePolicy(
                mcap, window, _shared=self._sketch, _admit_all=a, _tail_first=t, _counts=f
            )
            for a, t, f in _MODES
        )
        self._model_hits = [0.0] * len(_MODES)
        self._mode = _START
        self._admit_all, self._tail_first, self._counts = _MODES[_START]
        # Below 2 * model_size slots every key is sampled and the shadows are exact: a seventh
        # one then replays the policy itself, switching when it does, so what the switching
        # costs the real cache shows against the LRU shadow.
        if not shift:
            a, t, f = _MODES[_START]
            self._replica = KVAwarePolicy(
                mcap, window, _shared=self._sketch, _admit_all=a, _tail_first=t, _counts=f
            )
        # Hits fade over 32 shadow capacities. Over 8, a few requests for one long document
        # could swing the ranking, and each switch costs the real cache more than it earned
        # (benchmarks/policy_stress.py: the losses to LRU summed 14.2 points; 3.5 over 32).
        self._keep = 1.0 - 1.0 / (32 * mcap)

    @property
    def filtering(self) -> bool:
        """Whether blocks leaving the window must beat the main victim's count to stay."""
        return not self._admit_all

    def __len__(self) -> int:
        return len(self._win) + len(self._credit)

    def __contains__(self, key: object) -> bool:
        return key in self._win or key in self._credit

    # -- per-access bookkeeping ------------------------------------------------------------

    def _tail_of(self, ctx: ReqContext | None) -> OffloadKey | None:
        """The deepest key of `ctx`'s request, or None without positions."""
        if ctx is None:
            return None
        if type(ctx) is not ReqContext and not isinstance(ctx, ReqContext):
            raise _not_ctx(ctx)
        if not ctx.key_positions:
            return None
        positions, req_id = ctx.key_positions, ctx.req_id
        seen, tail = 0, None
        # The same table object, not only the same request: a caller may build a new
        # ReqContext (and table) for each call of one request.
        if positions is self._tail_pos and req_id == self._tail_req:
            if len(positions) == self._tail_len:
                return self._tail_key
            seen, tail = self._tail_len, self._tail_key
        else:
            saved = self._tails.get(req_id)
            if saved is not None and saved[0] is positions:
                _, seen, tail = saved
                if len(positions) == seen:
                    self._tail_req, self._tail_pos = req_id, positions
                    self._tail_len, self._tail_key = seen, tail
                    return tail
        try:
            return self._find_tail(req_id, positions, seen, tail)
        except TypeError:
            bad = [(k, v) for k, v in positions.items() if not isinstance(v, Real)]
            if not bad:
                raise
            raise TypeError(
                f"key_positions of request {ctx.req_id!r} maps {bad[0][0]!r} to "
                f"{bad[0][1]!r}; expected an int token position"
            ) from None

    def _find_tail(
        self,
        req_id: str,
        positions: dict[OffloadKey, int],
        seen: int,
        tail: OffloadKey | None,
    ) -> OffloadKey:
        n = len(positions)
        if seen and n > seen and tail is not None and tail in positions:
            # An engine adds the chunks it stores step by step: only the new ones can be
            # deeper. Read from the end (islice from the front walks the whole table); a tie
            # keeps the earlier key, as max() over the whole table would.
            best, deepest = tail, positions[tail]
            new_key, new_pos = None, deepest
            for key, pos in islice(reversed(positions.items()), n - seen):
                if pos >= new_pos:
                    new_key, new_pos = key, pos
            if new_key is not None and new_pos > deepest:
                best = new_key
            tail = best
        else:
            # Once per table: O(request length).
            tail = max(positions, key=positions.__getitem__)
            deepest = positions[tail]
            if not isinstance(deepest, Real) or deepest != deepest:
                # max() compares nothing in a one-entry table, and strs only with each other
                # ("9" > "16"): such a table was taken, its deepest key by string order. A
                # TypeError is named by `_tail_of`; NaN compares false with every position.
                if isinstance(deepest, Real):
                    raise ValueError(
                        f"key_positions of request {req_id!r} maps {tail!r} to {deepest!r}; "
                        "expected an int token position"
                    )
                raise TypeError(f"key_positions maps {tail!r} to {deepest!r}")
        self._tail_req, self._tail_pos = req_id, positions
        self._tail_len, self._tail_key = n, tail
        if req_id not in self._finished:
            # A finished request's table is not kept: nothing would drop it again.
            tails = self._tails
            tails[req_id] = (positions, n, tail)
            tails.move_to_end(req_id)
            if len(tails) > _LIVE_REQUESTS:
                tails.popitem(last=False)
        return tail

    def _seen(
        self,
        key: OffloadKey,
        ctx: ReqContext | None,
        tail_key: OffloadKey | None,
        need_count: bool = True,
    ) -> int:
        """Count an access of `key`, feed the shadows if it is sampled; its recent count. A key
        is counted once per request (`ctx`); a repeat only reads the count, and not even that
        without `need_count` (it then returns 0). `tail_key` is `_tail_of(ctx)`, which each
        call reads once: it cannot change within the call."""
        # As key_hash (a bytes subclass included), inline: this runs on every access.
        h = (
            hash(int.from_bytes(key, "big"))
            if type(key) is bytes or isinstance(key, bytes)
            else key_hash(key)
        )
        if ctx is not None:
            if ctx.req_id != self._counted_req:
                self._switch_request(ctx.req_id)
            counted = self._counted_keys
            if key in counted:
                # A sketch read is a few cache misses: skipped when the count goes unused.
                return self._sketch.estimate(h) if need_count else 0
            if len(counted) >= self._counted_max:
                counted.clear()  # one request over the bound (or one id for every call)
            counted.add(key)
        count = self._sketch.add(h)
        if self._models is not None and not (h * _SAMPLE) & self._sample_mask:
            self._feed_models(key, count, tail_key)
        return count

    def _feed_models(self, key: OffloadKey, count: int, tail_key: OffloadKey | None) -> None:
        """Replay a sampled access in the shadows (and the replica); follow the best one."""
        models = self._models
        assert models is not None
        keep, hits = self._keep, self._model_hits
        # The sketch does not change while the shadows replay one access, and their duels
        # mostly weigh the same few keys: each key's estimate is read once per access.
        memo: dict[OffloadKey, int] = {}
        for i, model in enumerate(models):
            hits[i] = hits[i] * keep + model._replay(key, count, tail_key, memo)
        replica = self._replica
        if replica is not None:
            self._replica_hits = self._replica_hits * keep + replica._replay(
                key, count, tail_key, memo
            )
            if self._lru_hold:
                self._lru_hold -= 1
                return
            self._since_switch += 1
            least = hits[_START] * (1.0 - _GUARD_MARGIN)  # the replica's hits must not trail it
            if self._since_switch >= _GUARD_GRACE * replica.capacity and self._replica_hits < least:
                # Following the shadows has cost more than it earned (each switch leaves
                # the cache holding what the old mode chose): be LRU for a while.
                self._lru_hold = _GUARD_HOLD * replica.capacity
                self._replica_hits = hits[_START]
                self._set_mode(_START)
                return
        best = hits.index(max(hits))
        # Only a strictly better shadow moves the policy: ties keep the current mode.
        if hits[best] > hits[self._mode]:
            self._set_mode(best)

    def _set_mode(self, mode: int) -> None:
        if mode != self._mode:
            self._since_switch = 0
        self._mode = mode
        flags = self._admit_all, self._tail_first, self._counts = _MODES[mode]
        if self._replica is not None:
            self._replica._admit_all, self._replica._tail_first, self._replica._counts = flags

    def _switch_request(self, req_id: str) -> None:
        live, late = self._counted, self._counted_late
        keys = live.get(req_id)
        if keys is None:
            keys = late.get(req_id)
            if keys is None:
                # 512 requests in all; a finished request's late reports are dropped first.
                if len(live) + len(late) >= _LIVE_REQUESTS:
                    (late if late else live).popitem(last=False)
                table = late if req_id in self._finished else live
                keys = table[req_id] = set()
        self._counted_req, self._counted_keys = req_id, keys

    def _replay(
        self,
        key: OffloadKey,
        count: int,
        tail_key: OffloadKey | None,
        memo: dict[OffloadKey, int],
    ) -> int:
        """Shadow use: one access as a cache of `capacity` slots in this mode sees it, given the
        key's recent count and its request's deepest key; 1 on a hit. (A shadow's sketch is
        its owner's, which has already counted the access; `memo` holds the estimates read
        during this access.)"""
        win = self._win
        if key in win:
            win.move_to_end(key)
            return 1
        tail = self._tail_first and key == tail_key
        credit = self._credit
        old = credit.pop(key, None)
        if old is not None:
            # `_reuse`, inline: this runs six times per sampled access.
            buckets = self._buckets
            bucket = buckets[old]
            del bucket[key]
            if not bucket:
                del buckets[old]
            self._place(key, count, tail)
            return 1
        if len(win) + len(credit) >= self.capacity:
            self._evict_one(memo)
        win[key] = tail
        if tail:
            win.move_to_end(key, last=False)
        return 0

    def _place(self, key: OffloadKey, count: int, tail: bool) -> None:
        # Without counts every use earns the same credit: the main area is then plain LRU.
        # `count or 1` is max(count, 1): counts are never negative.
        credit = self._floor + (0 if tail else (count or 1) if self._counts else 1)
        self._credit[key] = credit
        try:
            self._buckets[credit][key] = None
        except KeyError:  # the first key of this credit (a try costs nothing until it raises)
            self._buckets[credit] = OrderedDict.fromkeys((key,))

    def _reuse(self, key: OffloadKey, count: int, tail: bool) -> bool:
        """A use of a main key: placed again at its new credit. False, and nothing changed,
        when `key` is not in main."""
        if not self._unplace(key):
            return False
        self._place(key, count, tail)
        return True

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
        # A key or a table it cannot read raises here, before anything changed.
        keys = checked_keys(keys)
        tail_key = self._tail_of(ctx)
        win, credit, pinned, seen = self._win, self._credit, self._pinned, self._seen
        for key in reversed(keys):
            if key in win or key in credit or key in pinned:
                continue
            tail = False
            if key == tail_key and ctx is not None and ctx.req_id not in self._finished:
                # The shadows wait for the request's end too (`_settle_tail`).
                due = self._shadows_due(key)
                seen(key, ctx, None, False)
                self._defer_tail(ctx.req_id, key, due)
            else:
                seen(key, ctx, tail_key, False)
                # Read after the count: a sampled key may switch the mode.
                tail = self._tail_first and key == tail_key
            win[key] = tail
            if tail:
                win.move_to_end(key, last=False)

    def touch(self, keys: Iterable[OffloadKey], ctx: ReqContext | None) -> None:
        keys = checked_keys(keys)
        tail_key = self._tail_of(ctx)
        win, credit, pinned = self._win, self._credit, self._pinned
        seen = self._seen
        # Keys this call counted already, when it has no request to tell repeats by.
        once: set[OffloadKey] | None = None
        if ctx is None and len(keys) > 1 and len(set(keys)) != len(keys):
            # A key repeated in one call is one use, as a request's repeats are (`_counted`)
            # and as S3-FIFO counts it.
            once = call_once = set()
            estimate_key = self._sketch.estimate_key

            def seen(
                key: OffloadKey,
                ctx: ReqContext | None,
                tail_key: OffloadKey | None,
                need_count: bool = True,
            ) -> int:
                if key in call_once:
                    return estimate_key(key) if need_count else 0
                call_once.add(key)
                return self._seen(key, ctx, tail_key, need_count)

        for key in reversed(keys):
            if key in win:
                win.move_to_end(key)
                seen(key, ctx, tail_key, False)
            elif key in credit:
                if ctx is not None:
                    if ctx.req_id != self._counted_req:
                        self._switch_request(ctx.req_id)
                    repeat = key in self._counted_keys
                else:
                    repeat = once is not None and key in once
                # Counted before it leaves its bucket: should the count raise (a context it
                # cannot read), the key is still held, not lost to the policy for good.
                count = seen(key, ctx, tail_key, not repeat)
                if repeat:
                    # A use counted already only moves: placed again, its credit would follow
                    # the mode of now, which a later key of the first report may have switched.
                    self._buckets[credit[key]].move_to_end(key)
                else:
                    self._reuse(key, count, self._tail_first and key == tail_key)
            elif key not in pinned:
                # A use the tier did not serve (an engine's device prefix cache hit): counted
                # all the same, or a block kept hot on the device would leave it looking new.
                seen(key, ctx, tail_key, False)

    def prefix_extended(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        """A request stored over several steps (chunked prefill) ranks its prefix as one store
        would have: above what its later stores added, head last (the deepest-block rule
        waits for the request's end). Not a use: nothing is counted."""
        keys = checked_keys(keys)
        if ctx is not None and type(ctx) is not ReqContext and not isinstance(ctx, ReqContext):
            raise _not_ctx(ctx)
        if not keys:
            return
        # A store reported after its request ended took the rule at once: its deepest key
        # stays first in the window.
        late = self._tail_of(ctx) if ctx is not None and ctx.req_id in self._finished else None
        self._extend(keys, late)
        models = self._models
        if models is None:
            return
        # The shadows re-rank their sampled keys of the prefix. A request's prefix only grows
        # between calls, so the keys already sampled are kept and only the new ones hashed:
        # hashing every key was most of the call's cost.
        req_id = ctx.req_id if ctx is not None else None
        saved = self._prefix_samples.get(req_id) if req_id is not None else None
        n = len(keys)
        if saved is not None and saved[0] <= n and keys[saved[0] - 1] == saved[1]:
            start, sampled = saved[0], saved[2]
        else:
            start, sampled = 0, []
        sampled.extend(filter(self._sampled, keys[start:]))
        if req_id is not None and req_id not in self._finished:
            samples = self._prefix_samples
            if len(sampled) > 2 * models[0].capacity:
                # Bounded like every per-key table: a longer prefix is hashed at every call.
                samples.pop(req_id, None)
            else:
                samples[req_id] = (n, keys[-1], sampled)
                samples.move_to_end(req_id)
                if len(samples) > _LIVE_REQUESTS:
                    samples.popitem(last=False)
        if sampled:
            for model in self._shadows():
                model._extend(sampled, late)

    def _extend(self, keys: Sequence[OffloadKey], late: OffloadKey | None = None) -> None:
        win, credit, buckets = self._win, self._credit, self._buckets
        estimate_key = self._sketch.estimate_key if self._counts else None
        floor = self._floor
        for key in reversed(keys):
            old = credit.get(key)
            if old is None:
                if key in win:
                    win.move_to_end(key)
                continue
            # As a use would place it (`_place`), but never lower: not a use.
            new = floor + ((estimate_key(key) or 1) if estimate_key is not None else 1)
            bucket = buckets[old]
            if new <= old:
                bucket.move_to_end(key)
                continue
            del bucket[key]
            if not bucket:
                del buckets[old]
            credit[key] = new
            try:
                buckets[new][key] = None
            except KeyError:
                buckets[new] = OrderedDict.fromkeys((key,))
        if late is not None and win.get(late) is True:
            win.move_to_end(late, last=False)

    def _shadows_due(self, key: OffloadKey) -> tuple[bool, ...] | None:
        """For a deepest key whose rule waits: per shadow (the replica last), whether its
        replay of this store would have applied the rule. Not for a key in its window (a
        hit there only moves it), and with the mode the replica has before the access
        (which may switch the policy's)."""
        if self._models is None or not self._sampled(key):
            return None
        return tuple(m._tail_first and key not in m._win for m in self._shadows())

    def _sampled(self, key: OffloadKey) -> bool:
        """Whether the shadows see `key` (as `_seen` decides, inline there)."""
        return not (hash(int.from_bytes(key, "big")) * _SAMPLE) & self._sample_mask

    def _shadows(self) -> tuple[KVAwarePolicy, ...]:
        """The shadow models, then the replica if there is one."""
        models = self._models or ()
        return models if self._replica is None else (*models, self._replica)

    def _defer_tail(self, req_id: str, key: OffloadKey, due: tuple[bool, ...] | None) -> None:
        unsettled = self._unsettled
        unsettled[req_id] = (key, due)
        unsettled.move_to_end(req_id)
        if len(unsettled) > _LIVE_REQUESTS:
            unsettled.popitem(last=False)  # that request's deepest block is never demoted

    def _settle_tail(self, ctx: ReqContext) -> None:
        """At a request's end: its deepest key inserted, if still its deepest, goes first, in
        the tier and in the shadows that would have applied the rule at the store."""
        entry = self._unsettled.get(ctx.req_id)
        if entry is None:
            return
        tail = self._tail_of(ctx)  # may raise (an unreadable table): nothing changed yet
        del self._unsettled[ctx.req_id]
        key, due = entry
        if key != tail:
            return
        if self._tail_first:
            self._settle_key(key)
        if due is not None:
            for model, rule in zip(self._shadows(), due, strict=True):
                if rule:
                    model._settle_key(key)

    def _settle_key(self, key: OffloadKey) -> None:
        win = self._win
        if key in win:
            win[key] = True
            win.move_to_end(key, last=False)
        elif key in self._pinned:
            if self._pinned[key] == _WINDOW:
                self._pinned[key] = _WINDOW_TAIL
        elif self._unplace(key):
            self._place(key, 0, True)

    def pin(self, keys: Iterable[OffloadKey]) -> None:
        win = self._win
        for key in checked_keys(keys):
            tail = win.pop(key, None)
            if tail is not None:
                self._pinned[key] = _WINDOW_TAIL if tail else _WINDOW
            elif self._unplace(key):
                self._pinned[key] = _MAIN

    def unpin(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        keys = checked_keys(keys)
        tail_key = self._tail_of(ctx)
        pinned = self._pinned
        for key in reversed(keys):
            where = pinned.get(key)
            if where is None:
                continue
            main = where == _MAIN
            # Counted while still pinned: should the count raise, the key stays pinned here
            # (the manager pins again what this call returned) instead of being lost. A key
            # going back to the window needs no count.
            count = self._seen(key, ctx, tail_key, main)
            del pinned[key]
            if main:
                # Read after the count: a sampled key may switch the mode.
                self._place(key, count, self._tail_first and key == tail_key)
            else:
                self._win[key] = where == _WINDOW_TAIL

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        for key in checked_keys(keys):
            self._pinned.pop(key, None)
            self._win.pop(key, None)
            self._unplace(key)

    def _main_victim(
        self,
        protected: Collection[OffloadKey],
        aside: dict[int, list[OffloadKey]] | None = None,
    ) -> OffloadKey | None:
        """The lowest-credit key not in `protected` (oldest first among equals). With `aside`,
        protected keys at a bucket's front are moved there, in order, so that the next call
        in the same `evict` does not scan them again; `_restore` puts them back."""
        # Credits lie in [floor, floor + 15]: placed there, and the floor only rises. The
        # floor may pass only credits with no key at all, or protected keys would be stranded.
        buckets = self._buckets
        floor = self._floor
        if not protected:
            # The usual case, the loop's first step: the floor's bucket holds the victim.
            bucket = buckets.get(floor)
            if bucket:
                return next(iter(bucket))
        raise_floor = True
        for credit in range(floor, floor + MAX_COUNT + 1):
            bucket = buckets.get(credit)
            if bucket is None:
                if aside is not None and credit in aside:
                    raise_floor = False
                continue
            if not protected:
                self._floor = credit
                return next(iter(bucket))
            if aside is None:
                for key in bucket:
                    if key not in protected:
                        if raise_floor:
                            self._floor = credit
                        return key
            else:
                while bucket:
                    key = next(iter(bucket))
                    if key not in protected:
                        if raise_floor:
                            self._floor = credit
                        return key
                    del bucket[key]
                    aside.setdefault(credit, []).append(key)
                del buckets[credit]
            raise_floor = False
        return None

    def _restore(self, aside: dict[int, list[OffloadKey]]) -> None:
        """Put the keys `_main_victim` set aside back at the front of their buckets."""
        buckets = self._buckets
        for credit, keys in aside.items():
            bucket = buckets.get(credit)
            if bucket is None:
                bucket = buckets[credit] = OrderedDict()
            for key in reversed(keys):
                bucket[key] = None
                bucket.move_to_end(key, last=False)

    def _evict_one(self, memo: dict[OffloadKey, int]) -> None:
        """`evict(1, ())` for a full shadow, which pins nothing: the same choice, less work
        (`_main_victim`, `_duel` and `_unplace` inline; estimates read through `memo`)."""
        win, credit, target = self._win, self._credit, self._win_target
        estimate_key = self._sketch.estimate_key
        counts = self._counts
        while len(win) > target:  # only while the shadow fills
            moved, tail = win.popitem(last=False)
            # A deepest block's credit takes no count (`_place`): it is not read.
            self._place(moved, estimate_key(moved) if counts and not tail else 1, tail)
        if not credit:
            win.popitem(last=False)
            return
        buckets, floor = self._buckets, self._floor
        bucket = buckets.get(floor)
        if not bucket:
            # The floor rises to the lowest credit held; credits lie in [floor, floor + 15].
            for level in range(floor, floor + MAX_COUNT + 1):
                bucket = buckets.get(level)
                if bucket is not None:
                    self._floor = floor = level
                    break
            else:
                win.popitem(last=False)
                return
        if len(win) < target:
            # No candidate: the victim (the floor bucket's oldest) leaves.
            del credit[bucket.popitem(last=False)[0]]
            if not bucket:
                del buckets[floor]
            return
        # The window's oldest duels the victim (`_duel`). Admitted whatever its count when
        # every block is, it needs the count only for its credit.
        cand, tail = win.popitem(last=False)
        admit = self._admit_all and not tail
        if counts or not admit:
            count = memo.get(cand)
            if count is None:
                count = memo[cand] = estimate_key(cand)
            if not admit:
                victim = next(iter(bucket))
                low = memo.get(victim)
                if low is None:
                    low = memo[victim] = estimate_key(victim)
                if count <= low:
                    return  # the candidate leaves, the victim stays
        else:
            count = 1
        del credit[bucket.popitem(last=False)[0]]
        if not bucket:
            del buckets[floor]
        self._place(cand, count, tail)

    def _duel(self, cand: OffloadKey, tail: bool, victim: OffloadKey) -> bool:
        """The window's candidate against main's victim: True when the candidate is admitted
        (it takes the victim's place in main and the victim leaves)."""
        sketch = self._sketch
        if self._admit_all and not tail:
            # Admitted whatever its count, which only the credit may need.
            admit, count = True, sketch.estimate_key(cand) if self._counts else 1
        else:
            count = sketch.estimate_key(cand)
            admit = count > sketch.estimate_key(victim)
        if admit:
            self._unplace(victim)
            self._place(cand, count, tail)
        return admit

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if type(n) is not int:
            # A float failed at range(n), after the window's surplus had moved to main.
            n = checked_int("n", n, minimum=0)
        if n <= 0:
            return []
        win, credit = self._win, self._credit
        if protected:
            protected = checked_protected(protected)
            blocked = sum(1 for k in protected if k in win or k in credit)
        else:
            blocked = 0
        if len(win) + len(credit) - blocked < n:
            return None
        if n == 1 and not protected and len(win) == self._win_target and credit:
            bucket = self._buckets.get(self._floor)
            if bucket:
                # The usual call (a full tier stores one block): one duel, of the window's
                # oldest and the floor bucket's oldest, without the general loop's setup.
                oldest, tail = win.popitem(last=False)
                lowest = next(iter(bucket))
                return [lowest if self._duel(oldest, tail, lowest) else oldest]
        victims: list[OffloadKey] = []
        append = victims.append
        target, unplace, main_victim = self._win_target, self._unplace, self._main_victim
        buckets = self._buckets
        # Protected keys at the front of the lowest buckets, set aside for this call: each
        # victim would otherwise rescan them (O(n * protected) for a long request's store).
        aside: dict[int, list[OffloadKey]] | None = {} if protected else None
        try:
            # A window over its size (the tier was filling) hands its surplus to main.
            if len(win) > target:
                place, estimate_key, counts = self._place, self._sketch.estimate_key, self._counts
                while len(win) > target:
                    moved, tail = win.popitem(last=False)
                    # A deepest block's credit takes no count (`_place`): it is not read.
                    place(moved, estimate_key(moved) if counts and not tail else 1, tail)
            # The window's oldest key duels main's victim when the window is at its size.
            # Nothing enters the window during the call and each pass takes a key from it or
            # from main, so only the first pass can duel: once the window has given up a key
            # it stays below its size, and a window of protected keys stays as it is.
            if len(win) == target:
                cand = _first(win, protected) if protected else next(iter(win))
            else:
                cand = None
            for _ in range(n):  # each pass takes one victim
                if not credit:
                    victim = None
                elif protected or not (bucket := buckets.get(self._floor)):
                    victim = main_victim(protected, aside)
                elif cand is None:
                    # The usual pass: the oldest key of the floor's bucket leaves
                    # (`_main_victim`'s first step and `_unplace`, inline).
                    victim = bucket.popitem(last=False)[0]
                    del credit[victim]
                    if not bucket:
                        del buckets[self._floor]
                    append(victim)
                    continue
                else:
                    victim = next(iter(bucket))
                if victim is None:
                    key = _first(win, protected)
                    assert key is not None, "the count check above guarantees a candidate"
                    del win[key]
                    append(key)
                elif cand is not None:
                    tail = win.pop(cand)
                    append(victim if self._duel(cand, tail, victim) else cand)
                else:
                    unplace(victim)
                    append(victim)
                cand = None
        finally:
            if aside:
                self._restore(aside)
        return victims

    def clear(self) -> None:
        self._win.clear()
        self._credit.clear()
        self._buckets.clear()
        self._pinned.clear()
        self._floor = 0
        self._tail_req = self._tail_key = self._tail_pos = None
        self._tail_len = 0
        self._tails.clear()
        self._unsettled.clear()
        self._prefix_samples.clear()
        self._counted.clear()
        self._counted_late.clear()
        self._finished.clear()
        self._counted_req, self._counted_keys = None, set()
        if self._owns_sketch:
            self._sketch.clear()
        if self._models is not None:
            for model in self._models:
                model.clear()
            self._model_hits = [0.0] * len(_MODES)
            if self._replica is not None:
                self._replica.clear()
            self._replica_hits = 0.0
            self._lru_hold = 0
            self._set_mode(_START)
            self._since_switch = 0

    def on_request_finished(self, ctx: ReqContext) -> None:
        if type(ctx) is not ReqContext and not isinstance(ctx, ReqContext):
            raise _not_ctx(ctx)
        req_id = ctx.req_id
        if self._unsettled:
            self._settle_tail(ctx)
        self._prefix_samples.pop(req_id, None)
        self._tails.pop(req_id, None)
        if req_id == self._tail_req:
            self._tail_req = self._tail_key = self._tail_pos = None
            self._tail_len = 0
        self._counted.pop(req_id, None)
        self._counted_late.pop(req_id, None)
        if req_id == self._counted_req:
            self._counted_req, self._counted_keys = None, set()
        finished = self._finished
        finished[req_id] = None
        finished.move_to_end(req_id)
        if len(finished) > self._finished_max:
            finished.popitem(last=False)

    def table_sizes(self) -> dict[str, int]:
        """Per-key tables (window, credits, pinned, each shadow's keys), the credit buckets
        (at most 16), and the fixed-size sketch's counters (`sketch_counters`)."""
        sizes = {
            "window": len(self._win),
            "credits": len(self._credit),
            "buckets": len(self._buckets),
            "pinned": len(self._pinned),
            # Keys of live requests (and late reports of finished ones), bounded by the
            # engine's requests rather than the capacity.
            "request_keys_live": sum(map(len, self._counted.values()))
            + sum(map(len, self._counted_late.values())),
            "request_tails": len(self._tails),
            "request_unsettled_tails": len(self._unsettled),
            "request_prefix_samples": sum(len(v[2]) for v in self._prefix_samples.values()),
            "request_finished": len(self._finished),
        }
        if self._models is not None:
            for i, model in enumerate(self._models):
                sizes[f"shadow{i}"] = len(model)
            if self._replica is not None:
                sizes["replica"] = len(self._replica)
        if self._owns_sketch:
            # Every mode has one ("filter" and "open" too); shadows share their owner's.
            sizes["sketch_counters"] = len(self._sketch)
        return sizes


def _not_ctx(ctx: object) -> TypeError:
    # A bare request id or a dict failed on a missing attribute, naming neither.
    return TypeError(f"ctx={ctx!r:.80} has type {type(ctx).__name__}; expected a ReqContext")


def _first(
    table: OrderedDict[OffloadKey, bool], protected: Collection[OffloadKey]
) -> OffloadKey | None:
    for key in table:
        if key not in protected:
            return key
    return None
