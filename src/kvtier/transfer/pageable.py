"""The CUDA fallback for a host pool that could not be pinned.

Pageable memory cannot be mapped into the device's address space, and a copy between it and
the device is synchronous, so jobs run on a background thread (as on the CPU backend) through
two bounce buffers: device blocks are gathered into a contiguous device buffer by index
kernels, copied in one piece to a host buffer, and scattered into the pool's rows on the CPU
(loads take the reverse path). Slower than the pinned path, but correct and non-blocking for
the caller.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from kvtier.transfer.copier import BlockCopier
from kvtier.transfer.cpu_worker import CPUTransferWorker, RowCopier
from kvtier.transfer.plan import Direction, Job
from kvtier.transfer.registration import KVCacheRegistration

logger = logging.getLogger(__name__)

DEFAULT_BOUNCE_BYTES = 16 << 20
"""Size of each bounce buffer (one on the device, one on the host)."""


class BounceCopier:
    """Copies a job's rows between device KV tensors and pageable host rows via bounce buffers.

    The device half is a `BlockCopier` whose "host" is the device bounce buffer (row `i` of a
    piece goes to bounce row `i`, so it is a single gather or scatter per segment). Works with
    KV tensors on any device, which lets the CPU test suite exercise the index logic.
    """

    def __init__(
        self,
        registration: KVCacheRegistration,
        host_rows: torch.Tensor,
        bounce_bytes: int = DEFAULT_BOUNCE_BYTES,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        device = registration.device
        row_bytes = int(host_rows.shape[1])
        self._piece = max(1, bounce_bytes // row_bytes)
        self._host_rows = host_rows
        self._dev_bounce = torch.empty(self._piece, row_bytes, dtype=torch.uint8, device=device)
        self._host_bounce = torch.empty(self._piece, row_bytes, dtype=torch.uint8)
        scratch = torch.empty(row_bytes, dtype=torch.uint8, device=device)
        self._device_side = BlockCopier(registration, self._dev_bounce, scratch)
        # Filled by a kernel: on the stream that reads it, which does not wait for the
        # constructing thread's stream.
        ctx: Any = torch.cuda.stream(stream) if stream is not None else _nullctx()
        with ctx:
            self._arange = torch.arange(self._piece, dtype=torch.int64, device=device)
        self._device = device
        self._stream = stream

    def run(self, job: Job, dev_idx: torch.Tensor, host_idx: torch.Tensor) -> None:
        """Copy `job`'s rows; `dev_idx`/`host_idx` are CPU int64 tensors of its rows."""
        ctx: Any = torch.cuda.stream(self._stream) if self._stream is not None else _nullctx()
        with ctx:
            for a in range(0, len(job), self._piece):
                b = min(len(job), a + self._piece)
                self._run_piece(job, dev_idx[a:b], host_idx[a:b])
            if self._stream is not None:
                # The job is reported done only once its last scatter has landed.
                self._stream.synchronize()

    def _run_piece(self, job: Job, dev_idx: torch.Tensor, host_idx: torch.Tensor) -> None:
        k = int(dev_idx.shape[0])
        dev_rows = dev_idx.numpy()
        piece = Job(
            job.job_id, job.direction, job.group, dev_rows, np.arange(k, dtype=np.int64),
            0, _run(dev_rows), 0,
        )  # fmt: skip
        dev_on_device = dev_idx.to(self._device)
        dev_bounce, host_bounce = self._dev_bounce[:k], self._host_bounce[:k]
        if job.direction is Direction.STORE:
            self._device_side.run(piece, dev_on_device, self._arange[:k])
            host_bounce.copy_(dev_bounce)  # waits for the gather: pageable copies are synchronous
            self._host_rows.index_copy_(0, host_idx, host_bounce)
        else:
            torch.index_select(self._host_rows, 0, host_idx, out=host_bounce)
            dev_bounce.copy_(host_bounce)
            self._device_side.run(piece, dev_on_device, self._arange[:k])


class _nullctx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _run(rows: np.ndarray[Any, np.dtype[np.int64]]) -> int | None:
    first = int(rows[0])
    if rows.shape[0] > 1 and not bool(np.all(np.diff(rows) == 1)):
        return None
    return first


class PageableCUDATransferWorker(CPUTransferWorker):
    """CUDA KV tensors with a pageable host pool: one copy thread, bounce buffers.

    A store records an event on the compute stream when it is submitted and its copies wait
    for that event, so it reads the KV that the compute queued before it produced.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._events: dict[int, torch.cuda.Event] = {}
        super().__init__(*args, **kwargs)

    _DEVICE = ("cuda", "a CUDA device")

    def _make_copier(self, stage_bytes: int) -> RowCopier:
        device = self.registration.device
        self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        logger.warning(
            "kvtier: the host pool is not pinned; CUDA transfers go through bounce buffers on "
            "a background thread and will be several times slower"
        )
        return BounceCopier(
            self.registration, self.pool.rows, max(stage_bytes, DEFAULT_BOUNCE_BYTES), self._stream
        )

    def _submit(self, job: Job) -> None:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.registration.device))
        try:
            self._events[job.job_id] = event
            super()._submit(job)
        except BaseException:
            if not self._accepted(job.job_id):  # not queued: no `_run` will take the event
                self._events.pop(job.job_id, None)
            raise

    def shutdown(self) -> None:
        """As the CPU backend; also drops the events of jobs that were cancelled."""
        super().shutdown()
        with self._lock:
            self._events.clear()

    def _run(self, job: Job) -> bool:
        with self._lock:
            event = self._events.pop(job.job_id, None)
        if event is not None:
            try:
                self._stream.wait_event(event)
            except BaseException:
                # A CUDA error (a sticky one from an earlier fault, say): fail this job. Raised
                # out of here it would end the copy thread, and no job would be reported again.
                logger.exception("transfer job %d (%s) failed", job.job_id, job.direction.value)
                return False
        return super()._run(job)
