"""The transfer worker interface and the bookkeeping every backend shares.

A worker moves the bytes of jobs between the registered device KV tensors and the host pool,
asynchronously. Contract (DESIGN §2): `submit_*` validates and queues, never waits for a copy;
jobs of one lane (stores, loads, urgent loads) complete in submission order; a job whose copy
raised is reported `success=False`, never as done; each job is reported exactly once by
`get_finished`.

A `submit_*` that raises has queued nothing, except that an interrupt (KeyboardInterrupt, or
any BaseException a signal handler raises) can arrive as the engine's call returns, after the
job was queued; `holds(job_id)` then says which. Every submit path records a job before it
hands it to its engine, and on a BaseException asks the engine whether it took the job, and
keeps or drops the records accordingly.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, NoReturn, Self, SupportsIndex, TypeVar, cast

import numpy as np
import numpy.typing as npt

from kvtier.base import TransferResult, checked_int
from kvtier.transfer.host_pool import HostPool, not_copyable
from kvtier.transfer.plan import Direction, IdsLike, Job, JobPlanner, bool_among
from kvtier.transfer.registration import KVCacheRegistration

_T = TypeVar("_T")

FaultInjector = Callable[[int, str], object]
"""Test hook called as `f(job_id, "store" | "load")` just before a job's copies; raising fails
that job the same way a failed copy would. What it returns is ignored (so
`lambda j, d: gate.wait(5)` will do)."""


class SubmitCall(NamedTuple):
    """A submit call's arguments, for workers that plan jobs in compiled code."""

    job_id: int
    direction: Direction
    device_blocks: IdsLike
    slots: IdsLike
    group: int
    skip: int
    urgent: bool


def on_host(values: _T) -> _T:
    """`values`, or a host copy of it where it is a tensor in device memory: numpy cannot read
    one (torch's TypeError said to call `.cpu()`), and as `wait`'s ids it was copied one id,
    and one device sync, at a time."""
    if getattr(values, "is_cpu", True):  # anything but a torch tensor off the CPU
        return values
    return cast(_T, cast(Any, values).cpu())


def _int_ids(values: IdsLike) -> npt.NDArray[np.integer] | None:
    """`values` as a 1-D integer array, or None where the planner must judge it."""
    arr = np.asarray(on_host(values))
    if arr.ndim != 1:
        return None
    if arr.dtype.kind not in "iu":
        return _EMPTY if arr.size == 0 else None  # `[]` arrives as float64
    if bool_among(values):
        return None  # the planner refuses it by name
    return arr


def check_fault_injector(injector: object) -> None:
    """Refuse an injector that cannot be called: each job would call it, and fail."""
    if injector is not None and not callable(injector):
        raise ValueError(f"fault_injector={injector!r} must be a callable or None")


def check_registration(registration: object) -> None:
    """Refuse a registration of the wrong type by name (a list of `KVTensor`s, say): it died
    on a missing attribute."""
    if not isinstance(registration, KVCacheRegistration):
        raise TypeError(
            f"registration must be a KVCacheRegistration, got {type(registration).__name__}"
        )


def check_pool(registration: KVCacheRegistration, pool: HostPool) -> None:
    """Refuse a registration or pool of the wrong type, and a host pool built for another
    registration (its slots have another layout) or inherited across a fork."""
    check_registration(registration)
    if not isinstance(pool, HostPool):  # every worker: it died on a missing attribute
        raise TypeError(f"pool must be a HostPool, got {type(pool).__name__}")
    if pool.registration is not registration:
        raise ValueError(
            "pool was built for a different KVCacheRegistration; expected a HostPool built "
            "for this worker's registration"
        )
    if pool.forked:
        raise RuntimeError(
            "this pinned host pool was created before the process forked and its memory is "
            "not mapped here; create a HostPool in this process"
        )
    if pool.closed:
        # Its workers are refused its closing (`HostPool.close`); a later one copied into it.
        raise ValueError("this host pool is closed; expected an open HostPool (create a new one)")


_EMPTY = np.empty(0, dtype=np.int64)
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def as_int(name: str, value: object) -> int:
    """`value`, an integer of another type than int (numpy's, a 0-d integer tensor), as an
    int; a bool, a float or anything else is a ValueError naming it. The compiled submit paths
    read only exact ints, and the planner's checks take only ints, as do the ids' records."""
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    try:
        return checked_int(name, value, _INT64_MIN)  # no numpy or torch integer is below it
    except ValueError:
        raise ValueError(f"{name}={value!r} must be an int") from None


def job_result(job_id: int, ok: bool, nbytes: int, seconds: float) -> TransferResult:
    """A finished job's result. A failed one reports no bytes and no time: its copies may have
    stopped part-way, and a GPU's events may not time them. A time below 0 (a batch timed
    from a stale start event) is reported as none."""
    if not ok:
        return TransferResult(job_id, False, 0, 0.0)
    return TransferResult(job_id, True, nbytes, max(float(seconds), 0.0))


def job_ids_of(job_ids: Iterable[object]) -> list[int]:
    """`wait`'s ids as ints, numpy's and torch's too: a tensor hashes by identity, so as it is
    it would match no job and `wait` would return before the job ran."""
    if isinstance(job_ids, (str, bytes)) or not isinstance(job_ids, Iterable):
        # "12" was read as ids "1" and "2" (the error named '1'), 5 failed on a bare "'int'
        # object is not iterable".
        raise TypeError(
            f"job_ids={job_ids!r:.80} is a {type(job_ids).__name__}; expected an iterable of "
            "int job ids (e.g. [5], not 5)"
        )
    return [j if type(j) is int else as_int("job id", j) for j in on_host(job_ids)]


class IdStaging:
    """One reusable int64 buffer that a submit's ids are copied into before compiled code
    reads them: its address is known, where asking numpy for the address of each caller's
    array costs about a microsecond apiece."""

    def __init__(self) -> None:
        self._grow(1024)

    def _grow(self, n: int) -> None:
        self.buf = np.empty(n, dtype=np.int64)
        self.address = int(self.buf.ctypes.data)

    def put(self, a: npt.NDArray[np.integer], b: npt.NDArray[np.integer]) -> tuple[int, int]:
        """Copy `a` then `b` in (ints of any width, cast to int64); their addresses."""
        na, nb = int(a.shape[0]), int(b.shape[0])
        if na + nb > self.buf.shape[0]:
            self._grow(1 << (na + nb - 1).bit_length())
        self.buf[:na] = a
        self.buf[na : na + nb] = b
        return self.address, self.address + 8 * na


def shutdown_at_exit(worker: TransferWorker) -> Callable[[], None]:
    """Have `worker.shutdown()` run at interpreter exit if the worker is still alive then;
    returns the registered hook, for `atexit.unregister`. A copy still running while the
    interpreter tears torch down aborts the process ("terminate called without an active
    exception"). The hook holds the worker weakly, and goes when the worker is collected:
    registering `worker.shutdown` itself kept every worker, its thread and its memory alive
    until exit."""

    def hook() -> None:
        alive = ref()
        if alive is not None:
            alive.shutdown()

    unregister = atexit.unregister  # bound now: a late collection may find module globals gone
    ref = weakref.ref(worker, lambda _: unregister(hook))
    atexit.register(hook)
    return hook


_live_workers: weakref.WeakSet[TransferWorker] = weakref.WeakSet()
"""Every worker not yet collected, for `_forked_child`."""

FORKED = (
    "this transfer worker was created before the process forked: its copy threads are in "
    "the parent, and here nothing would ever copy or report a job; create a worker in this "
    "process"
)


def _forked_child() -> None:
    """In a forked child: mark every worker inherited from the parent. Its copy threads did
    not come along: a job submitted there was queued and never run, and `wait` for it hung."""
    for worker in list(_live_workers):
        worker._forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked_child)


class TransferWorker(ABC):
    """Moves bytes between device blocks and host slots; see the module docstring."""

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        # Pickle, copy and deepcopy refused for every backend: a copy.copy shared the worker's
        # queues, engine handle or streams, which the original's collection then stopped or
        # freed under it (a CPU copy's jobs were never reported; a compiled copy read freed
        # memory).
        raise not_copyable(self)

    def __init__(
        self,
        registration: KVCacheRegistration,
        pool: HostPool,
        fault_injector: FaultInjector | None = None,
    ) -> None:
        check_pool(registration, pool)
        check_fault_injector(fault_injector)
        self.registration = registration
        self.pool = pool
        self.blocks_per_chunk = pool.blocks_per_chunk
        self._fault_injector = fault_injector
        self._planner = JobPlanner(
            registration.num_blocks,
            pool.num_slots,
            pool.blocks_per_chunk,
            {g: registration.page_bytes(g) for g in registration.groups},
        )
        self._lock: threading.Lock | threading.RLock = threading.Lock()
        """Guards the records below and the backend's; `CPUTransferWorker` swaps in an RLock."""
        self._unreported: set[int] = set()
        """Ids submitted and not yet returned by get_finished (duplicates are refused)."""
        self._ready: list[TransferResult] = []
        """Results taken from the backend and not yet returned by get_finished (an interrupt
        cut that call short); `_ready_ids` holds their ids."""
        self._ready_ids: set[int] = set()
        self._closed = False
        self._forked = False
        """Inherited by a forked child (`_forked_child`): submits and waits raise there."""
        _live_workers.add(self)

    def submit_store(
        self, job_id: int, device_blocks: IdsLike, slots: IdsLike, group: int = 0
    ) -> None:
        """Queue a copy of whole chunks: `device_blocks` (`len(slots) * blocks_per_chunk` of
        them, in chunk order) into `slots`. On CUDA it runs after the compute queued so far."""
        if self._forked:
            raise RuntimeError(FORKED)
        if type(job_id) is not int:
            job_id = as_int("job_id", job_id)
        if type(group) is not int:
            group = self._as_group(group)
        if self._plans_ids():
            self._submit_ids(job_id, Direction.STORE, device_blocks, slots, group, 0, False)
            return
        with self._lock:
            self._check_job_id(job_id)
            job = self._planner.store(job_id, on_host(device_blocks), on_host(slots), group)
            self._queue(job)

    def submit_load(
        self,
        job_id: int,
        slots: IdsLike,
        device_blocks: IdsLike,
        group: int = 0,
        skip_blocks: int = 0,
        urgent: bool = False,
    ) -> None:
        """Queue a copy of the blocks of `slots`' chunks, in order from `skip_blocks` of the first
        chunk, into `device_blocks`; the last chunk may be used partially. `urgent` loads run in
        their own lane and do not wait behind queued loads."""
        if self._forked:
            raise RuntimeError(FORKED)
        if type(job_id) is not int:
            job_id = as_int("job_id", job_id)
        if type(group) is not int:
            group = self._as_group(group)
        if type(skip_blocks) is not int:
            skip_blocks = as_int("skip_blocks", skip_blocks)
        if urgent is not False and urgent is not True:
            if not isinstance(urgent, (bool, np.bool_)):
                raise ValueError(f"urgent={urgent!r} must be a bool")
            urgent = bool(urgent)
        if self._plans_ids():
            self._submit_ids(
                job_id, Direction.LOAD, device_blocks, slots, group, skip_blocks, urgent
            )
            return
        with self._lock:
            self._check_job_id(job_id)
            job = self._planner.load(
                job_id, on_host(slots), on_host(device_blocks), group, skip_blocks, urgent
            )
            self._queue(job)

    def get_finished(self) -> list[TransferResult]:
        """Results of jobs finished since the last call, each lane in submission order.

        An interrupt (KeyboardInterrupt) during the call loses no result: the ones it took
        from the backend wait for the next call, their jobs still held."""
        fresh: list[TransferResult] = []
        fresh_ids: set[int] = set()
        with self._lock:
            self._take_finished()
        # Handed over in steps with no call and no loop, where CPython never raises an
        # interrupt (it does as a function starts, after a call returns, at a loop's back
        # edge) nor switches threads: the results are returned, or they stay for the next
        # call. After the lock is released, because its release is a call.
        results, ids = self._ready, self._ready_ids
        self._ready, self._ready_ids = fresh, fresh_ids
        self._unreported -= ids
        return results

    def holds(self, job_id: int) -> bool:
        """Whether `job_id` is queued, running, or finished and not yet returned by
        `get_finished`: it will be reported. After a `submit_*` that raised, False means that
        nothing was queued (see the module docstring)."""
        if type(job_id) is not int:
            job_id = as_int("job_id", job_id)
        with self._lock:
            return job_id in self._unreported

    @abstractmethod
    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until every job in `job_ids` has finished (ids not in flight are ignored).
        Results stay queued for `get_finished`."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop: jobs not started are reported failed, started ones finish; idempotent."""

    @abstractmethod
    def _submit(self, job: Job) -> None:
        """Start or queue a validated job (called with the lock held)."""

    @abstractmethod
    def _accepted(self, job_id: int) -> bool:
        """Whether this backend's records hold `job_id` (called with the lock held, after
        `_submit` raised). `_submit` leaves a job fully recorded or not at all: on a
        BaseException it keeps the records of a job its engine took, and drops the rest."""

    def _pool_jobs(self) -> list[int] | None:
        """For `HostPool.close` (`host_pool.PoolUser`): None once this worker will never again
        copy to or from its pool, else the ids of its jobs whose copies may still run."""
        if self._forked:
            return None  # a forked child's copy: the copies, if any, are the parent's
        with self._lock:
            copying = sorted(self._copying())
            closed = self._closed
        return None if closed and not copying else copying

    def _copying(self) -> Iterable[int]:
        """Ids of the jobs whose copies may still run: queued, running, or not known to have
        ended (called with the lock held, by `HostPool.close` only)."""
        raise NotImplementedError

    def _collect(self) -> list[TransferResult]:
        """Take the finished results (called with the lock held), for `_take_finished`'s
        default. An interrupt as it returns loses them: backends that can, override
        `_take_finished` instead."""
        raise NotImplementedError

    def _take_finished(self) -> None:
        """Move the finished results from the backend into `_ready`, and their ids into
        `_ready_ids` (called with the lock held). An interrupt at any point must leave each
        result either in the backend or in both, never in one only, and never in neither."""
        taken = self._collect()
        ids = {r.job_id for r in taken}
        self._ready += taken  # these two steps have no call between them
        self._ready_ids |= ids

    def _queue(self, job: Job) -> None:
        """`_submit` a planned job and count it unreported (called with the lock held). Counted
        first, inside the `try`: an interrupt may come between any two steps, the last one
        after `_submit` queued the job."""
        try:
            self._unreported.add(job.job_id)
            self._submit(job)
        except BaseException:
            if not self._accepted(job.job_id):
                self._unreported.discard(job.job_id)
            raise

    def _plans_ids(self) -> bool:
        """Whether `submit_*` hand the call to `_submit_ids` (compiled planning) instead of
        planning it here."""
        return False

    def _submit_ids(
        self, job_id: int, direction: Direction, device_blocks: IdsLike, slots: IdsLike,
        group: int, skip: int, urgent: bool,
    ) -> None:  # fmt: skip
        """Validate, plan and queue a call in compiled code; see `_plans_ids`. The arguments
        come one by one: building a `SubmitCall` costs 0.3 µs, wanted only on a fallback."""
        raise NotImplementedError

    def _plain_ids(
        self, device_blocks: IdsLike, slots: IdsLike, group: int, skip: int
    ) -> tuple[npt.NDArray[np.integer], npt.NDArray[np.integer], int] | None:
        """A call's device blocks and slots as 1-D integer arrays and its group's page size,
        for compiled code to validate; None where only the planner can judge the call."""
        dev, sl = _int_ids(device_blocks), _int_ids(slots)
        page = self._planner.page_bytes.get(group)
        if dev is None or sl is None or page is None:
            return None
        if (
            isinstance(skip, bool)
            or not isinstance(skip, int)
            or not 0 <= skip < self.blocks_per_chunk
        ):
            return None  # out of range: ctypes would wrap 2**64 to 0, the planner explains it
        return dev, sl, page

    def _plan_and_submit(self, c: SubmitCall) -> None:
        """Plan a call in Python and submit it (called with the lock held): the path of calls
        that compiled planning refused or cannot take, whose errors the planner explains."""
        dev, slots = on_host(c.device_blocks), on_host(c.slots)
        if c.direction is Direction.STORE:
            job = self._planner.store(c.job_id, dev, slots, c.group)
        else:
            job = self._planner.load(c.job_id, slots, dev, c.group, c.skip, c.urgent)
        self._queue(job)

    def _as_group(self, group: object) -> int:
        """`group` of another integer type (numpy's, a 0-d integer tensor) as an int. Anything
        else is a ValueError here: the lookups behind would take 0.0 or True for a group, or
        raise TypeError."""
        try:
            return as_int("group", group)
        except ValueError:
            groups = list(self._planner.page_bytes)
            raise ValueError(f"group={group!r} must be an int; groups are {groups}") from None

    def _check_job_id(self, job_id: int) -> None:
        if self._closed:
            raise RuntimeError("the transfer worker is shut down")
        if isinstance(job_id, bool) or not isinstance(job_id, int):
            raise ValueError(f"job_id={job_id!r} must be an int")
        if not _INT64_MIN <= job_id <= _INT64_MAX:
            # Compiled code carries ids as int64; ctypes would truncate one silently.
            raise ValueError(f"job_id={job_id} does not fit in 64 bits (signed)")
        if job_id in self._unreported:
            raise ValueError(f"job_id={job_id} is already in flight or not yet reported")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
