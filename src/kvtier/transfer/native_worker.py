"""The CPU backend with its copy thread in C: copies never wait for the GIL.

`CPUTransferWorker` copies on a Python thread. Between two jobs that thread needs the GIL,
so while another thread holds it (an engine's step loop, a burst of submits) no job starts:
on the 2-core machine of docs/benchmarks.md a burst of 64 one-MiB jobs spent its whole
submission time, about a third of the total, copying nothing. Here the thread is
`copyengine.c`'s, and a submit's validation and row maths run in C too
(`kvt_engine_submit_ids`): Python converts the ids, hands them over with the group's segment
table, and polls results. Arguments the C side refuses go to the planner (`plan.py`), whose
`ValueError` says what is wrong, as on every backend.

`make_transfer_worker(..., "cpu")` returns this worker wherever the compiled library is
available (`native.library()`), and `CPUTransferWorker` elsewhere; both keep the same
contract, and the same tests run against both.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from numbers import Integral

import numpy as np
import numpy.typing as npt
import torch

from kvtier.transfer.cpu_worker import DEFAULT_STAGE_BYTES, CPUTransferWorker
from kvtier.transfer.host_pool import HostPool
from kvtier.transfer.native import (
    EXT_REFUSED,
    EXT_STOPPED,
    BeforeHook,
    EngineResult,
    library,
    segment_tables,
    submit_contexts,
    submit_extension,
)
from kvtier.transfer.plan import Direction, IdsLike, Job
from kvtier.transfer.registration import KVCacheRegistration
from kvtier.transfer.worker import (
    FORKED,
    FaultInjector,
    IdStaging,
    SubmitCall,
    TransferWorker,
    as_int,
    job_ids_of,
    job_result,
    shutdown_at_exit,
)

logger = logging.getLogger(__name__)

MAX_DEFAULT_COPY_THREADS = 8
"""The compromise measured on a 16-core host (docs/bench/transfer.md): 16 threads copied
8 MiB+ jobs faster than 8 but 1 MiB jobs slower (then, when every helper was woken per job);
set `copy_threads` for a machine whose jobs are known to be large."""

MAX_COPY_THREADS = 1024
"""A bound that no machine's memory bandwidth needs more threads than, and that keeps the value
within the C int it is passed as."""

_POLL = 256
"""Results fetched per engine call."""

_WAIT_SLICE_NS = 50_000_000
"""`wait` blocks in the engine this long at a time, then returns to Python, which raises a
pending Ctrl-C (KeyboardInterrupt) only there: in one call, it waited until the job ended."""


@dataclass(slots=True)
class _Live:
    """A submitted job whose result has not been collected."""

    lane: int
    seq: int
    nbytes: int
    direction: str
    rows: tuple[npt.NDArray[np.int64], ...] = ()
    """Row arrays the engine reads, for jobs queued from a planned `Job` (kept alive)."""


def _check_cpus(cpus: Sequence[int] | None) -> list[int]:
    """`copy_cpus` as a sorted list of distinct CPUs ([] for None); ValueError if it names
    no CPU, or one that is not an int or not on this machine. (CPUs outside the process's
    cpuset are refused when the threads start.)"""
    if cpus is None:
        return []
    if not hasattr(os, "sched_getaffinity"):
        raise ValueError(f"copy_cpus={cpus!r}: thread affinity is only supported on Linux")
    if isinstance(cpus, (str, bytes)) or not isinstance(cpus, Iterable):
        raise ValueError(f"copy_cpus={cpus!r} must be a list of CPU numbers")
    picked = list(cpus)
    if not picked or any(isinstance(c, bool) or not isinstance(c, Integral) for c in picked):
        raise ValueError(f"copy_cpus={cpus!r} must be a non-empty list of CPU numbers")
    picked = [int(c) for c in picked]  # numpy integers too
    possible = _possible_cpus()
    bad = sorted(c for c in set(picked) if c not in possible)
    if bad:
        raise ValueError(
            f"copy_cpus={cpus!r}: no CPU {bad}; this machine's CPUs are {_ranges(possible)}"
        )
    return sorted(set(picked))


# cpu_set_t's size: copyengine.c cannot name a CPU at or above it.
_CPU_SETSIZE = 1024


def _possible_cpus(path: str = "/sys/devices/system/cpu/possible") -> set[int]:
    """The CPU numbers this machine can have: the kernel's list, which keeps the gaps that
    offline or absent CPUs leave (os.cpu_count() counts them, it does not number them)."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
        cpus: set[int] = set()
        for part in text.split(","):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except (OSError, ValueError):
        cpus = set(range(os.cpu_count() or 1))
    return {c for c in cpus if c < _CPU_SETSIZE}


def _ranges(cpus: set[int]) -> str:
    """{0, 1, 2, 5} as "0-2,5"."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _pointers(
    tables: dict[int, tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]],
) -> dict[int, tuple[tuple[int, int], tuple[int, int]]]:
    """Per group, (address, rows) of the store and load tables: `.ctypes` costs µs per job."""
    return {
        g: tuple((int(t.ctypes.data), int(t.shape[0])) for t in pair)  # type: ignore[misc]
        for g, pair in tables.items()
    }


def _hook(
    ref: weakref.ReferenceType[NativeCPUTransferWorker], engine_thread: list[int]
) -> ctypes._CFunctionType:
    # Through a weak reference: the finalizer keeps the hook alive, and a hook holding the
    # worker would keep the worker alive forever.
    def before(job_id: int) -> int:
        engine_thread[0] = threading.get_ident()
        engine_thread[1] = 1
        try:
            worker = ref()
            return 1 if worker is None else worker._before(job_id)
        finally:
            # Whether it is in the hook, for wait(): a thread id is reused once its thread has
            # ended, and a thread started after shutdown() was taken for the engine's. The id
            # stays for `_release`: the worker's last reference may go after this line.
            engine_thread[1] = 0

    return BeforeHook(before)


def _release(
    lib: ctypes.CDLL,
    handle: int,
    hook: object,
    engine_thread: list[int],
    keep: object,
) -> None:
    """The finalizer: stop the engine and free it. `keep` is what the engine's copies read."""
    if engine_thread[0] == threading.get_ident():
        # Collected on the engine's thread, inside the hook (which held the last reference,
        # or ran the cyclic collector): the thread cannot join itself, and the engine must
        # outlive it. Another thread stops and frees it, keeping alive what the job after
        # the hook copies; not a daemon, so that exit waits for it.
        args = (lib, handle, hook, [0], keep)
        threading.Thread(target=_release, args=args, name="kvtier-release", daemon=False).start()
        return
    del hook, keep  # kept alive until here: the engine's thread may use them until it is joined
    lib.kvt_engine_free(handle)


class NativeCPUTransferWorker(TransferWorker):
    """CPU transfer worker whose copy thread is compiled code (see the module docstring).

    One thread runs jobs in submission order, urgent loads first, like `CPUTransferWorker`.
    A large job is split by rows into slices of at least 256 KiB, copied by that thread and
    up to `copy_threads - 1` helpers (default: torch's thread count, at most
    `MAX_DEFAULT_COPY_THREADS`, and at most `len(copy_cpus)` where given); large means
    512 KiB where the machine has a core beyond the copy threads, else 2 MiB.

    `copy_cpus` (Linux) confines the copy threads to those CPUs, which should be cores the
    engine's own threads leave free. Left to itself, the kernel tends to wake a sleeping copy
    thread on the CPU of the thread that submitted the job, where it waits until the
    submitter sleeps. On the 2-core machine of docs/bench/transfer.md, with `copy_cpus=[1]`
    (and the submitting thread on CPU 0) 64 KiB pages in 1 MiB jobs loaded at 84% of the copy
    ceiling against 80% unpinned, and single 256 KiB blocks at 95% against 77%.

    Without `copy_cpus`, `avoid_submitter_cpu` (Linux, default on) keeps the engine's thread
    off the CPU of the latest submit for the jobs it copies alone, and lets it anywhere for
    jobs split over the helpers; its affinity changes only when that CPU or the kind of job
    does. On the 2-core machine single 64 KiB blocks went from 66 / 68% of the copy ceiling
    (load / store) to 83 / 88% with it (docs/bench/transfer.md); a split job is unaffected.

    `share_backlog` (default on; needs `copy_threads` of 2 or more): while a thread waits in
    `wait()`, the jobs it waits for that are queued behind the running one, small ones of one
    group and direction, are copied together by every copy thread, in slices of whole jobs,
    and reported together, in order. The waiting thread's CPU is free then; while submits
    run, a second copy thread would compete with them (the reason small jobs are not split).
    Jobs that write the same row are copied one after the other. `shared_jobs` counts the
    jobs copied so.

    Where the copy threads may use two CPUs or more (within `copy_cpus` where given), the
    helpers are kept off the engine's thread's CPU before they are woken for a split job or a
    shared batch (Linux): woken there by the kernel, they took turns with it.

    `stage_bytes` is accepted for compatibility and unused: rows are copied directly.
    Raises RuntimeError if the compiled library is unavailable, ValueError for a bad
    `copy_threads`, `copy_cpus`, `avoid_submitter_cpu` or `share_backlog`.
    """

    def __init__(
        self,
        registration: KVCacheRegistration,
        pool: HostPool,
        *,
        stage_bytes: int = DEFAULT_STAGE_BYTES,
        fault_injector: FaultInjector | None = None,
        copy_threads: int | None = None,
        copy_cpus: Sequence[int] | None = None,
        avoid_submitter_cpu: bool = True,
        share_backlog: bool = True,
    ) -> None:
        cpus = _check_cpus(copy_cpus)
        for name, flag in (
            ("avoid_submitter_cpu", avoid_submitter_cpu),
            ("share_backlog", share_backlog),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"{name}={flag!r} must be a bool")
        if copy_threads is None:
            copy_threads = min(max(1, torch.get_num_threads()), MAX_DEFAULT_COPY_THREADS)
            if cpus:
                copy_threads = min(copy_threads, len(cpus))
        threads = copy_threads
        if type(threads) is not int:
            with contextlib.suppress(ValueError):  # refused below, with the range
                threads = as_int("copy_threads", threads)  # numpy's too
        if (
            isinstance(threads, bool)
            or not isinstance(threads, int)
            or not 1 <= threads <= MAX_COPY_THREADS
        ):
            raise ValueError(
                f"copy_threads={copy_threads!r} must be an int from 1 to {MAX_COPY_THREADS}"
            )
        copy_threads = threads
        CPUTransferWorker._check_device(registration)
        super().__init__(registration, pool, fault_injector)
        del stage_bytes
        lib = library()
        if lib is None:
            raise RuntimeError(
                "the compiled copy engine is unavailable (KVTIER_NATIVE_COPY=0, no C compiler, "
                "or the build failed: see the INFO log); use CPUTransferWorker"
            )
        self._lib = lib
        # Kept alive: the engine reads them.
        self._tables = segment_tables(registration, pool.address, pool.row_bytes)
        self._table_ptrs = _pointers(self._tables)
        self._ctx_keep, self._contexts = submit_contexts(self._tables, self._planner)
        self._live: dict[int, _Live] = {}
        self._next_seq = [1, 1]
        self._engine_ident = [0, 0]
        """The engine's thread's id once the hook has run on it (0 before), which `_release`
        reads, and 1 while it runs the hook (the only Python it runs), else 0."""
        self._poll_buffer = (EngineResult * _POLL)()
        self._staging = IdStaging()  # used under self._lock
        # The submit call without ctypes, where the extension builds (native.py).
        ext = submit_extension()
        self._ext_submit = ext.submit if ext is not None else None
        self._submit_fn = ctypes.cast(lib.kvt_engine_submit_ids, ctypes.c_void_p).value
        # A null hook pointer when there is no injector: the engine then never calls Python.
        self._hook = (
            _hook(weakref.ref(self), self._engine_ident)
            if fault_injector is not None
            else BeforeHook()
        )
        # With a core to spare for the submitting thread, 512 KiB jobs gain from a split;
        # without one, the copy threads and a burst of submits share the cores, and on the
        # 2-core machine splitting jobs under 2 MiB made them slower.
        if cpus:
            spare = copy_threads < len(cpus) or len(cpus) < (os.cpu_count() or 1)
        else:
            spare = copy_threads < (os.cpu_count() or 1)
        min_split = (512 << 10) if spare else (2 << 20)
        cpu_array = (ctypes.c_int32 * max(1, len(cpus)))(*cpus)
        handle = lib.kvt_engine_new(
            self._hook, copy_threads, min_split, cpu_array, len(cpus), avoid_submitter_cpu
        )
        if not handle:
            if cpus:
                raise ValueError(f"copy_cpus={copy_cpus!r}: the system refused threads there")
            raise RuntimeError("could not start the copy engine's threads")
        self._engine: int = handle
        if not share_backlog:
            lib.kvt_engine_share_backlog(handle, 0)
        self.share_backlog = share_backlog and copy_threads > 1
        """Whether a waiter's backlog of small jobs is copied by every copy thread."""
        self.copy_cpus: tuple[int, ...] | None = tuple(cpus) or None
        """The CPUs the copy threads are confined to (None: wherever the kernel puts them)."""
        self.avoid_submitter_cpu = avoid_submitter_cpu and not cpus
        """Whether the engine's thread keeps off the submitting thread's CPU (not with
        `copy_cpus`; Linux, where the process may use two CPUs or more)."""
        # The engine's thread may call the fault injector: stop it before the interpreter goes.
        self._at_exit = shutdown_at_exit(self)
        keep = (self._tables, self._ctx_keep, self._live, pool, registration)
        self._finalizer = weakref.finalize(
            self, _release, lib, handle, self._hook, self._engine_ident, keep
        )
        # Not freed at exit: the hook above stops the threads, and an exit handler or daemon
        # thread that polls or waits after the free (legal after shutdown) read freed memory.
        self._finalizer.atexit = False
        pool._add_user(self)  # last: a worker that failed to build never held the pool

    @property
    def shared_jobs(self) -> int:
        """Jobs copied so far in a waiter's backlog shared over the copy threads."""
        return int(self._lib.kvt_engine_shared_jobs(self._engine))

    @property
    def _engine_thread(self) -> int | None:
        """The engine's thread's id while it runs the fault injector, else None."""
        ident, in_hook = self._engine_ident
        return ident if in_hook else None

    def _before(self, job_id: int) -> int:
        """The engine's hook: run the fault injector; an exception fails the job."""
        live = self._live.get(job_id)
        try:
            assert self._fault_injector is not None
            self._fault_injector(job_id, live.direction if live else "unknown")
        except BaseException:
            # Not only Exception: ctypes would swallow anything else and return garbage, and
            # the job might be reported done.
            logger.exception("transfer job %d failed", job_id)
            return 1
        return 0

    def _plans_ids(self) -> bool:
        return True

    def _submit_ids(
        self, job_id: int, direction: Direction, device_blocks: IdsLike, slots: IdsLike,
        group: int, skip: int, urgent: bool,
    ) -> None:  # fmt: skip
        """Queue a job whose validation and row maths run in C, without a `Job`: at 64 KiB
        pages the Python side of a submit held a burst of 1 MiB jobs to 76-79% of the copy
        ceiling, against 91-94% with no planning at all (docs/bench/transfer.md). The ids go
        to C through the extension where it is built, else through ctypes (`_submit_staged`).
        Arguments the C side refuses go through the planner, which raises with its usual
        message."""
        submit = self._ext_submit
        contexts = self._contexts.get(group)
        store = direction is Direction.STORE
        if submit is None or contexts is None:
            self._submit_staged(job_id, direction, device_blocks, slots, group, skip, urgent)
            return
        with self._lock:
            self._check_job_id(job_id)
            lane = 1 if urgent else 0
            # Taken for good before the call: should the call be cut short, a seq the engine
            # never saw is a harmless gap (copyengine.c only compares them), where one used
            # twice would let a wait for the second job return once the first is done.
            seq = self._next_seq[lane]
            self._next_seq[lane] = seq + 1
            try:
                # Recorded first: the engine may run the job (and its hook) before submit
                # returns, and an interrupt may come as it returns.
                live = self._live[job_id] = _Live(lane, seq, 0, direction.value)
                self._unreported.add(job_id)
                n = submit(
                    self._submit_fn, self._engine, contexts[0 if store else 1], job_id, lane,
                    seq, device_blocks, slots, skip,
                )  # fmt: skip
                if n >= 0:
                    live.nbytes = n * self._planner.page_bytes[group]  # read under the lock only
                    return
            except BaseException:
                if self._kept(job_id, lane, seq):  # queued: the ids were read, len() works
                    page = self._planner.page_bytes[group]
                    self._live[job_id].nbytes = len(device_blocks) * page
                raise
            # Refused. Undone without a call into Python, where an interrupt could come first.
            del self._live[job_id]
            self._unreported.discard(job_id)
            if n == EXT_STOPPED:
                raise RuntimeError(f"the copy engine refused job {job_id} (stopped or no memory)")
            if n == EXT_REFUSED:
                call = SubmitCall(job_id, direction, device_blocks, slots, group, skip, urgent)
                self._plan_and_submit(call)  # raises, saying why (or runs what C was stricter on)
                return
        # Ids the extension does not read (numpy scalars, strided arrays): numpy converts them.
        self._submit_staged(job_id, direction, device_blocks, slots, group, skip, urgent)

    def _submit_staged(
        self, job_id: int, direction: Direction, device_blocks: IdsLike, slots: IdsLike,
        group: int, skip: int, urgent: bool,
    ) -> None:  # fmt: skip
        """`_submit_ids` through ctypes: the ids are converted with numpy and copied into one
        staging buffer whose address is known."""
        store = direction is Direction.STORE
        ids = self._plain_ids(device_blocks, slots, group, skip)
        with self._lock:
            self._check_job_id(job_id)
            if ids is not None:
                dev, sl, page = ids
                lane = 1 if urgent else 0
                seq = self._next_seq[lane]
                self._next_seq[lane] = seq + 1  # before the call, as in `_submit_ids`
                try:
                    # Recorded first, as in `_submit_ids`.
                    nbytes = int(dev.shape[0]) * page
                    self._live[job_id] = _Live(lane, seq, nbytes, direction.value)
                    self._unreported.add(job_id)
                    dev_at, sl_at = self._staging.put(dev, sl)
                    rc = self._lib.kvt_engine_submit_ids(
                        self._engine, self._contexts[group][0 if store else 1], job_id, lane,
                        seq, dev_at, dev.shape[0], sl_at, sl.shape[0], skip,
                    )  # fmt: skip
                    if rc == 0:
                        return
                except BaseException:
                    self._kept(job_id, lane, seq)
                    raise
                del self._live[job_id]  # refused: undone as in `_submit_ids`
                self._unreported.discard(job_id)
                if rc < 0:
                    raise RuntimeError(
                        f"the copy engine refused job {job_id} (stopped or no memory)"
                    )
            # The planner's path: it raises, saying why, where the C side refused the call.
            call = SubmitCall(job_id, direction, device_blocks, slots, group, skip, urgent)
            self._plan_and_submit(call)

    def _submit(self, job: Job) -> None:
        store = job.direction is Direction.STORE
        lane = 1 if job.urgent else 0
        table, nseg = self._table_ptrs[job.group][0 if store else 1]
        dst = np.ascontiguousarray(job.host_rows if store else job.dev_rows, dtype=np.int64)
        src = np.ascontiguousarray(job.dev_rows if store else job.host_rows, dtype=np.int64)
        seq = self._next_seq[lane]
        self._next_seq[lane] = seq + 1  # before the call, as in `_submit_ids`
        try:
            # Recorded first, as in `_submit_ids` (the caller, `_queue`, counts it unreported).
            self._live[job.job_id] = _Live(lane, seq, job.nbytes, job.direction.value, (dst, src))
            rc = self._lib.kvt_engine_submit(
                self._engine, job.job_id, lane, seq, table, nseg,
                dst.ctypes.data, src.ctypes.data, dst.shape[0],
            )  # fmt: skip
        except BaseException:
            self._kept(job.job_id, lane, seq)
            raise
        if rc != 0:
            del self._live[job.job_id]
            raise RuntimeError(f"the copy engine refused job {job.job_id} (stopped or no memory)")

    def _kept(self, job_id: int, lane: int, seq: int) -> bool:
        """After a submit raised (lock held): whether the engine queued the job, `seq` of
        `lane`. An interrupt may come as the engine's call returns, with the job queued: its
        records stay then; otherwise they go."""
        if self._lib.kvt_engine_accepted(self._engine, lane) >= seq:
            return True
        self._live.pop(job_id, None)
        self._unreported.discard(job_id)
        return False

    def _accepted(self, job_id: int) -> bool:
        return job_id in self._live

    def _copying(self) -> list[int]:
        # Jobs finished and not yet collected are still live: the engine says which are done.
        done, engine = self._lib.kvt_engine_wait_for, self._engine
        return [j for j, live in self._live.items() if not done(engine, live.lane, live.seq, 0)]

    def _take_finished(self) -> None:
        """Results are read from the engine first and dropped from it only once every one
        of them is in `_ready`: an interrupt in between leaves them in the engine, and the
        next call skips those already moved (no longer in `_live`)."""
        buf = self._poll_buffer
        while True:
            k = self._lib.kvt_engine_peek(self._engine, buf, _POLL)
            for r in buf[:k]:
                job_id = r.job_id
                live = self._live.get(job_id)
                if live is None:
                    continue  # moved by a call that an interrupt cut short before the drop
                one, ids = [job_result(job_id, bool(r.ok), live.nbytes, r.seconds)], {job_id}
                # No call from here to the loop's end: an interrupt comes before or after.
                self._ready += one
                self._ready_ids |= ids
                del self._live[job_id]
            self._lib.kvt_engine_drop(self._engine, k)
            if k < _POLL:
                return

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until every job in `job_ids` has finished (ids not in flight are ignored)."""
        if self._forked:
            raise RuntimeError(FORKED)
        if threading.get_ident() == self._engine_thread:
            raise RuntimeError("wait() called from the transfer thread would deadlock")
        last = [0, 0]
        with self._lock:
            for j in job_ids_of(job_ids):
                live = self._live.get(j)
                if live is not None and live.seq > last[live.lane]:
                    last[live.lane] = live.seq
        wait_for = self._lib.kvt_engine_wait_for  # releases the GIL
        for lane, seq in enumerate(last):
            while seq and not wait_for(self._engine, lane, seq, _WAIT_SLICE_NS):
                pass  # a Ctrl-C is raised as the call returns

    def shutdown(self) -> None:
        """Let the running job finish, stop the threads, then report queued jobs failed (after
        the running one, so that results stay in submission order). Called from the fault
        injector, it returns at once, and the engine's thread does this when the job it is
        in ends (as `CPUTransferWorker`'s does). In a forked child it leaves the engine
        alone: its threads are the parent's, and nothing there would ever report the jobs
        (a second stop waited for them for good, and so did the free at collection)."""
        atexit.unregister(self._at_exit)
        with self._lock:
            self._closed = True
        if self._forked:
            self._finalizer.detach()
            return
        # Every call, not only the first: a later one (another thread's) returns once the
        # first has reported every job (or at once on the engine's thread, as the first does).
        self._lib.kvt_engine_stop(self._engine)  # joins the thread; releases the GIL meanwhile
