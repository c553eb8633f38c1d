"""S3-FIFO: three static FIFO queues (Yang et al., SOSP'23)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

from kvtier.base import OffloadKey, ReqContext, checked_fraction, checked_int
from kvtier.policies.base import CachePolicy, checked_protected, register_policy

_MAX_FREQ = 3
# Live requests remembered, a token each from their first use of a held key (a few MB at
# most): a bound an engine's live requests could pass would forget a request still running,
# and its later report would count again.
_LIVE_REQUESTS = 65_536
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

    A key's frequency rises once for a run of uses by one request (`ReqContext.req_id`): an
    engine reports one use several times (a device hit when the request arrives and when it
    ends, a load's unpin and the end-of-request touch), and one request alone must not promote
    a key. The policy keeps, per key, the request that counted it last, so two requests whose
    reports interleave count twice each. Without a request, each call counts a key once.
    """

    def __init__(self, capacity: int, small_ratio: float = 0.1, promote_freq: int = 2) -> None:
        super().__init__(capacity)
        capacity = self.capacity  # validated, and a plain int
        # A str raised "'<' not supported" naming neither the setting nor the range.
        small_ratio = checked_fraction("small_ratio", small_ratio)
        self._small_target = max(1, int(capacity * small_ratio))
        self._ghost_cap = max(1, capacity - self._small_target)
        # Frequencies stop at _MAX_FREQ: a threshold above it would promote nothing, one
        # below 1 everything (no filter at all).
        expected = f"expected an integer from 1 to {_MAX_FREQ} (frequencies stop at {_MAX_FREQ})"
        try:
            promote = checked_int("promote_freq", promote_freq)
        except ValueError:
            promote = 0
        if not 1 <= promote <= _MAX_FREQ:
            raise ValueError(f"promote_freq={promote_freq!r} is invalid; {expected}")
        self._promote_freq = promote
        # Queues map key -> access frequency (0..3); the first item is the oldest (tail).
        self._small: OrderedDict[OffloadKey, int] = OrderedDict()
        self._main: OrderedDict[OffloadKey, int] = OrderedDict()
        self._ghost: OrderedDict[OffloadKey, None] = OrderedDict()
        # Pinned key -> (queue, frequency), so unpinning puts it back where it was.
        self._pinned: dict[OffloadKey, tuple[int, int]] = {}
        # Held or pinned key -> the request whose use last raised its frequency, as a token:
        # a request that reuses a finished one's id is another request.
        self._counted_by: dict[OffloadKey, int] = {}
        self._tokens: OrderedDict[str, int] = OrderedDict()  # live requests, oldest first
        self._next_token = 0

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
        small, main, counted_by = self._small, self._main, self._counted_by
        if ctx is None:
            req_id = None
            keys = dict.fromkeys(keys)  # no request to tell repeats by: one count per call
        else:
            req_id = ctx.req_id
        req = -1  # the request's token, taken at the first key held (see _token)
        for key in keys:
            freq = small.get(key)
            if freq is not None:
                queue = small
            else:
                freq = main.get(key)
                if freq is None:
                    continue
                queue = main
            if req_id is not None:
                if req < 0:
                    req = self._token(req_id)
                if counted_by.get(key) == req:
                    continue  # this request's use was counted already
                counted_by[key] = req
            if freq < _MAX_FREQ:
                queue[key] = freq + 1

    def pin(self, keys: Iterable[OffloadKey]) -> None:
        small, main, pinned = self._small, self._main, self._pinned
        for key in keys:
            if key in small:
                pinned[key] = (_SMALL, small.pop(key))
            elif key in main:
                pinned[key] = (_MAIN, main.pop(key))

    def unpin(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        small, main, pinned, counted_by = self._small, self._main, self._pinned, self._counted_by
        req_id = None if ctx is None else ctx.req_id
        req = -1
        for key in keys:
            entry = pinned.get(key)
            if entry is None:
                continue
            if req < 0 and req_id is not None:
                req = self._token(req_id)  # before any change: it is the only step that can fail
            del pinned[key]
            queue, freq = entry
            # The key left its place while pinned; it returns at the head, counted as a hit
            # unless this request's use was counted already.
            if req_id is None:
                freq = min(freq + 1, _MAX_FREQ)
            elif counted_by.get(key) != req:
                counted_by[key] = req
                freq = min(freq + 1, _MAX_FREQ)
            (small if queue == _SMALL else main)[key] = freq

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        small, main, pinned, counted_by = self._small, self._main, self._pinned, self._counted_by
        for key in keys:
            small.pop(key, None)
            main.pop(key, None)
            pinned.pop(key, None)
            counted_by.pop(key, None)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        small, main, ghost, counted_by = self._small, self._main, self._ghost, self._counted_by
        if protected:
            protected = checked_protected(protected)
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
                    counted_by.pop(key, None)
                    victims.append(key)
            else:
                key, freq = main.popitem(last=False)
                if protected and key in protected:
                    held_main.append((key, freq))
                elif freq > 0:
                    main[key] = freq - 1
                else:
                    counted_by.pop(key, None)
                    victims.append(key)
        # Protected keys return to the tail they were taken from, in their order.
        for queue, held in ((small, held_small), (main, held_main)):
            for key, freq in reversed(held):
                queue[key] = freq
                queue.move_to_end(key, last=False)
        return victims

    def _token(self, req_id: str) -> int:
        """The token of live request `req_id`, made at its first use of a key this policy
        holds: a request that names only keys it does not hold counts nothing, so a token for
        it would only take room (and, past the bound, push out a live request's token, whose
        next report would then count again)."""
        tokens = self._tokens
        token = tokens.get(req_id)
        if token is None:
            if len(tokens) >= _LIVE_REQUESTS:
                tokens.popitem(last=False)  # its id, should it come back, counts anew
            token = tokens[req_id] = self._next_token
            self._next_token += 1
        return token

    def on_request_finished(self, ctx: ReqContext) -> None:
        self._tokens.pop(ctx.req_id, None)

    def clear(self) -> None:
        self._small.clear()
        self._main.clear()
        self._ghost.clear()
        self._pinned.clear()
        self._counted_by.clear()
        self._tokens.clear()

    def table_sizes(self) -> dict[str, int]:
        """Sizes of the small, main and ghost queues, of the pinned keys and of the keys whose
        counting request is remembered."""
        return {
            "small": len(self._small),
            "main": len(self._main),
            "ghost": len(self._ghost),
            "pinned": len(self._pinned),
            "counted_by": len(self._counted_by),
            "request_tokens": len(self._tokens),
        }
