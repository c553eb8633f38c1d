"""Scheduler-side bookkeeping of the host (CPU) tier: slots, ref counts, eviction, events."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from itertools import chain, repeat
from numbers import Real
from operator import setitem
from typing import TYPE_CHECKING, Final

import numpy as np

from kvtier.admission import (
    AdmissionPolicy,
    AlwaysAdmit,
    ReuseAdmission,
    make_admission_policy,
)
from kvtier.base import (
    LookupResult,
    ManagerStats,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    checked_int,
)
from kvtier.cpu.spec import CPULoadStoreSpec
from kvtier.policies import CachePolicy, make_policy

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig

logger = logging.getLogger(__name__)

# Ref-count values of a slot; a positive value is the number of loads reading it.
_PENDING = -1  # being written: not readable, not evictable
_READY = 0  # readable and evictable
_FREE = -2


# Policies shipped with kvtier; any other (a plugin, a subclass) has its victims checked.
_BUILTIN_POLICY_MODULES: Final = frozenset(
    f"kvtier.policies.{name}" for name in ("lru", "arc", "s3fifo", "sieve", "kvaware")
)


def _key_str(key: object) -> str:
    """A key for an error message: hex for bytes, repr for anything a caller passed by mistake
    (an int or str key has no `.hex()`, and the error must name it, not fail on it)."""
    return key.hex() if isinstance(key, bytes) else repr(key)


def _policy_str(policy: object) -> str:
    """A policy for an error message: its own repr if it has one, else its class's full name
    (object's repr adds an address that tells the reader nothing)."""
    cls = type(policy)
    if cls.__repr__ is not object.__repr__:
        return repr(policy)
    return f"{cls.__module__}.{cls.__qualname__}"


def _not_bytes(key: object) -> TypeError:
    return TypeError(f"offload keys are bytes; got {type(key).__name__} {key!r}")


def _one_key_error(keys: object) -> TypeError:
    # A bytes key is iterable: its bytes would be taken as the keys 0..255.
    return TypeError(
        f"keys={keys!r} is one {type(keys).__name__} object; expected a collection of keys "
        "(a list of OffloadKey)"
    )


_NOT_KEY_LISTS = (bytes, bytearray, memoryview, str)


def _key_list(keys: object) -> list[OffloadKey]:
    """`keys` (any iterable of keys but a list or tuple) as a new list, or a TypeError naming
    it: `list(None)` said only "'NoneType' object is not iterable"."""
    if isinstance(keys, _NOT_KEY_LISTS):
        raise _one_key_error(keys)
    try:
        it = iter(keys)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(
            f"keys={keys!r:.80} has type {type(keys).__name__}; expected a collection of keys "
            "(a list of OffloadKey)"
        ) from None
    return list(it)


def _unhashable_key(keys: Iterable[object]) -> TypeError:
    """The error for the first key of `keys` that cannot be a dict key: hashing it raised a
    bare "unhashable type: 'bytearray'", naming neither the key nor what was expected."""
    for key in keys:
        try:
            hash(key)
        except TypeError:
            return _not_bytes(key)
    return TypeError(f"keys={keys!r:.80}: expected offload keys (bytes)")


def _bad_position(ctx: ReqContext) -> tuple[object, object] | None:
    """The first (key, position) of `ctx` whose position is not a number, or is NaN, else
    None."""
    for key, position in ctx.key_positions.items():
        # NaN is a Real that kvaware refuses as it does a str: let through, the call was
        # applied without the ctx instead of refused.
        if not isinstance(position, Real) or position != position:
            return key, position
    return None


def _check_ctx(ctx: object) -> None:
    # The policies and admission read ctx.req_id and ctx.key_positions part-way through a
    # batch, after the manager changed its own state: a wrong ctx (a bare request id string,
    # None) failed there, leaving a slot ready but never evictable, or a key pinned forever.
    if type(ctx) is not ReqContext and not isinstance(ctx, ReqContext):
        raise TypeError(f"ctx={ctx!r} has type {type(ctx).__name__}; expected a ReqContext")


def _request_keys(keys: Collection[OffloadKey], ctx: object) -> Sequence[OffloadKey]:
    """`keys` and `ctx` of a call the policy only reads (`touch`, `prefix_extended`), checked:
    a list (read twice: checked, then handed to the policy) of bytes keys, and a ReqContext."""
    if not isinstance(keys, (list, tuple)):
        keys = _key_list(keys)
    _check_ctx(ctx)
    for key in keys:
        if type(key) is not bytes:
            # Policies ignore (or, kvaware, count) a key they do not hold, so an int block
            # hash was a silent no-op, and an unhashable one raised after earlier keys moved.
            raise _not_bytes(key)
    return keys


class CPUOffloadingManager(OffloadingManager):
    """Tracks which chunks live in a pool of `num_slots` host slots.

    The cache policy orders the evictable chunks; the admission policy filters what is worth
    storing. Every method costs O(number of keys passed). Arguments are validated before any
    state changes, so a call that raises leaves the manager as it was. One exception: when the
    cache policy fails `complete_load`'s or `complete_store`'s keys with the request's ctx but
    not without it, the call is applied and then the policy's error raised, noted as applied,
    so that a policy that cannot read a ctx strands no pin and no pending slot.

    An asynchronous exception (a KeyboardInterrupt from Ctrl-C) can land between any two
    bytecodes. `reset_cache`, `on_reset_flushed`, `complete_store(success=False)` and
    `lookup` are atomic with respect to it: each computes its change first and commits it with
    uninterruptible operations (attribute stores, slice assignments, one C-level `any()` over
    lazy `map`s of C functions, in which CPython runs no signal handler), so it leaves the
    state as before the call or as after it. `reset_cache` completes its reset even if the
    interrupt lands in the policy's `clear()`. The hot-path calls (`prepare_load`,
    `complete_load`, `prepare_store`, `complete_store(success=True)`) are not: the same commit
    made them 10-30% slower. An interrupt inside one of them can leave its own keys part-way
    (some pins or slots counted or mapped, others not); after such an interrupt, call
    `reset_cache()`, which also takes back the slots the call held but had not mapped, and,
    once the transfers in flight are done, `on_reset_flushed()`.
    """

    medium = "CPU"

    def __init__(
        self,
        num_slots: int,
        cache_policy: str | type[CachePolicy] = "lru",
        *,
        admission: AdmissionPolicy | None = None,
        store_threshold: int = 0,
        max_tracker_size: int | None = None,
        enable_events: bool = False,
        max_pending_events: int = 100_000,
    ) -> None:
        num_slots = checked_int("num_slots", num_slots)
        max_pending_events = checked_int("max_pending_events", max_pending_events)
        if not isinstance(enable_events, (bool, np.bool_)):
            # "false" or "no" is truthy: events would be collected that nobody asked for.
            raise ValueError(f"enable_events={enable_events!r} is invalid; expected a bool")
        if admission is None:
            admission = make_admission_policy(
                store_threshold, 64_000 if max_tracker_size is None else max_tracker_size
            )
        elif not isinstance(admission, AdmissionPolicy):
            # Else the first prepare_store fails on a missing `preview`.
            raise TypeError(
                f"admission={admission!r} has type {type(admission).__name__}; expected an "
                "AdmissionPolicy instance (or store_threshold for the built-in ones)"
            )
        elif store_threshold != 0:
            # Both would decide admission; the threshold was silently ignored.
            raise ValueError(
                f"store_threshold={store_threshold!r} with admission={admission!r}: expected "
                "only one of them (the admission policy carries its own threshold)"
            )
        elif max_tracker_size is not None:
            raise ValueError(
                f"max_tracker_size={max_tracker_size!r} with admission={admission!r}: expected "
                "only one of them (the admission policy sizes its own tracker)"
            )
        self.num_slots = num_slots
        try:
            self._policy: CachePolicy = make_policy(cache_policy, num_slots)
            self._ref: list[int] = [_FREE] * num_slots
        except (MemoryError, OverflowError) as e:
            # A bare MemoryError (or "cannot fit 'int' into an index-sized integer") named
            # neither the value nor the likely mistake: a byte count passed as slots.
            raise ValueError(
                f"num_slots={num_slots} is too large: its bookkeeping does not fit in memory "
                f"({type(e).__name__}); expected the number of chunk-sized host slots"
            ) from e
        self._admission: AdmissionPolicy = admission
        self._admit_all = type(self._admission) is AlwaysAdmit
        # A plugin's answer is checked before it is acted on; the built-in ones are trusted.
        self._check_admitted = type(self._admission) not in (AlwaysAdmit, ReuseAdmission)
        self._check_victims = type(self._policy).__module__ not in _BUILTIN_POLICY_MODULES
        self._slot_of: dict[OffloadKey, int] = {}
        self._free: list[int] = []
        self._next_fresh = 0
        # Slots still read or written by transfers that were in flight at reset_cache().
        self._quarantined: list[int] = []
        self._num_pinned = 0
        self._num_pending = 0
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._max_pending_events = max_pending_events
        self._events_merged = 0
        self._hits = 0
        self._misses = 0
        self._loads = 0
        self._stores = 0
        self._failed_stores = 0
        self._stores_skipped = 0
        self._evictions = 0
        self._stores_no_room = 0

    @classmethod
    def from_config(
        cls, num_slots: int, config: KVTierConfig, *, enable_events: bool | None = None
    ) -> CPUOffloadingManager:
        """A manager with `config`'s policy, admission and event settings; `enable_events`
        overrides the config's (an engine integration may decide it from the engine's own)."""
        return cls(
            num_slots,
            config.cache_policy,
            store_threshold=config.store_threshold,
            max_tracker_size=config.max_tracker_size,
            enable_events=config.enable_events if enable_events is None else enable_events,
            max_pending_events=config.max_pending_events,
        )

    @property
    def policy(self) -> CachePolicy:
        """The cache policy instance (read-only use: tests, reports)."""
        return self._policy

    @property
    def admission(self) -> AdmissionPolicy:
        """The admission policy instance."""
        return self._admission

    # -- lookups and loads --------------------------------------------------------------------

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        try:
            slot = self._slot_of.get(key)
        except TypeError:  # unhashable
            slot = None
        if slot is None:
            if type(key) is not bytes:
                # An int block hash or a str was a silent miss, counted in the stats, while
                # prepare_store refuses it: a caller would never learn why nothing hits.
                raise _not_bytes(key)
            self._misses += 1
            return LookupResult.MISS
        if self._ref[slot] == _PENDING:
            return LookupResult.HIT_PENDING
        self._hits += 1
        return LookupResult.HIT

    def prepare_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> CPULoadStoreSpec:
        if not isinstance(keys, (list, tuple)):
            keys = _key_list(keys)  # read twice below: a one-shot iterator would pin nothing
        # Unused here, but complete_load refuses it: the pins would be released by nothing.
        _check_ctx(ctx)
        slot_of, ref = self._slot_of, self._ref
        slots: list[int] = []
        for key in keys:
            try:
                slot = slot_of.get(key)
            except TypeError:  # unhashable
                raise _not_bytes(key) from None
            if slot is None or ref[slot] == _PENDING:
                state = "absent" if slot is None else "still being written"
                raise ValueError(f"cannot load key {_key_str(key)}: it is {state}")
            slots.append(slot)
        newly_pinned = []
        for key, slot in zip(keys, slots, strict=True):
            if ref[slot] == _READY:
                newly_pinned.append(key)
            ref[slot] += 1
        try:
            self._policy.pin(newly_pinned)
        except BaseException as error:
            # A policy that raised part-way (a plugin's bug) would leave these keys pinned
            # here with no spec returned, so no complete_load would ever release them: their
            # slots were lost for good. Undone (unpinning counts as a use in the policy; no
            # ctx, so that positions it cannot read cannot fail the undo too).
            for slot in slots:
                ref[slot] -= 1
            self._undo_pin(newly_pinned, error)
            raise
        self._num_pinned += len(newly_pinned)
        self._loads += len(slots)
        return CPULoadStoreSpec(slots)

    def complete_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        if not isinstance(keys, (list, tuple)):
            keys = _key_list(keys)
        _check_ctx(ctx)
        slot_of, ref = self._slot_of, self._ref
        try:
            counts = Counter(keys) if len(set(keys)) != len(keys) else None
        except TypeError:
            raise _unhashable_key(keys) from None
        for key in keys:
            slot = slot_of.get(key)
            needed = counts[key] if counts is not None else 1
            if slot is None or ref[slot] < needed:
                raise ValueError(f"complete_load of key {_key_str(key)} that no load pinned")
        # The keys this call unpins, in the order their last load ends.
        if counts is None:
            unpinned = [key for key in keys if ref[slot_of[key]] == 1]
        else:
            left = dict(counts)
            unpinned = []
            for key in keys:
                left[key] -= 1
                if not left[key] and ref[slot_of[key]] == counts[key]:
                    unpinned.append(key)
        # The policy first: should it fail for good, its keys are pinned again and the manager
        # is unchanged, rather than unpinned here but held pinned by the policy, never
        # evictable again. A ctx it cannot read is not such a failure (see _without_ctx).
        policy = self._policy
        error: Exception | None = None
        try:
            policy.unpin(unpinned, ctx)
        except Exception as e:
            error = e
            self._without_ctx(policy.unpin, policy.pin, unpinned, ctx, e)
        except BaseException:
            policy.pin(unpinned)
            raise
        for key in keys:
            ref[slot_of[key]] -= 1
        self._num_pinned -= len(unpinned)
        if error is not None:
            raise error  # done without the ctx: the policy's bug is still the caller's to see

    def touch(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        self._policy.touch(_request_keys(keys, ctx), ctx)

    # -- stores -------------------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        # Hot path of every engine step and of trace replays: kept flat on purpose.
        if not isinstance(keys, (list, tuple)):
            keys = _key_list(keys)  # read again when evicting: a one-shot iterator would be empty
        _check_ctx(ctx)
        slot_of = self._slot_of
        try:
            new = [key for key in keys if key not in slot_of]
        except TypeError:  # unhashable
            raise _not_bytes(next(k for k in keys if type(k) is not bytes)) from None
        num_new = len(new)
        if num_new == 0:
            return PrepareStoreOutput([], CPULoadStoreSpec(()), [])
        for key in new:
            if type(key) is not bytes:
                raise _not_bytes(key)
        if num_new > 1 and len(set(new)) != num_new:
            new = list(dict.fromkeys(new))
            num_new = len(new)
        # The admission decision is previewed and recorded only once the store goes ahead, so
        # a call that finds no room changes nothing (a policy that cannot preview records now).
        recorder = None
        if self._admit_all:
            admitted = new
        else:
            previewed = self._admission.preview(new, ctx)
            if previewed is None:
                admitted = self._admission.admit(new, ctx)
            else:
                admitted, recorder = previewed, self._admission
            if self._check_admitted:
                admitted = self._checked_admitted(admitted, new)
        n = len(admitted)
        free = self._free
        fresh_left = self.num_slots - self._next_fresh
        num_to_evict = n - len(free) - fresh_left
        evicted: list[OffloadKey] = []
        ref = self._ref
        policy = self._policy
        present: Collection[OffloadKey] = ()
        if num_to_evict > 0:
            candidates = len(policy)
            if num_to_evict <= candidates and num_new < len(keys):
                present = [key for key in keys if key in slot_of]
                if recorder is not None and num_to_evict > candidates - len(present):
                    # Those this store protects are no victims (every policy's evict counts
                    # them so): known to find no room now, the store records nothing below.
                    candidates -= sum(map(policy.__contains__, set(present)))
            if num_to_evict > candidates:
                self._stores_no_room += num_new
                return None
        if recorder is not None:
            # Before any eviction: should it raise (or be interrupted), nothing changed here.
            # After it, the victims could go back to the policy only as its newest candidates
            # (CachePolicy has no call that puts a key back where it was).
            recorder.record(new, ctx)
        if num_to_evict > 0:
            if self._check_victims:
                victims = self._checked_evict(num_to_evict, present)
            else:
                victims = policy.evict(num_to_evict, present)
            if victims is None:
                # After a record only from a plugin policy that breaks its contract: the offer
                # stays recorded, as by an admission policy that cannot preview.
                self._stores_no_room += num_new
                return None
            evicted = victims
        self._stores_skipped += num_new - n
        if evicted:
            for key in evicted:
                slot = slot_of.pop(key)
                ref[slot] = _FREE
                free.append(slot)
            self._evictions += len(evicted)
            if self._events is not None:
                # A copy: the caller owns `evicted_keys` and may consume it.
                self._emit(list(evicted), removed=True)

        # Fresh slots first: they were never handed out, so no transfer can still touch them.
        if fresh_left >= n:
            first = self._next_fresh
            slots = list(range(first, first + n))
            self._next_fresh = first + n
        else:
            slots = list(range(self._next_fresh, self.num_slots))
            self._next_fresh = self.num_slots
            rest = n - len(slots)
            slots += free[-rest:]
            del free[-rest:]
        for key, slot in zip(admitted, slots, strict=True):
            slot_of[key] = slot
            ref[slot] = _PENDING
        self._num_pending += n
        return PrepareStoreOutput(admitted, CPULoadStoreSpec(slots), evicted)

    def complete_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        if not isinstance(success, (bool, np.bool_)):
            # "no" or None would silently pick a branch: announce unwritten bytes, or drop them.
            raise ValueError(f"complete_store got success={success!r}; expected a bool")
        # A copy: read twice (a one-shot iterator would leave slots ready but unannounced and
        # never evictable), and the stored event must not alias the caller's list.
        keys = list(keys) if isinstance(keys, (list, tuple)) else _key_list(keys)
        _check_ctx(ctx)
        slot_of, ref = self._slot_of, self._ref
        try:
            slots = [slot_of.get(key, -1) for key in keys]
        except TypeError:
            raise _unhashable_key(keys) from None
        for key, slot in zip(keys, slots, strict=True):
            if slot < 0 or ref[slot] != _PENDING:
                raise ValueError(f"complete_store of key {_key_str(key)}: no store pending")
        if len(slots) > 1 and len(set(slots)) != len(slots):
            once: set[OffloadKey] = set()
            for twice in keys:
                if twice in once:
                    break
                once.add(twice)
            raise ValueError(
                f"complete_store got the same key twice ({_key_str(twice)}); expected each "
                "pending key once"
            )
        if success:
            # The policy first: should it fail for good, it forgets the keys and they stay
            # pending here, rather than ready here but unknown to it, never evictable. A ctx it
            # cannot read is not such a failure (see _without_ctx).
            policy = self._policy
            error: Exception | None = None
            try:
                policy.insert(keys, ctx)
            except Exception as e:
                error = e
                self._without_ctx(policy.insert, policy.remove, keys, ctx, e)
            except BaseException:
                policy.remove(keys)
                raise
            for slot in slots:
                ref[slot] = _READY
            self._num_pending -= len(slots)
            self._stores += len(keys)
            # An empty event would only count towards max_pending_events and force merges.
            if keys and self._events is not None:
                self._emit(keys, removed=False)
            if error is not None:
                raise error  # done without the ctx: the policy's bug is still the caller's to see
        else:
            # Never announced, so nothing public to retract.
            commit = chain(
                map(slot_of.__delitem__, keys),
                map(setitem, repeat(ref), slots, repeat(_FREE)),
                map(self._free.extend, (slots,)),
            )
            num_failed = len(slots)
            # The commit: stores that cannot be interrupted, then one C call (see the class).
            self._num_pending -= num_failed
            self._failed_stores += num_failed
            any(commit)

    # -- lifecycle ----------------------------------------------------------------------------

    def on_request_finished(self, ctx: ReqContext) -> None:
        _check_ctx(ctx)
        self._policy.on_request_finished(ctx)

    def prefix_extended(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self._policy.prefix_extended(_request_keys(keys, ctx), ctx)

    def reset_cache(self) -> None:
        """Forget every chunk. Slots that in-flight transfers still use are quarantined until
        `on_reset_flushed`, so a new store can never overwrite bytes a late load still reads."""
        ref, slot_of, events = self._ref, self._slot_of, self._events
        announced = [key for key, slot in slot_of.items() if ref[slot] != _PENDING]
        ready = [slot for slot in slot_of.values() if ref[slot] == _READY]
        busy = [slot for slot in slot_of.values() if ref[slot] != _READY]
        free, quarantined = self._free, self._quarantined
        if len(free) + len(slot_of) + len(quarantined) != self._next_fresh:
            # An interrupted prepare_store dropped slots between its tables: a victim's, or
            # ones it took but had not mapped. No transfer was issued for them, so they are
            # free now; left out, the pool would stay that much smaller.
            placed = set(free).union(slot_of.values(), quarantined)
            ready += [slot for slot in range(self._next_fresh) if slot not in placed]
        commit: Iterator[object] = chain(
            map(setitem, repeat(ref), ready, repeat(_FREE)),
            map(setitem, repeat(ref), busy, repeat(_FREE)),
            map(free.extend, (ready,)),
            map(quarantined.extend, (busy,)),
            map(dict.clear, (slot_of,)),
        )
        if announced and events is not None:
            commit = chain(
                commit, map(events.append, [OffloadingEvent(announced, self.medium, True)])
            )
        # Neither clear() can be undone: once either may have run, the reset is completed.
        try:
            try:
                self._policy.clear()
            finally:
                self._admission.clear()
        finally:
            self._num_pinned = 0
            self._num_pending = 0
            any(commit)
        if announced and events is not None and len(events) > self._max_pending_events:
            self._merge_events()

    def on_reset_flushed(self) -> None:
        """Every transfer in flight at the last reset has finished: reuse their slots."""
        # In-place concatenation runs no bytecode between the two lists' changes: an interrupt
        # can never leave a slot in both (it would be handed out twice).
        self._free += self._quarantined
        self._quarantined.clear()

    def _without_ctx(
        self,
        call: Callable[[list[OffloadKey], ReqContext | None], None],
        undo: Callable[[list[OffloadKey]], None],
        keys: list[OffloadKey],
        ctx: ReqContext,
        error: Exception,
    ) -> None:
        """The policy's `call(keys, ctx)` (`unpin` or `insert`) raised `error`: call it again
        without the ctx, which every policy accepts (prepare_load's undo relies on it).

        A plugin that cannot read a well-formed ctx fails every retry with it, and the
        connector cannot retry a cancelled job at all: the keys stayed pinned or pending for
        good, never evictable. Done without the ctx, the call only loses that request's hints;
        the caller applies it, then raises `error`, noted as applied (a repeated call is
        refused). Raises here, after `undo(keys)`, if the ctx is malformed (the caller's
        error: nothing applied, so that it can call again with a good one) or the policy fails
        without the ctx too."""
        bad = _bad_position(ctx)
        if bad is not None:
            undo(keys)
            raise TypeError(
                f"ctx of request {ctx.req_id!r} maps key {_key_str(bad[0])} to position "
                f"{bad[1]!r}; expected an int token position"
            ) from error
        name = getattr(call, "__name__", "call")
        try:
            call(keys, None)
        except BaseException as again:
            undo(keys)
            if not isinstance(again, Exception):
                raise
            failed = again
        else:
            error.add_note(
                f"kvtier: cache policy {_policy_str(self._policy)} could not {name} "
                f"{len(keys)} keys with the ctx of request {ctx.req_id!r}; done without it, "
                "the call is applied (calling it again is refused)"
            )
            return
        error.add_note(
            f"kvtier: called again without the ctx, {name} raised {failed!r} too; the manager "
            "is unchanged"
        )
        raise error

    def _undo_pin(self, keys: list[OffloadKey], error: BaseException) -> None:
        """Back among the policy's candidates, `keys`, whose `pin` raised `error` part-way."""
        policy = self._policy
        try:
            policy.unpin(keys, None)
        except BaseException as again:
            # Pinned in the policy, ready here: never evictable. Forgotten and inserted again,
            # the one other way back among the candidates (as the newest).
            stuck = [key for key in keys if key not in policy]
            policy.remove(stuck)
            policy.insert(stuck, None)
            error.add_note(
                f"kvtier: undoing the pins, unpin raised {again!r} too; {len(stuck)} keys were "
                "inserted again as the newest candidates"
            )

    def _checked_evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        """A plugin policy's `evict`, its answer checked. Should it raise, or answer None (no
        room) after taking keys out, those keys were ready here but gone from the policy:
        never evictable again, the pool that much smaller for good. They are put back, as the
        newest candidates: the policy's eviction order changed, which no general fix can
        avoid (CachePolicy has no call that puts a key back where it was, and a copy of the
        policy before each eviction would cost O(candidates)); the error says so."""
        policy = self._policy
        held = len(policy)
        try:
            victims = policy.evict(n, protected)
        except BaseException as error:
            put_back = self._restore_candidates()
            if put_back:
                error.add_note(f"kvtier: {_policy_str(policy)}.evict raised{put_back}")
            raise
        if victims is None:
            left = len(policy)
            if left != held:
                put_back = self._restore_candidates()
                raise ValueError(
                    f"cache policy {_policy_str(policy)} returned None (no room) but went from "
                    f"{held} candidates to {left}; expected None to change nothing{put_back}"
                )
            return None
        checked = self._checked_victims(victims, n, protected)
        left = len(policy)
        if left != held - n:
            # Right victims, but other candidates dropped too (never evictable again: the pool
            # that much smaller for good), or victims kept (a key gone from the tier, which a
            # later evict would name). Refused before anything is evicted, the dropped put back.
            put_back = self._restore_candidates()
            raise ValueError(
                f"cache policy {_policy_str(policy)} returned {n} victims but went from {held} "
                f"candidates to {left}; expected {held - n}{put_back}"
            )
        return checked

    def _restore_candidates(self) -> str:
        """Back among the candidates, every ready key the policy dropped: out of the policy,
        they could never be evicted again. A scan of the tier, on error paths only. Returns
        what was done, for the error ("" if nothing)."""
        slot_of, ref, policy = self._slot_of, self._ref, self._policy
        lost = [k for k, slot in slot_of.items() if ref[slot] == _READY and k not in policy]
        if not lost:
            return ""
        policy.insert(lost, None)
        return (
            f"; the {len(lost)} ready keys it had taken out were inserted again, as its newest "
            "candidates (its eviction order changed: CachePolicy has no call that puts a key "
            "back where it was)"
        )

    def _checked_victims(
        self, victims: object, n: int, protected: Collection[OffloadKey]
    ) -> list[OffloadKey]:
        # Evicting a pinned slot would let a store overwrite what a load is reading; a key not
        # held, or one twice, would fail part-way through the eviction.
        slot_of, ref = self._slot_of, self._ref
        why = ""
        keys: list[OffloadKey] = []
        if isinstance(victims, list):
            keys = victims
        else:
            why = f"returned {type(victims).__name__} {victims!r:.80}"
        seen: set[OffloadKey] = set()
        for key in keys:
            slot = slot_of.get(key) if type(key) is bytes else None
            if slot is None:
                why = f"evicted {key!r}, which the tier does not hold"
            elif ref[slot] != _READY:
                state = "being written" if ref[slot] == _PENDING else "pinned by a load"
                why = f"evicted {_key_str(key)}, which is {state}"
            elif key in seen:
                why = f"evicted {_key_str(key)} twice"
            elif key in protected:
                why = f"evicted {_key_str(key)}, which this store protects"
            if why:
                break
            seen.add(key)
        if not why and len(seen) != n:
            why = f"evicted {len(seen)} keys"
        if not why:
            return keys
        # What it returned, or what it took out and returned something else for.
        put_back = self._restore_candidates()
        raise ValueError(
            f"cache policy {_policy_str(self._policy)} {why}; expected {n} distinct ready keys of "
            f"the tier, none pinned, being written or protected{put_back}"
        )

    def _checked_admitted(self, admitted: object, new: list[OffloadKey]) -> list[OffloadKey]:
        # A key twice, or one already in the tier, would be given a second slot: the first
        # leaks, and the counts go negative.
        if not isinstance(admitted, (list, tuple)):
            raise TypeError(
                f"admission policy {_policy_str(self._admission)} returned "
                f"{type(admitted).__name__} {admitted!r:.80}; expected a list of offered keys"
            )
        offered = set(new)
        seen: set[OffloadKey] = set()
        for key in admitted:
            try:
                twice = key in seen
                known = key in offered
            except TypeError:  # unhashable (a key wrapped in a list): a bare error named no policy
                twice = known = False
            if twice or not known:
                raise ValueError(
                    f"admission policy {_policy_str(self._admission)} returned {key!r}, which was "
                    f"{'returned twice' if twice else 'not offered'}; expected a subset "
                    "of the offered keys absent from the tier, each once"
                )
            seen.add(key)
        return list(admitted)

    # -- events and stats ---------------------------------------------------------------------

    def _emit(self, keys: list[OffloadKey], removed: bool) -> None:
        events = self._events
        if events is None:
            return
        events.append(OffloadingEvent(keys, self.medium, removed))
        if len(events) > self._max_pending_events:
            self._merge_events()

    def _merge_events(self) -> None:
        """Replace the pending events by their net effect: at most one `removed` and one
        `stored` event. Nothing a consumer needs is lost, and the merged events name at most
        2 * num_slots keys (those stored since the last take, and those removed that a consumer
        had been told of), however long nobody takes them."""
        events = self._events
        assert events is not None
        first: dict[OffloadKey, bool] = {}
        last: dict[OffloadKey, bool] = {}
        for event in events:
            for key in event.keys:
                first.setdefault(key, event.removed)
                last[key] = event.removed
        # A key's events alternate (stored, removed, stored, ...): when its first and last
        # differ, it ends as a consumer last saw it, and its events cancel out.
        removed = [key for key, r in last.items() if r and first[key]]
        stored = [key for key, r in last.items() if not r and not first[key]]
        merged = []
        if removed:
            merged.append(OffloadingEvent(removed, self.medium, True))
        if stored:
            merged.append(OffloadingEvent(stored, self.medium, False))
        # One slice assignment: an interrupt leaves the events merged or not, never lost.
        events[:] = merged
        self._events_merged += 1
        if self._events_merged == 1:
            logger.warning(
                "kvtier: more than %d KV events not taken; merging them into their net effect "
                "(call take_events() every step, or raise max_pending_events)",
                self._max_pending_events,
            )

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return []
        taken = self._events
        self._events = []
        return taken

    @property
    def events_merged(self) -> int:
        """How often pending events were merged into their net effect because nobody took
        them before `max_pending_events` accumulated."""
        return self._events_merged

    def get_stats(self) -> ManagerStats:
        used = len(self._slot_of) + len(self._quarantined)
        return ManagerStats(
            num_slots=self.num_slots,
            used_slots=used,
            ready=len(self._slot_of) - self._num_pinned - self._num_pending,
            pinned=self._num_pinned,
            pending_writes=self._num_pending,
            hits=self._hits,
            misses=self._misses,
            loads=self._loads,
            stores=self._stores,
            failed_stores=self._failed_stores,
            stores_skipped=self._stores_skipped,
            evictions=self._evictions,
            stores_no_room=self._stores_no_room,
        )

    def table_sizes(self) -> dict[str, int]:
        """Sizes of every internal table, so tests can check their bounds."""
        sizes = {
            "slot_of": len(self._slot_of),
            "free": len(self._free),
            "quarantined": len(self._quarantined),
            "events": len(self._events) if self._events is not None else 0,
        }
        sizes.update({f"policy.{k}": v for k, v in self._policy.table_sizes().items()})
        sizes.update({f"admission.{k}": v for k, v in self._admission.table_sizes().items()})
        return sizes
