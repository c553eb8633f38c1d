"""Replay a trace through the real `CPUOffloadingManager`, in `flat` or `engine` mode.

`flat` is the textbook cache simulation: every block of every request, in order, is looked up
in the CPU tier; a hit is a use, a miss is offered for storing at once.

`engine` puts a device prefix cache in front (LRU over blocks, like an engine's GPU prefix
cache). A request's leading blocks found on the device are device hits and only touch the CPU
tier; every later block is looked up in the CPU tier (a hit is loaded, a miss is computed) and
then enters the device cache. Computed blocks are offered to the CPU tier as they are computed
(`store_on="eager"`, write-through as vLLM's offloading connector does) or only when
the device evicts them (`store_on="on-evict"`). With an empty device both modes are the same
simulation.

A CPU hit is recorded as `hits="touch"` (a use: `touch`, the textbook simulation and flat
mode's default) or `hits="load"` (`prepare_load` then `complete_load`, as an engine pins a
block while it is read; engine mode's default). Policies that treat an unpin differently from a
touch (S3-FIFO returns an unpinned key to its queue's head) give different hit ratios.

Stores complete at once (the simulator has no transfer latency), so `HIT_PENDING` never occurs.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Final

from kvtier.admission import AlwaysAdmit, ReuseAdmission
from kvtier.base import LookupResult, ManagerStats, OffloadKey, ReqContext, checked_int
from kvtier.cpu.manager import CPUOffloadingManager
from kvtier.policies import CachePolicy, registered_policies
from kvtier.sim.result import RunResult
from kvtier.sim.trace import Request, Trace, TraceTotals

STORE_ON: Final = ("eager", "on-evict")
"""When engine mode offers a computed block to the CPU tier."""

HIT_ACTIONS: Final = ("touch", "load")
"""How a replay records a CPU-tier hit."""

ProgressFn = Callable[[int], None]
"""Called now and then with the number of requests replayed since the last call."""

_PROGRESS_EVERY: Final = 256


def not_defaults(*settings: tuple[str, object, object]) -> list[str]:
    """`name=value` for each `(name, value, default)` given another value than its default (a
    bool is never a default count, though True == 1)."""
    return [f"{n}={v!r}" for n, v, default in settings if isinstance(v, bool) or v != default]


def check_device_options(mode: str, device_blocks: object, store_on: object) -> None:
    """Refuse a device cache (`device_blocks`, `store_on`) outside engine mode.

    `kvtier simulate` refuses `--device-capacity` and `--store` without `--mode engine`; the
    API ignored them, and reported a flat replay as if a device were in front. The defaults
    (no device, eager stores) describe flat mode exactly, so they pass.
    """
    if mode == "engine":
        return
    given = not_defaults(("device_blocks", device_blocks, 0), ("store_on", store_on, "eager"))
    if given:
        verb = "apply" if len(given) > 1 else "applies"
        raise ValueError(
            f"{' and '.join(given)} {verb} only to mode='engine', not mode={mode!r}; expected "
            "mode='engine', or the defaults (device_blocks=0, store_on='eager')"
        )


class DevicePrefixCache:
    """An engine's device prefix cache: LRU over blocks, of `capacity` blocks (0 = none).

    Policy-independent: the blocks of every request enter it whether they were loaded or
    computed, so its contents depend on the trace alone.
    """

    def __init__(self, capacity: int) -> None:
        # A float (2.5) was taken as a capacity and reported as one, a str failed on `<`.
        self.capacity = checked_int("device capacity", capacity, minimum=0)
        self._order: OrderedDict[OffloadKey, None] = OrderedDict()

    def prefix_hits(self, keys: Sequence[OffloadKey]) -> int:
        """Number of leading `keys` held on the device."""
        order = self._order
        n = 0
        for key in keys:
            if key not in order:
                break
            n += 1
        return n

    def add(self, key: OffloadKey) -> OffloadKey | None:
        """Record a use of `key` (inserting it if new); return the block evicted, if any."""
        order = self._order
        if key in order:
            order.move_to_end(key)
            return None
        if self.capacity == 0:
            return key
        order[key] = None
        if len(order) > self.capacity:
            return order.popitem(last=False)[0]
        return None


def policy_label(policy: object) -> str:
    """The name a row gives `policy`: a string as given; a `CachePolicy` class by its registered
    name, else as `module:Class` (a subclass of a registered policy is not that policy)."""
    if not (isinstance(policy, type) and issubclass(policy, CachePolicy)):
        return str(policy)
    name = policy.name
    if name and registered_policies().get(name) is policy:
        return name
    return f"{policy.__module__}:{policy.__qualname__}"


def make_manager(
    policy: str | type[CachePolicy],
    capacity: int,
    *,
    store_threshold: int = 0,
    max_tracker_size: int = 64_000,
) -> CPUOffloadingManager:
    """The manager a replay drives: `capacity` slots ordered by cache policy `policy`."""
    return CPUOffloadingManager(
        capacity, policy, store_threshold=store_threshold, max_tracker_size=max_tracker_size
    )


def _row_threshold(mgr: CPUOffloadingManager, given: int | None) -> int:
    """The store threshold a replay's row reports: the manager's own (its reuse admission's,
    else 0); `given`, if set, must agree. The row reported `given` whatever the manager did:
    0 for a manager admitting on the third sighting, 2 for one admitting every block."""
    admission = mgr.admission
    own = admission.store_threshold if isinstance(admission, ReuseAdmission) else 0
    if given is None:
        return own
    given = checked_int("store_threshold", given, minimum=0)
    built_in = isinstance(admission, (AlwaysAdmit, ReuseAdmission))
    # Below 2 every threshold admits every block, as AlwaysAdmit does.
    if built_in and max(given, 1) != max(own, 1):
        raise ValueError(
            f"store_threshold={given} does not match the manager's admission "
            f"({type(admission).__name__}, threshold {own}); expected {own}, or None to report "
            "the manager's"
        )
    return given


def _check_manager(mgr: object) -> None:
    if not isinstance(mgr, CPUOffloadingManager):
        # Else "'NoneType' object has no attribute 'touch'" from the first hit.
        raise TypeError(
            f"mgr={mgr!r:.80} has type {type(mgr).__name__}; expected a CPUOffloadingManager "
            "(make_manager(policy, capacity) makes one)"
        )


def _check_hits_as(hits_as: str) -> bool:
    if hits_as not in HIT_ACTIONS:
        raise ValueError(f"hits_as={hits_as!r} is invalid; expected one of: {HIT_ACTIONS}")
    return hits_as == "load"


class _Tally:
    """The totals a report needs, from a `Trace` or counted while a request stream is replayed.

    Streaming keeps only the sets of distinct keys (for `capacity_frac`) and request ids (to
    refuse a repeat), never the requests.
    """

    def __init__(self, source: Trace | Iterable[Request]) -> None:
        self._trace = source if isinstance(source, Trace) else None
        self._totals = TraceTotals()
        self.requests: Iterable[Request] = (
            source.requests if isinstance(source, Trace) else self._count(source)
        )

    def _count(self, source: Iterable[Request]) -> Iterator[Request]:
        # What `Trace` checks of a whole trace, checked of each request before it is replayed.
        add = self._totals.add
        for i, req in enumerate(source):
            add(i, req)
            yield req

    def totals(self) -> tuple[int, int, int, int, int]:
        """(requests, blocks, tokens, unique blocks, tokens per block)."""
        t = self._trace
        if t is not None:
            return len(t), t.num_blocks, t.num_tokens, t.num_unique_blocks, t.block_tokens
        c = self._totals
        return c.num_requests, c.num_blocks, c.num_tokens, len(c.unique), c.block_tokens


def _result(
    mgr: CPUOffloadingManager,
    tally: _Tally,
    *,
    before: ManagerStats,
    policy: str,
    mode: str,
    store_threshold: int,
    hits: int,
    prefix_tokens: int,
    saved: int,
    cpu_lookups: int,
    seconds: float,
    hits_as: str,
) -> RunResult:
    # The manager's counters are cumulative: a manager that served traffic before this replay
    # (a warm-up pass, an earlier trace) must not lend its counts to this replay's row.
    stats = mgr.get_stats()
    num_requests, num_blocks, num_tokens, unique, block_tokens = tally.totals()
    return RunResult(
        policy=policy,
        mode=mode,
        capacity_blocks=mgr.num_slots,
        capacity_frac=mgr.num_slots / unique if unique else 0.0,
        store_threshold=store_threshold,
        requests=num_requests,
        blocks=num_blocks,
        tokens=num_tokens,
        block_tokens=block_tokens,
        hits=hits,
        prefix_tokens=prefix_tokens,
        prefill_tokens_saved=saved,
        cpu_lookups=cpu_lookups,
        cpu_hits=stats.hits - before.hits,
        # A touched hit is still a block the engine would load.
        loads=(stats.loads - before.loads) if hits_as == "load" else stats.hits - before.hits,
        stores=stats.stores - before.stores,
        evictions=stats.evictions - before.evictions,
        stores_skipped=stats.stores_skipped - before.stores_skipped,
        seconds=seconds,
        hits_as=hits_as,
    )


def _hit_recorder(
    mgr: CPUOffloadingManager, load: bool
) -> Callable[[OffloadKey, ReqContext], None]:
    """How a replay records a CPU hit: a pinned load and its completion, or a touch."""
    if load:
        prepare_load, complete_load = mgr.prepare_load, mgr.complete_load

        def record_load(key: OffloadKey, ctx: ReqContext) -> None:
            one = (key,)
            prepare_load(one, ctx)
            complete_load(one, ctx)

        return record_load
    touch = mgr.touch

    def record_touch(key: OffloadKey, ctx: ReqContext) -> None:
        touch((key,), ctx)

    return record_touch


def _store_one(mgr: CPUOffloadingManager) -> Callable[[OffloadKey, ReqContext], None]:
    """Offer one key for storing and complete the store at once (a replay moves no bytes)."""
    prepare_store, complete_store = mgr.prepare_store, mgr.complete_store

    def store(key: OffloadKey, ctx: ReqContext) -> None:
        out = prepare_store((key,), ctx)
        if out is not None and out.keys_to_store:
            complete_store(out.keys_to_store, ctx)

    return store


def replay_flat(
    trace: Trace | Iterable[Request],
    mgr: CPUOffloadingManager,
    *,
    policy: str = "",
    store_threshold: int | None = None,
    hits_as: str = "touch",
    progress: ProgressFn | None = None,
) -> RunResult:
    """Replay every block access of `trace` through `mgr` (the textbook simulation).

    `trace` may be a `Trace` or any iterable of requests, such as `iter_trace(path)`, which is
    then streamed: an item that is no `Request`, one whose block size differs from the
    first's, or one whose `req_id` an earlier request has, raises before it is replayed. The
    row's `store_threshold` is that of `mgr`'s admission; one given must agree with it. The
    row names the policy `policy`, else as `policy_label` names `mgr`'s policy class.
    """
    _check_manager(mgr)
    record_hit = _hit_recorder(mgr, _check_hits_as(hits_as))
    threshold = _row_threshold(mgr, store_threshold)
    store_one = _store_one(mgr)
    hit_result = LookupResult.HIT
    lookup = mgr.lookup
    hits = 0
    prefix_tokens = 0
    tally = _Tally(trace)
    before = mgr.get_stats()
    n = 0
    start = time.perf_counter()
    for n, req in enumerate(tally.requests, start=1):
        ctx = req.ctx
        mgr.on_new_request(ctx)
        prefix = -1  # blocks before the first miss; -1 while none missed
        for i, key in enumerate(req.keys):
            if lookup(key, ctx) is hit_result:
                record_hit(key, ctx)
                hits += 1
            else:
                if prefix < 0:
                    prefix = i
                store_one(key, ctx)
        mgr.on_request_finished(ctx)
        prefix_tokens += req.prefix_tokens(len(req.keys) if prefix < 0 else prefix)
        if progress is not None and n % _PROGRESS_EVERY == 0:
            progress(_PROGRESS_EVERY)
    seconds = time.perf_counter() - start
    if progress is not None:
        progress(n % _PROGRESS_EVERY)
    return _result(
        mgr,
        tally,
        before=before,
        policy=policy or policy_label(type(mgr.policy)),
        mode="flat",
        store_threshold=threshold,
        hits=hits,
        prefix_tokens=prefix_tokens,
        saved=prefix_tokens,
        cpu_lookups=tally.totals()[1],
        seconds=seconds,
        hits_as=hits_as,
    )


def replay_engine(
    trace: Trace | Iterable[Request],
    mgr: CPUOffloadingManager,
    *,
    device_blocks: int,
    store_on: str = "eager",
    policy: str = "",
    store_threshold: int | None = None,
    hits_as: str = "load",
    progress: ProgressFn | None = None,
) -> RunResult:
    """Replay `trace` with a device prefix cache of `device_blocks` blocks in front of `mgr`.

    `trace` may be a `Trace` or any iterable of requests, which is then streamed (checked as in
    `replay_flat`). The row's `store_threshold` is that of `mgr`'s admission; one given must
    agree with it.
    """
    if store_on not in STORE_ON:
        raise ValueError(f"store_on={store_on!r} is invalid; expected one of: {STORE_ON}")
    _check_manager(mgr)
    record_hit = _hit_recorder(mgr, _check_hits_as(hits_as))
    threshold = _row_threshold(mgr, store_threshold)
    store_one = _store_one(mgr)
    eager = store_on == "eager"
    device = DevicePrefixCache(device_blocks)
    hit_result = LookupResult.HIT
    lookup = mgr.lookup
    hits = device_hits = cpu_lookups = prefix_tokens = saved = 0
    tally = _Tally(trace)
    before = mgr.get_stats()
    n = 0
    start = time.perf_counter()
    for n, req in enumerate(tally.requests, start=1):
        ctx = req.ctx
        keys = req.keys
        mgr.on_new_request(ctx)
        d = device.prefix_hits(keys)
        if d:
            mgr.touch(keys[:d], ctx)
        prefix = -1
        for i, key in enumerate(keys):
            if i >= d:
                cpu_lookups += 1
                if lookup(key, ctx) is hit_result:
                    record_hit(key, ctx)
                    hits += 1
                else:
                    if prefix < 0:
                        prefix = i
                    if eager:
                        store_one(key, ctx)
            evicted = device.add(key)
            if evicted is not None and not eager:
                store_one(evicted, ctx)
        mgr.on_request_finished(ctx)
        device_hits += d
        served = req.prefix_tokens(len(keys) if prefix < 0 else prefix)
        prefix_tokens += served
        saved += served - req.prefix_tokens(d)
        if progress is not None and n % _PROGRESS_EVERY == 0:
            progress(_PROGRESS_EVERY)
    seconds = time.perf_counter() - start
    if progress is not None:
        progress(n % _PROGRESS_EVERY)
    result = _result(
        mgr,
        tally,
        before=before,
        policy=policy or policy_label(type(mgr.policy)),
        mode="engine",
        store_threshold=threshold,
        hits=hits + device_hits,
        prefix_tokens=prefix_tokens,
        saved=saved,
        cpu_lookups=cpu_lookups,
        seconds=seconds,
        hits_as=hits_as,
    )
    result.device_blocks = device.capacity
    result.device_hits = device_hits
    result.store_on = store_on
    return result
