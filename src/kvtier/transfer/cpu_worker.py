"""The CPU backend: copies run on one background thread; torch releases the GIL inside them."""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable
from typing import Any, Protocol, cast

import torch

from kvtier.base import TransferResult, checked_int
from kvtier.transfer.copier import BlockCopier
from kvtier.transfer.host_pool import HostPool
from kvtier.transfer.native import row_copier
from kvtier.transfer.plan import Job
from kvtier.transfer.registration import KVCacheRegistration
from kvtier.transfer.worker import (
    FORKED,
    FaultInjector,
    TransferWorker,
    check_registration,
    job_ids_of,
    job_result,
    shutdown_at_exit,
)

logger = logging.getLogger(__name__)

_WAIT_SLICE_S = 0.05
"""`wait` blocks this long at a time (see `NativeCPUTransferWorker.wait`)."""

DEFAULT_STAGE_BYTES = 1 << 20
"""Scratch for copies whose both sides are scattered: small enough to stay in a core's L2."""


def check_stage_bytes(value: object) -> int:
    """`stage_bytes` as a positive int (numpy's and 0-d integer tensors too, never a bool)."""
    try:
        return checked_int("stage_bytes", value, 1)
    except ValueError:
        raise ValueError(f"stage_bytes={value!r} must be a positive int") from None


def stage_buffer(
    stage_bytes: int,
    nbytes: int,
    device: torch.device | None = None,
    default: int = DEFAULT_STAGE_BYTES,
) -> torch.Tensor:
    """A `nbytes` uint8 staging buffer, refused by the setting that sized it when it cannot be
    had: torch's allocator error names only a byte count."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        where = device if device is not None else "the host"
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MemoryError(
            f"stage_bytes={stage_bytes}: could not allocate the {nbytes}-byte staging buffer "
            f"on {where} ({reason}); give a smaller stage_bytes (default {default})"
        ) from e


class RowCopier(Protocol):
    """Copies one job's rows; indices come as CPU int64 tensors."""

    def run(self, job: Job, dev_idx: torch.Tensor, host_idx: torch.Tensor) -> None: ...


class _JobQueue:
    """The queues that a worker shares with its copy thread. The thread holds this and a weak
    reference to the worker, so that a worker dropped without `shutdown()` is collected; its
    finalizer then calls `stop`."""

    def __init__(
        self, lock: threading.RLock, worker: weakref.ReferenceType[CPUTransferWorker]
    ) -> None:
        # Two conditions on one lock: new work wakes only the copy thread, and a finished job
        # wakes waiters only if one waits for it (waking them per job costs GIL hand-offs).
        self.cv = threading.Condition(lock)
        self.done_cv = threading.Condition(lock)
        # Per waiting call, the ids it waits for: one call's cleanup (an interrupt's too)
        # leaves another's ids, the same ones included, in place.
        self.waiting: dict[object, set[int]] = {}
        self.queue: deque[Job] = deque()
        self.urgent: deque[Job] = deque()
        self.in_flight: set[int] = set()
        self.results: list[TransferResult] = []
        self.result_ids: set[int] = set()
        """The ids of `results`; both change only under the lock, and a result never goes
        without its id. The copy thread, which no interrupt reaches, appends to them in
        place; `fail_queued`, which may run on the caller's thread, and `_take_finished`
        replace them in steps with no call, where CPython raises no interrupt."""
        self.stopping = False
        self.stopped = threading.Event()
        """Set once the thread has reported the queued jobs failed, as it ends."""
        self.thread = threading.Thread(
            target=_serve, args=(worker, self), name="kvtier-transfer", daemon=True
        )

    def stop(self) -> None:
        """Let the running job finish and end the thread, which then reports the queued jobs
        failed (after the running one, so that results stay in submission order)."""
        if threading.current_thread() is self.thread:
            # The worker was collected on its own thread (which dropped the last reference
            # after a job, or ran the cyclic collector, maybe holding the lock or about to
            # wait): a thread cannot join itself, so another one stops it. Not a daemon: exit
            # waits for it, as it would have waited for `shutdown()`.
            threading.Thread(target=self.stop, name="kvtier-transfer-stop", daemon=False).start()
            return
        with self.cv:
            self.stopping = True
            self.cv.notify_all()
        # An interrupt (Ctrl-C) may end this wait: the thread still reports the queued jobs
        # and sets `stopped`, for which a second `shutdown()` waits. (Reported here after the
        # join, they never were, and that second call waited for good.)
        self.thread.join()
        if not self.stopped.is_set():  # ended without its last step: a forked child's copy
            self.fail_queued()

    def fail_queued(self) -> None:
        """Report the queued jobs failed and set `stopped`: the copy thread's last step."""
        with self.cv:
            queued = [*self.urgent, *self.queue]
            failed = [TransferResult(job.job_id, False) for job in queued]
            ids = {job.job_id for job in queued}
            self.results, self.result_ids = [*self.results, *failed], self.result_ids | ids
            self.in_flight -= ids
            self.urgent.clear()
            self.queue.clear()
            self.done_cv.notify_all()
        self.stopped.set()


def _serve(ref: weakref.ReferenceType[CPUTransferWorker], jobs: _JobQueue) -> None:
    """The copy thread. It holds the worker only while it runs a job: a worker nobody else
    holds is collected, and its finalizer stops this thread."""
    try:
        _serve_jobs(ref, jobs)
    finally:
        jobs.fail_queued()


def _serve_jobs(ref: weakref.ReferenceType[CPUTransferWorker], jobs: _JobQueue) -> None:
    while True:
        with jobs.cv:
            jobs.cv.wait_for(lambda: jobs.stopping or bool(jobs.urgent or jobs.queue))
            if jobs.stopping:
                return
            job = jobs.urgent.popleft() if jobs.urgent else jobs.queue.popleft()
        worker = ref()
        if worker is None:
            return  # collected; its finalizer is stopping this thread
        start = time.perf_counter()
        ok = worker._run(job)
        seconds = time.perf_counter() - start
        del worker  # outside the lock: the last reference runs the finalizer (`stop`)
        result = job_result(job.job_id, ok, job.nbytes, seconds)
        with jobs.cv:
            # In place, unlike `fail_queued`: only this thread runs here, and no interrupt
            # reaches it, while `_take_finished` swaps the pair under this same lock. Copying
            # them cost time in proportion to the results not yet taken, per job.
            jobs.results.append(result)
            jobs.result_ids.add(job.job_id)
            jobs.in_flight.discard(job.job_id)
            if jobs.waiting and any(job.job_id in ids for ids in jobs.waiting.values()):
                jobs.done_cv.notify_all()


class CPUTransferWorker(TransferWorker):
    """Transfer worker for KV tensors in host memory (tests, CI, CPU inference).

    One thread runs jobs in submission order, urgent loads first; so on this backend a load
    never overtakes an earlier store of any lane except by being urgent.
    """

    def __init__(
        self,
        registration: KVCacheRegistration,
        pool: HostPool,
        *,
        stage_bytes: int = DEFAULT_STAGE_BYTES,
        fault_injector: FaultInjector | None = None,
    ) -> None:
        # Checked here as the factory checks it: built directly, a worker took stage_bytes=0 or
        # -5 silently. The registration, pool and injector are checked by _check_device and the
        # base class, before any thread starts.
        self._check_device(registration)
        stage_bytes = check_stage_bytes(stage_bytes)
        super().__init__(registration, pool, fault_injector)
        self._copier: RowCopier = self._make_copier(stage_bytes)
        # An RLock for the conditions' sake: `Condition.wait` takes a plain Lock back through a
        # Python call whose acquire a Ctrl-C interrupts, and an interrupted `wait()` then left
        # its `with` without the lock and released it from under the thread holding it (the
        # copy thread died on its own release; later jobs never ran and their waits hung). An
        # RLock is taken back in C, retrying on a signal, and knows its owner (`wait`).
        lock = threading.RLock()
        self._lock = lock
        self._jobs = _JobQueue(lock, weakref.ref(self))
        self._thread = self._jobs.thread
        self._thread.start()
        # `shutdown()` calls the finalizer; collecting the worker too, which stops the thread.
        self._finalizer = weakref.finalize(self, self._jobs.stop)
        self._finalizer.atexit = False  # exit calls `shutdown()` instead (`shutdown_at_exit`)
        self._at_exit = shutdown_at_exit(self)
        pool._add_user(self)  # last: a worker that failed to build never held the pool

    _DEVICE = ("cpu", "the CPU")
    """(device type the KV tensors must be on, its name in errors)"""

    @classmethod
    def _check_device(cls, registration: KVCacheRegistration) -> None:
        check_registration(registration)  # the compiled worker calls this before check_pool
        kind, name = cls._DEVICE
        if registration.device.type != kind:
            raise ValueError(
                f"the {kind.upper()} backend needs KV tensors on {name}, got {registration.device}"
            )

    def _make_copier(self, stage_bytes: int) -> RowCopier:
        row_copier()  # build (or load) the compiled copier now, not inside the first job
        stage = stage_buffer(stage_bytes, max(stage_bytes, self.pool.row_bytes))
        return BlockCopier(self.registration, self.pool.rows, stage)

    def _submit(self, job: Job) -> None:
        jobs = self._jobs
        queue = jobs.urgent if job.urgent else jobs.queue
        try:
            # In flight before queued: wait() must never miss a queued job.
            jobs.in_flight.add(job.job_id)
            queue.append(job)
            jobs.cv.notify_all()
        except BaseException:
            # An interrupt (a Python function's entry, or the return from a C one) may come
            # anywhere here. The copy thread cannot have taken the job: this thread holds the
            # lock. Queued, it needs the wake-up, which the interrupt may have cut short.
            if queue and queue[-1] is job:
                jobs.cv.notify_all()
            else:
                jobs.in_flight.discard(job.job_id)
            raise

    def _accepted(self, job_id: int) -> bool:
        return job_id in self._jobs.in_flight

    def _take_finished(self) -> None:
        jobs = self._jobs
        empty: list[TransferResult] = []
        no_ids: set[int] = set()
        # No call from here on: an interrupt comes before these steps or after them.
        taken, ids = jobs.results, jobs.result_ids
        jobs.results, jobs.result_ids = empty, no_ids
        self._ready += taken
        self._ready_ids |= ids

    def _copying(self) -> set[int]:
        return self._jobs.in_flight  # queued or running, until the thread reports them

    @property
    def _in_flight(self) -> set[int]:
        """Ids of jobs queued or running (tests read it)."""
        return self._jobs.in_flight

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until every job in `job_ids` has finished (ids not in flight are ignored)."""
        if self._forked:
            raise RuntimeError(FORKED)
        ids = set(job_ids_of(job_ids))
        if threading.current_thread() is self._thread:
            raise RuntimeError("wait() called from the transfer thread would deadlock")
        jobs = self._jobs
        token = object()
        lock = cast(Any, self._lock)  # the RLock of __init__; its C methods, for the handler
        owned, restore, state = lock._is_owned, lock._acquire_restore, (1, threading.get_ident())
        with self._lock:
            ids &= jobs.in_flight
            try:
                jobs.waiting[token] = ids  # one step: an interrupt comes before it or after
                done = lambda: jobs.in_flight.isdisjoint(ids)  # noqa: E731
                # In slices, as NativeCPUTransferWorker: a Ctrl-C that came while another
                # thread held the GIL was at times raised only once the job ended.
                while not jobs.done_cv.wait_for(done, _WAIT_SLICE_S):
                    pass
            except BaseException:
                # `Condition.wait` raises without the lock where a Ctrl-C comes as it has just
                # released it, before its own `try`: taken back (in C, no interrupt inside) so
                # that `waiting` changes under the lock and the `with` releases this thread's.
                if not owned():
                    restore(state)
                raise
            finally:
                # On Ctrl-C too, or each of these ids' jobs would wake every waiter when done.
                jobs.waiting.pop(token, None)

    def shutdown(self) -> None:
        """Let the running job finish, stop the thread, then report queued jobs failed (after
        the running one, so that results stay in submission order)."""
        atexit.unregister(self._at_exit)
        with self._lock:
            first = not self._closed
            self._closed = True
            self._jobs.stopping = True  # no job starts from here on
            self._jobs.cv.notify_all()
        if first:
            try:
                self._finalizer()
            except BaseException:
                # Interrupted while the running job finishes: the thread ends by itself, and
                # exit still waits for it (a copy running as torch is torn down aborts).
                self._at_exit = shutdown_at_exit(self)
                raise
        elif threading.current_thread() is not self._thread:
            # Another thread's call is stopping it: return, as it will, once every job is
            # reported (the copy thread itself cannot wait for its own end).
            self._jobs.stopped.wait()

    def _run(self, job: Job) -> bool:
        try:
            if self._fault_injector is not None:
                self._fault_injector(job.job_id, job.direction.value)
            self._copier.run(job, torch.from_numpy(job.dev_rows), torch.from_numpy(job.host_rows))
        except BaseException:
            # The destination may be partly written; the caller must treat it as garbage,
            # which a success=False result tells it to do. BaseException too (a test's
            # injector may raise pytest's outcomes): escaping, it would end this thread, and
            # every job behind it would never be reported.
            logger.exception("transfer job %d (%s) failed", job.job_id, job.direction.value)
            return False
        return True
