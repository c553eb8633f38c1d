"""The CUDA backend: one stream per lane (stores, loads, urgent loads), events for completion.

The pinned host pool is mapped into the device's address space. A small job is a few batched
index kernels between device KV tensors and host memory (see `copier`); a large one is one
batched call to the copy engines (see `cuda_dma`). No Python runs per block. Index buffers,
staging buffers, streams and events are allocated once and reused.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvtier.base import TransferResult
from kvtier.transfer import cuda_dma
from kvtier.transfer.copier import BlockCopier
from kvtier.transfer.cuda_dma import DmaCopier
from kvtier.transfer.host_pool import HostPool
from kvtier.transfer.plan import Direction, Job
from kvtier.transfer.registration import KVCacheRegistration
from kvtier.transfer.worker import FaultInjector, TransferWorker

logger = logging.getLogger(__name__)

COPY_MODES = ("auto", "kernel", "dma")
"""kernel: index kernels through the mapped pool; dma: the copy engines, one batched driver
call per job; auto: dma for jobs of DMA_MIN_JOB_BYTES or more where the driver has it."""

DMA_MIN_JOB_BYTES = 16 << 20
"""Crossover measured on an H100 (docs/bench/transfer.md): below it a batched DMA call costs
more than the index kernels' launch; from it the copy engines run at 91-98% of a contiguous
copy, against 83-94% for the kernels."""

DEFAULT_CUDA_STAGE_BYTES = 32 << 20
"""Device scratch per lane for jobs whose both sides are scattered."""


class _DevicePointer:
    """Exposes a mapped pinned host range through `__cuda_array_interface__` (UVA alias)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


@dataclass(slots=True)
class _IndexBuffer:
    host: torch.Tensor
    device: torch.Tensor


class _IndexBuffers:
    """Pinned + device int64 index buffers, reused by power-of-two capacity class."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._free: dict[int, list[_IndexBuffer]] = {}

    def take(self, n: int) -> _IndexBuffer:
        cap = max(1024, 1 << max(0, n - 1).bit_length())
        free = self._free.setdefault(cap, [])
        if free:
            return free.pop()
        host = torch.empty(cap, dtype=torch.int64, pin_memory=True)
        return _IndexBuffer(host, torch.empty(cap, dtype=torch.int64, device=self._device))

    def give(self, buf: _IndexBuffer) -> None:
        self._free[int(buf.host.shape[0])].append(buf)


@dataclass(slots=True)
class _Record:
    job_id: int
    nbytes: int
    ok: bool
    start: torch.cuda.Event
    end: torch.cuda.Event
    indices: _IndexBuffer | None


class _Lane:
    """One stream and its jobs, which complete in submission order."""

    def __init__(
        self,
        registration: KVCacheRegistration,
        host_rows: torch.Tensor,
        stage_bytes: int,
    ) -> None:
        device = registration.device
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        stage = torch.empty(max(stage_bytes, int(host_rows.shape[1])), dtype=torch.uint8,
                            device=device)  # fmt: skip
        self.copier = BlockCopier(registration, host_rows, stage)
        self.records: deque[_Record] = deque()


class CUDATransferWorker(TransferWorker):
    """Transfer worker for KV tensors on one CUDA device and a pinned host pool."""

    def __init__(
        self,
        registration: KVCacheRegistration,
        pool: HostPool,
        *,
        stage_bytes: int = DEFAULT_CUDA_STAGE_BYTES,
        fault_injector: FaultInjector | None = None,
        copy_mode: str = "auto",
    ) -> None:
        if copy_mode not in COPY_MODES:
            raise ValueError(f"copy_mode={copy_mode!r} is unknown; expected one of {COPY_MODES}")
        device = registration.device
        if device.type != "cuda":
            raise ValueError(f"the CUDA backend needs KV tensors on a CUDA device, got {device}")
        if not pool.pinned:
            raise ValueError(
                "CUDATransferWorker needs a pinned host pool; make_transfer_worker() picks the "
                "bounce-buffer fallback for a pageable one"
            )
        super().__init__(registration, pool, fault_injector)
        self._device = device
        alias = torch.as_tensor(_DevicePointer(pool.address, pool.nbytes), device=device)
        if alias.data_ptr() != pool.address:
            raise RuntimeError("could not map the pinned host pool into the device address space")
        host_rows = alias.view(pool.num_slots * pool.blocks_per_chunk, pool.row_bytes)
        self._alias = alias
        self._lanes = {
            name: _Lane(registration, host_rows, stage_bytes)
            for name in ("store", "load", "urgent")
        }
        self._indices = _IndexBuffers(device)
        self._dma: DmaCopier | None = None
        if copy_mode == "dma" or (copy_mode == "auto" and cuda_dma.available()):
            self._dma = DmaCopier(registration, pool.address, pool.row_bytes, device.index or 0)
        self._dma_min_bytes = 0 if copy_mode == "dma" else DMA_MIN_JOB_BYTES
        self._events: list[torch.cuda.Event] = []
        self._by_id: dict[int, _Record] = {}

    def _event(self) -> torch.cuda.Event:
        if self._events:
            return self._events.pop()
        return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]

    def _submit(self, job: Job) -> None:
        if job.direction is Direction.STORE:
            lane = self._lanes["store"]
        else:
            lane = self._lanes["urgent" if job.urgent else "load"]
        n = len(job)
        buf = None
        if self._dma is None or job.nbytes < self._dma_min_bytes:
            buf = self._indices.take(max(1, 2 * n))
            staged = buf.host.numpy()
            staged[:n] = job.dev_rows
            staged[n : 2 * n] = job.host_rows
        start, end = self._event(), self._event()
        ok = True
        # Stores read KV the compute stream is producing; loads overwrite blocks it may still
        # be reading or zeroing. Both wait for the compute queued so far.
        lane.stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(lane.stream):
            start.record(lane.stream)
            try:
                if self._fault_injector is not None:
                    self._fault_injector(job.job_id, job.direction.value)
                if buf is None:
                    assert self._dma is not None
                    self._dma.run(job, lane.stream.cuda_stream)
                else:
                    idx = buf.device[: 2 * n]
                    idx.copy_(buf.host[: 2 * n], non_blocking=True)
                    lane.copier.run(job, idx[:n], idx[n:])
            except Exception:
                logger.exception("transfer job %d (%s) failed", job.job_id, job.direction.value)
                ok = False
            # Recorded even on failure: kernels already launched must finish before the
            # job's buffers are reused.
            end.record(lane.stream)
        record = _Record(job.job_id, job.nbytes, ok, start, end, buf)
        lane.records.append(record)
        self._by_id[job.job_id] = record

    def _collect(self) -> list[TransferResult]:
        results = []
        for lane in self._lanes.values():
            while lane.records and lane.records[0].end.query():  # type: ignore[no-untyped-call]
                r = lane.records.popleft()
                seconds = r.start.elapsed_time(r.end) / 1e3
                results.append(TransferResult(r.job_id, r.ok, r.nbytes if r.ok else 0, seconds))
                self._events += (r.start, r.end)
                if r.indices is not None:
                    self._indices.give(r.indices)
                del self._by_id[r.job_id]
        return results

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until every job in `job_ids` has finished (ids not in flight are ignored)."""
        with self._lock:
            events = [self._by_id[j].end for j in job_ids if j in self._by_id]
        for event in events:
            event.synchronize()

    def shutdown(self) -> None:
        """Wait for every launched copy (CUDA work cannot be cancelled) and refuse new jobs."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for lane in self._lanes.values():
            lane.stream.synchronize()
