"""Run many replays of one trace (policies × capacities), in parallel processes when asked.

Worker processes are forked after the trace is loaded, so they share it instead of receiving a
copy; where fork is unavailable the runs stay in this process.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import operator
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from types import FrameType
from typing import Any, Final, SupportsIndex, TypeVar

from kvtier.base import checked_int
from kvtier.policies import CachePolicy, get_policy_cls
from kvtier.sim.bounds import check_opt_exact, opt_result
from kvtier.sim.replay import (
    HIT_ACTIONS,
    STORE_ON,
    ProgressFn,
    check_device_options,
    make_manager,
    not_defaults,
    policy_label,
    replay_engine,
    replay_flat,
)
from kvtier.sim.result import RunResult
from kvtier.sim.trace import Trace, check_replayable

BOUNDS: Final = {
    "opt": "Belady's optimum: offline, reads the future; an upper bound on block hit ratio",
    "infinite": "a tier that holds every block: the limit of any policy at any capacity",
}
"""Rows the simulator computes besides the registered cache policies."""

MODES: Final = ("flat", "engine")

PolicySpec = str | type[CachePolicy]
"""A run's policy: a registered name, `"opt"`, `"infinite"`, `"package.module:Class"` or a
`CachePolicy` subclass."""


class Terminated(BaseException):
    """SIGTERM reached a multi-process run; its workers have been stopped.

    A `BaseException`, as `KeyboardInterrupt` is, so no `except Exception` takes it for a failed
    replay.
    """


class ReplayError(RuntimeError):
    """A replay that failed; the message names its policy and capacity (or the dead worker).

    Built from a message alone, so it pickles back from a worker unchanged.
    """


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    """How every run of a grid replays the trace."""

    mode: str = "flat"
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    tracker_per_slot: float | None = None
    """If set, the admission tracker holds this many keys per slot instead of a fixed size."""
    device_blocks: int = 0
    store_on: str = "eager"
    hits_as: str | None = None
    """`"touch"` or `"load"`; `None` picks the mode's default (flat: touch, engine: load)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is invalid; expected one of: {MODES}")
        if self.hits_as not in (None, *HIT_ACTIONS):
            raise ValueError(f"hits_as={self.hits_as!r} is invalid; expected one of: {HIT_ACTIONS}")
        # Checked here, once, rather than by every run of a grid (each failing on its own, OPT's
        # with a message that takes a misspelt `store_on` for a valid but unsupported one).
        if self.store_on not in STORE_ON:
            raise ValueError(f"store_on={self.store_on!r} is invalid; expected one of: {STORE_ON}")
        checked_int("store_threshold", self.store_threshold, minimum=0)
        checked_int("device_blocks", self.device_blocks, minimum=0)
        check_device_options(self.mode, self.device_blocks, self.store_on)
        checked_int("max_tracker_size", self.max_tracker_size)
        per_slot = self.tracker_per_slot
        # NaN fails the comparison too; 0 or less would silently become a 1-key tracker.
        if per_slot is not None and (
            isinstance(per_slot, bool) or not isinstance(per_slot, (int, float)) or not per_slot > 0
        ):
            raise ValueError(
                f"tracker_per_slot={per_slot!r} is invalid; expected a number of keys per slot > 0"
            )
        if self.store_threshold < 2:
            # Only reuse admission has a tracker; a bound given without it was ignored, and
            # the row showed no tracker where the caller meant one (the CLI refuses it too).
            given = not_defaults(
                ("max_tracker_size", self.max_tracker_size, 64_000),
                ("tracker_per_slot", per_slot, None),
            )
            if given:
                raise ValueError(
                    f"{' and '.join(given)} has no effect with store_threshold="
                    f"{self.store_threshold}; expected store_threshold=2 or more (reuse "
                    "admission), or the defaults (max_tracker_size=64000, tracker_per_slot=None)"
                )

    @property
    def hit_action(self) -> str:
        """How a CPU hit is recorded: `hits_as`, else the mode's default."""
        return self.hits_as or ("touch" if self.mode == "flat" else "load")


def check_inputs(trace: object, opts: object) -> None:
    """Refuse a trace and options no replay can use, before any replay starts."""
    check_replayable(trace)
    if not isinstance(opts, ReplayOptions):
        raise TypeError(f"opts={opts!r:.80} has type {type(opts).__name__}; expected ReplayOptions")


def check_policy(policy: object, opts: ReplayOptions) -> None:
    """Refuse a policy no replay can run (a misspelt name, opt where it is not exact), so that
    a grid fails before its first replay rather than after all that precede it."""
    if isinstance(policy, str) and policy in BOUNDS:
        if policy == "opt":
            check_opt_exact(opts.mode, opts.store_on)
        return
    get_policy_cls(policy)  # type: ignore[arg-type]  # it names what is wrong with any value


def run_one(
    trace: Trace,
    policy: PolicySpec,
    capacity: int,
    opts: ReplayOptions,
    progress: ProgressFn | None = None,
) -> RunResult:
    """One replay: a registered cache policy, `"opt"`, or `"infinite"` at `capacity` blocks."""
    check_inputs(trace, opts)
    # A plain int: a numpy count reached the row as given (where it outgrew the trace, and
    # always for opt), which json.dump refuses; a float was replayed rounded up as OPT's.
    capacity = _checked_capacity(policy, capacity)
    if policy == "opt":
        result = opt_result(
            trace,
            capacity,
            mode=opts.mode,
            device_blocks=opts.device_blocks,
            store_on=opts.store_on,
        )
        if progress is not None:
            progress(len(trace))
        # OPT counts a hit the same either way; the row reports the setting of its grid.
        result.hits_as = opts.hit_action
        return result
    threshold = opts.store_threshold
    unique = max(1, trace.num_unique_blocks)
    tracked: tuple[int | None, float | None] = (None, None)
    if policy == "infinite":
        # Room for every block, so nothing is ever evicted and the policy is irrelevant; the
        # bound admits everything, whatever the runs' admission.
        capacity = unique
        threshold = 0
        mgr = make_manager("lru", capacity)
    else:
        tracker = opts.max_tracker_size
        if opts.tracker_per_slot is not None:
            # The trace offers at most `unique` keys, so a larger tracker never drops one.
            want = opts.tracker_per_slot * capacity
            tracker = unique if want >= unique else max(1, round(want))
        # Reuse admission, and with it the tracker, starts at threshold 2.
        if threshold >= 2:
            tracked = (tracker, opts.tracker_per_slot)
        # A tier with more slots than the trace has blocks never evicts, so it behaves exactly
        # as one of `unique` slots (and a huge one is not allocated); the row reports `capacity`.
        mgr = make_manager(
            policy, min(capacity, unique), store_threshold=threshold, max_tracker_size=tracker
        )
    if opts.mode == "flat":
        result = replay_flat(
            trace,
            mgr,
            store_threshold=threshold,
            hits_as=opts.hit_action,
            progress=progress,
        )
    else:
        result = replay_engine(
            trace,
            mgr,
            device_blocks=opts.device_blocks,
            store_on=opts.store_on,
            store_threshold=threshold,
            hits_as=opts.hit_action,
            progress=progress,
        )
    # The class itself made rows that JSON, CSV and the table could not write as text.
    result.policy = policy_label(policy)
    result.max_tracker_size, result.tracker_per_slot = tracked
    if capacity > mgr.num_slots:
        result.capacity_blocks = capacity
        n = trace.num_unique_blocks
        result.capacity_frac = capacity / n if n else 0.0
    return result


def run_named(
    trace: Trace,
    policy: PolicySpec,
    capacity: int,
    opts: ReplayOptions,
    progress: ProgressFn | None = None,
) -> RunResult:
    """`run_one`, with any error turned into a `ReplayError` naming the policy and capacity."""
    try:
        return run_one(trace, policy, capacity, opts, progress)
    except Exception as e:
        raise ReplayError(
            f"policy {policy_label(policy)!r} at capacity {_blocks(capacity)} failed: "
            f"{type(e).__name__}: {e}"
        ) from e


def _blocks(capacity: object) -> str:
    """`capacity` for a message: "1,024 blocks", or as given if it is no count of blocks."""
    # `:,` alone printed True as "1 blocks" and raised on a str, hiding the replay's error.
    if isinstance(capacity, SupportsIndex) and not isinstance(capacity, bool):
        with contextlib.suppress(TypeError):
            return f"{operator.index(capacity):,} blocks"
    return repr(capacity)


def _checked_capacity(policy: PolicySpec, capacity: object) -> int:
    """`capacity` as a plain int, else a ValueError naming it and the policy."""
    # "infinite" ignores it (a slot per block) and is given 0 for an empty trace.
    minimum = 0 if policy == "infinite" else 1
    try:
        return checked_int("capacity", capacity, minimum=minimum)
    except ValueError:
        raise ValueError(
            f"capacity={capacity!r} for policy {policy_label(policy)!r} is invalid; expected a "
            f"number of blocks, an integer >= {minimum}"
        ) from None


# The trace workers replay: set before the pool forks so children inherit it without pickling.
_SHARED_TRACE: Trace | None = None

_T = TypeVar("_T")


def _call_shared(fn: Callable[..., _T], args: tuple[Any, ...]) -> _T:
    assert _SHARED_TRACE is not None, "worker started without a trace"
    return fn(_SHARED_TRACE, *args)


def _fork_available() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


def default_jobs() -> int:
    """Worker processes to use: one per CPU this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _worker_init(parent: int) -> None:
    # A terminal's Ctrl-C reaches the whole process group. The parent alone handles it and
    # stops the workers; left alone, each worker would abandon its run for the next queued one
    # and never see the parent leave.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The fork copied the parent's SIGTERM handler, which runs only between bytecodes; the
    # default ends a worker at once, even inside a long C call, as `_stop_workers` expects.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent(parent)


_PR_SET_PDEATHSIG: Final = 1  # from <linux/prctl.h>


def _die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when `parent` dies (Linux only; a no-op elsewhere).

    A parent killed outright (SIGKILL, the OOM killer) cannot stop its workers, which would
    replay on for nobody. The signal is tied to the thread that forked this process, which is
    the one that called `map_trace` (with fork, the executor forks in `submit`).
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    if prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    # A parent that died before the call above is never watched: this process was reparented.
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises `Terminated` here; the previous handler comes back after.

    Without it SIGTERM would end this process at once and leave its workers replaying. Handlers
    can be set only from the main thread; elsewhere the block runs unchanged.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = os.getpid()

    def raise_terminated(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != owner:
            # A worker forked with this handler, before `_worker_init` reset it: die as the
            # default would, rather than raise into the pool's machinery.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Terminated

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        # `None`: a handler not set from Python, which cannot be put back; the default is closest.
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """End `pool` now: cancel the queued calls and terminate the running ones.

    `shutdown` alone would wait for every call already handed to a worker, so a failed run or a
    Ctrl-C would still wait out the rest of the grid.
    """
    # The executor keeps no public handle on its processes (`terminate_workers` is 3.14+).
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for proc in procs:
        proc.terminate()
    pool.shutdown(wait=True, cancel_futures=True)
    for proc in procs:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()


def map_trace(
    trace: Trace,
    fn: Callable[..., _T],
    arg_lists: Sequence[tuple[Any, ...]],
    *,
    jobs: int = 1,
    on_done: Callable[[], None] | None = None,
    forking: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
) -> list[_T] | None:
    """`[fn(trace, *args) for args in arg_lists]` over `jobs` forked processes, in order.

    `fn` must be a module-level function. Returns `None` when the work should stay in this
    process (one job, or no fork on this platform), so the caller can report finer progress.
    The first call to raise ends the others at once and its error is raised here; a worker
    that dies raises `ReplayError`; SIGTERM (in the main thread) ends the workers and raises
    `Terminated`. A worker dies with this process, even one killed outright (Linux). `on_done`
    is called in this thread as each call finishes. `forking()`, if given, is entered around
    the start of the workers: a fork copies only this thread, so any other thread must hold no
    lock there (a progress bar's redraw thread holds rich's and stderr's while it draws), or a
    worker that takes it (a print, a warning) waits for ever.
    """
    # A bool (True ran as one job) or a float is a caller's mistake, not a count.
    jobs = min(checked_int("jobs", jobs), len(arg_lists))
    if jobs <= 1 or not _fork_available():
        return None
    global _SHARED_TRACE
    _SHARED_TRACE = trace
    with _sigterm_raises():
        pool = ProcessPoolExecutor(
            max_workers=jobs,
            mp_context=multiprocessing.get_context("fork"),
            initializer=_worker_init,
            initargs=(os.getpid(),),
        )
        try:
            # With fork, the first submit forks every worker; none is forked later.
            with forking() if forking is not None else contextlib.nullcontext():
                index: dict[Future[_T], int] = {
                    pool.submit(_call_shared, fn, args): i for i, args in enumerate(arg_lists)
                }
            results: list[_T | None] = [None] * len(arg_lists)
            for fut in as_completed(index):
                results[index[fut]] = fut.result()
                if on_done is not None:
                    on_done()
            pool.shutdown()
        except BrokenProcessPool:
            _stop_workers(pool)
            raise ReplayError(
                "a worker process died (killed, or out of memory?); --jobs 1 runs the replays in "
                "this process"
            ) from None
        except BaseException:
            _stop_workers(pool)
            raise
        finally:
            _SHARED_TRACE = None
    return results  # type: ignore[return-value]  # every slot is filled once all are done


def run_grid(
    trace: Trace,
    runs: Sequence[tuple[PolicySpec, int]],
    opts: ReplayOptions,
    *,
    jobs: int = 1,
    progress: ProgressFn | None = None,
    forking: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
) -> list[RunResult]:
    """Replay `trace` once per `(policy, capacity)` in `runs`; results come in `runs` order.

    Each row names its policy as text (`policy_label`), a policy given as a class included.

    With `jobs > 1` the runs are spread over forked worker processes and `progress` hears of
    each run when it finishes; otherwise it hears of requests as they are replayed. A run that
    raises ends the grid with a `ReplayError` naming it. Before any run starts, ValueError
    refuses a capacity that is not an int of blocks (a bool, a float), a policy that is not
    registered (or `"opt"` with stores on device eviction) and a trace with no blocks, and
    TypeError a trace that is no `Trace` and options that are no `ReplayOptions`. `forking` is
    as in `map_trace`.
    """
    check_inputs(trace, opts)
    if isinstance(runs, str):
        raise ValueError(f"runs={runs!r:.80} is invalid; expected (policy, capacity) pairs")
    for i, run in enumerate(runs):
        if not (isinstance(run, tuple | list) and len(run) == 2):
            raise ValueError(
                f"runs[{i}]={run!r:.80} is invalid; expected a (policy, capacity) pair"
            )
    for p, c in runs:
        check_policy(p, opts)
        _checked_capacity(p, c)
    if any(p != "opt" for p, _ in runs):
        # Every replay but OPT's uses each request's context; built here, before the fork,
        # the workers share one copy instead of each building its own.
        for req in trace.requests:
            _ = req.ctx
    on_done = (lambda: progress(len(trace))) if progress is not None else None
    arg_lists = [(p, c, opts) for p, c in runs]
    results = map_trace(trace, run_named, arg_lists, jobs=jobs, on_done=on_done, forking=forking)
    if results is None:
        results = [run_named(trace, p, c, opts, progress) for p, c in runs]
    return results
