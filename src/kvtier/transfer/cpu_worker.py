"""The CPU backend: copies run on one background thread; torch releases the GIL inside them."""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Protocol

import torch

from kvtier.base import TransferResult
from kvtier.transfer.copier import BlockCopier
from kvtier.transfer.host_pool import HostPool
from kvtier.transfer.native import row_copier
from kvtier.transfer.plan import Job
from kvtier.transfer.registration import KVCacheRegistration
from kvtier.transfer.worker import FaultInjector, TransferWorker

logger = logging.getLogger(__name__)

DEFAULT_STAGE_BYTES = 1 << 20
"""Scratch for copies whose both sides are scattered: small enough to stay in a core's L2."""


class RowCopier(Protocol):
    """Copies one job's rows; indices come as CPU int64 tensors."""

    def run(self, job: Job, dev_idx: torch.Tensor, host_idx: torch.Tensor) -> None: ...


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
        self._check_device(registration)
        super().__init__(registration, pool, fault_injector)
        self._copier: RowCopier = self._make_copier(stage_bytes)
        # Two conditions on one lock: new work wakes only the copy thread, and a finished job
        # wakes waiters only if one waits for it (waking them per job costs GIL hand-offs).
        self._cv = threading.Condition(self._lock)
        self._done_cv = threading.Condition(self._lock)
        self._wanted: set[int] = set()
        self._queue: deque[Job] = deque()
        self._urgent: deque[Job] = deque()
        self._in_flight: set[int] = set()
        self._results: list[TransferResult] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="kvtier-transfer", daemon=True)
        self._thread.start()
        # A copy still running while the interpreter tears torch down aborts the process
        # ("terminate called without an active exception"): stop the thread first.
        atexit.register(self.shutdown)

    _DEVICE = ("cpu", "the CPU")
    """(device type the KV tensors must be on, its name in errors)"""

    @classmethod
    def _check_device(cls, registration: KVCacheRegistration) -> None:
        kind, name = cls._DEVICE
        if registration.device.type != kind:
            raise ValueError(
                f"the {kind.upper()} backend needs KV tensors on {name}, got {registration.device}"
            )

    def _make_copier(self, stage_bytes: int) -> RowCopier:
        row_copier()  # build (or load) the compiled copier now, not inside the first job
        stage = torch.empty(max(stage_bytes, self.pool.row_bytes), dtype=torch.uint8)
        return BlockCopier(self.registration, self.pool.rows, stage)

    def _submit(self, job: Job) -> None:
        (self._urgent if job.urgent else self._queue).append(job)
        self._in_flight.add(job.job_id)
        self._cv.notify_all()

    def _collect(self) -> list[TransferResult]:
        results, self._results = self._results, []
        return results

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until every job in `job_ids` has finished (ids not in flight are ignored)."""
        ids = set(job_ids)
        if threading.current_thread() is self._thread:
            raise RuntimeError("wait() called from the transfer thread would deadlock")
        with self._lock:
            ids &= self._in_flight
            self._wanted |= ids
            self._done_cv.wait_for(lambda: self._in_flight.isdisjoint(ids))
            self._wanted -= ids

    def shutdown(self) -> None:
        """Let the running job finish, stop the thread, then report queued jobs failed (after
        the running one, so that results stay in submission order)."""
        atexit.unregister(self.shutdown)
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._stopping = True
            self._cv.notify_all()
        self._thread.join()
        with self._cv:
            for job in (*self._urgent, *self._queue):
                self._results.append(TransferResult(job.job_id, False))
                self._in_flight.discard(job.job_id)
            self._urgent.clear()
            self._queue.clear()
            self._done_cv.notify_all()

    def _serve(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stopping or bool(self._urgent or self._queue))
                if self._stopping:
                    return
                job = self._urgent.popleft() if self._urgent else self._queue.popleft()
            start = time.perf_counter()
            ok = self._run(job)
            seconds = time.perf_counter() - start
            with self._cv:
                self._results.append(
                    TransferResult(job.job_id, ok, job.nbytes if ok else 0, seconds)
                )
                self._in_flight.discard(job.job_id)
                if job.job_id in self._wanted:
                    self._done_cv.notify_all()

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
