"""The CUDA backend: one stream per lane (stores, loads, urgent loads), events for completion.

The pinned host pool is mapped into the device's address space, so kernels read and write it
directly. Where the native library builds and NVRTC is found, a job is one call into compiled
code (`cuda_engine`): one kernel launch per 480 rows that gathers and scatters in one pass, or
for large jobs one batched call to the copy engines (`cuda_dma`). Elsewhere a job is a few
batched torch index kernels (`copier`), with index and staging buffers reused. No Python runs
per block on either path.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.base import TransferResult, checked_int
from kvtier.transfer import cuda_dma
from kvtier.transfer.copier import BlockCopier
from kvtier.transfer.cpu_worker import stage_buffer
from kvtier.transfer.cuda_dma import DmaCopier
from kvtier.transfer.cuda_engine import LANES, MAX_COALESCE_DEPTH, CUDAEngine
from kvtier.transfer.host_pool import HostPool
from kvtier.transfer.native import EXT_REFUSED, EXT_STOPPED, submit_extension
from kvtier.transfer.plan import Direction, IdsLike, Job
from kvtier.transfer.registration import KVCacheRegistration
from kvtier.transfer.worker import (
    FORKED,
    FaultInjector,
    IdStaging,
    SubmitCall,
    TransferWorker,
    check_pool,
    job_ids_of,
    job_result,
)

logger = logging.getLogger(__name__)

COPY_MODES = ("auto", "kernel", "dma")
"""kernel: kernels through the mapped pool; dma: the copy engines, one batched driver call per
job; auto: dma where the driver has it for jobs of DMA_MIN_JOB_BYTES or more whose copies (one
per block and segment) average DMA_MIN_COPY_BYTES or more, and on the compiled path also for
jobs whose copies average 256 KiB or more."""

DMA_MIN_JOB_BYTES = 16 << 20
"""Crossover measured on an H100 (docs/bench/transfer.md): below it a batched DMA call costs
more than the kernels' launch for small pages; from it the copy engines run at 94-99% of a
contiguous copy, against 90-94% for the compiled kernel."""

DMA_MIN_COPY_BYTES = 32 << 10
"""Below this average copy the kernel takes even a large job (cudaengine.c's KVT_DMA_SMALL_COPY):
on an H200, 16 KiB copies in 8-16 MiB jobs moved at 24-48% of a contiguous copy through the
copy engines against 85-89% by the kernel, and a transformers paged cache's 2 KiB pieces (one
per layer, K or V, and head) loaded at 1.6 GB/s through them (docs/bench/transfer.md)."""

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
    """The torch-ops path's stream, copier and jobs, which complete in submission order."""

    def __init__(
        self,
        registration: KVCacheRegistration,
        host_rows: torch.Tensor,
        stage_bytes: int,
        stream: torch.cuda.Stream,
    ) -> None:
        device = registration.device
        self.stream = stream
        nbytes = max(stage_bytes, int(host_rows.shape[1]))
        stage = stage_buffer(stage_bytes, nbytes, device, DEFAULT_CUDA_STAGE_BYTES)
        self.copier = BlockCopier(registration, host_rows, stage)
        self.records: deque[_Record] = deque()


_CAPTURE_ERRORS = range(900, 909)
"""CUDA_ERROR_STREAM_CAPTURE_*: cudaengine.c answers 900 for a submit under graph capture."""


def _capture_error(job_id: int, rc: int | None = None) -> RuntimeError:
    """The error for a submit while the current stream is being captured (nothing queued)."""
    return RuntimeError(
        f"job {job_id} was not queued: the current CUDA stream is being captured into a CUDA "
        "graph, and kvtier copies cannot be captured; submit outside the capture"
        + ("" if rc is None else f" (CUresult {rc})")
    )


def _not_queued(job_id: int, rc: int) -> RuntimeError:
    """The error for a job the compiled engine could not queue (`rc`: -1 or a CUresult)."""
    if rc in _CAPTURE_ERRORS:
        return _capture_error(job_id, rc)
    return RuntimeError(
        f"the CUDA copy engine could not queue job {job_id} "
        + ("(out of memory)" if rc < 0 else f"(CUresult {rc})")
    )


def _wait_failed(lanes: list[str]) -> RuntimeError:
    """The error for a `wait` the CUDA driver failed (`lanes`: each lane's jobs and CUresult)."""
    return RuntimeError(
        "waiting for CUDA transfer jobs failed: " + "; ".join(lanes) + ". They are still in "
        "flight; get_finished reports each once (failed where its copies failed)"
    )


def _lane(direction: Direction, urgent: bool) -> int:
    """The compiled engine's lane (an index into `LANES`) of a job."""
    if direction is Direction.STORE:
        return 0
    return 2 if urgent else 1


@dataclass(slots=True)
class _Live:
    """A job queued on the compiled path whose result has not been collected."""

    lane: int
    seq: int
    nbytes: int


def check_cuda_options(copy_mode: object, compiled: object, coalesce_depth: object) -> int:
    """ValueError for a `copy_mode`, `compiled` or `coalesce_depth` the CUDA worker cannot
    take (the factory checks them on every backend, so a CPU-only run sees them too). Returns
    `coalesce_depth` as an int: numpy's integers and 0-d integer tensors count, a bool not."""
    if copy_mode not in COPY_MODES:
        raise ValueError(f"copy_mode={copy_mode!r} is unknown; expected one of {COPY_MODES}")
    if compiled is not None and compiled is not True and compiled is not False:
        raise ValueError(f"compiled={compiled!r} must be None, True or False")
    try:
        depth = checked_int("coalesce_depth", coalesce_depth, 0)
    except ValueError:
        depth = -1
    if not 0 <= depth <= MAX_COALESCE_DEPTH:
        raise ValueError(
            f"coalesce_depth={coalesce_depth!r} is not valid; expected an int from 0 (off) to "
            f"{MAX_COALESCE_DEPTH}"
        )
    return depth


def _ended(event: torch.cuda.Event) -> bool:
    """Whether `event` is known to have completed (a query that raises: not known)."""
    try:
        return bool(event.query())  # type: ignore[no-untyped-call]
    except RuntimeError:
        return False


def _stage_bytes(value: object) -> int:
    """`stage_bytes` as an int, checked as the factory checks it, and numpy's integers and 0-d
    integer tensors taken as the rest of the transfer API takes them (never a bool)."""
    try:
        return checked_int("stage_bytes", value, 1)
    except ValueError:
        raise ValueError(f"stage_bytes={value!r} must be a positive int") from None


_POLL_S = 1e-3
"""How long a torch-ops wait polls before it hands the wait to a thread (`_wait_until`)."""
_SPIN_S = 1e-4
"""How long it polls without sleeping first (a Ctrl-C is raised at the loop's back edge)."""
_WAIT_SLICE_S = 0.05
"""A handed-over wait returns to Python this often, where a pending Ctrl-C is raised."""


def _wait_until(query: Callable[[], object] | None, synchronize: Callable[[], object]) -> None:
    """Block until `synchronize()` (of an event or streams) would return, raising what it
    raises (a CUDA error). One synchronize is a call that a Ctrl-C does not end: it was not
    seen until the copies ended. Here `query()` is polled for up to 1 ms (spinning 0.1 ms,
    then in sleeps that let the GIL go), which sees a short copy end within a microsecond or
    so and costs no thread; then a thread synchronizes, and this one waits for it in slices,
    as the compiled path does."""
    if query is not None:
        start = time.perf_counter()
        while not query():
            waited = time.perf_counter() - start
            if waited >= _POLL_S:
                break
            if waited >= _SPIN_S:  # spun first: the shortest sleep takes ~60 us (timer slack)
                time.sleep(50e-6)
        else:
            return
    ended = threading.Event()
    failed: list[BaseException] = []

    def sync() -> None:
        try:
            synchronize()
        except BaseException as exc:  # handed to the waiting thread
            failed.append(exc)
        finally:
            ended.set()

    # A daemon: where the copies never end, exit does not wait for it either.
    threading.Thread(target=sync, name="kvtier-cuda-wait", daemon=True).start()
    while not ended.wait(_WAIT_SLICE_S):
        pass
    if failed:
        raise failed[0]


_KEPT: list[object] = []
"""Buffers that copies may still use after a stream sync failed: those of torch-ops workers
freed then, and the index buffers of the jobs a shutdown reported failed then."""


def _sync_lanes(streams: list[torch.cuda.Stream], keep: object, pid: int) -> None:
    """The torch-ops path's finalizer: wait for the lanes' copies before `keep` (their buffers
    and the pool) may be freed, or keep it for good where the wait fails."""
    if os.getpid() != pid:
        return  # a forked child's copy: the streams and their copies are the parent's
    try:
        for stream in streams:
            stream.synchronize()
    except RuntimeError as exc:
        logger.error("kvtier: waiting for CUDA copies failed as the worker was freed (%s)", exc)
        _KEPT.append(keep)


class CUDATransferWorker(TransferWorker):
    """Transfer worker for KV tensors on one CUDA device and a pinned host pool.

    `compiled`: None (the default) submits through the compiled engine where it can be built
    and falls back to torch ops with a log line where not; True requires it (RuntimeError
    saying why otherwise); False always uses torch ops. `copy_path` says which is in use.

    `coalesce_depth` (compiled path only; 0, the default, is off): a thread per lane launches
    the jobs, keeping at most this many batches queued on the GPU; jobs submitted meanwhile
    wait on the host and leave as one batch (one wait for compute, one kernel launch per 480
    rows, one end event). A refused launch then fails every job of its batch.
    """

    _forked = False
    """Set per instance by `TransferWorker`; here also for one assembled without `__init__`
    (the interrupt tests build a worker's state from its parts)."""

    def __init__(
        self,
        registration: KVCacheRegistration,
        pool: HostPool,
        *,
        stage_bytes: int = DEFAULT_CUDA_STAGE_BYTES,
        fault_injector: FaultInjector | None = None,
        copy_mode: str = "auto",
        compiled: bool | None = None,
        coalesce_depth: int = 0,
    ) -> None:
        coalesce_depth = check_cuda_options(copy_mode, compiled, coalesce_depth)
        stage_bytes = _stage_bytes(stage_bytes)
        if coalesce_depth and compiled is False:
            raise ValueError("coalesce_depth needs the compiled path (compiled=False turns it off)")
        # Before the device and pinning checks read them (as CPUTransferWorker checks its
        # registration first): a list of KVTensors, or no pool, died on a missing attribute.
        check_pool(registration, pool)
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
        self._alias = alias
        host_rows = pool.num_slots * pool.blocks_per_chunk
        self._dma_min_bytes = 0 if copy_mode == "dma" else DMA_MIN_JOB_BYTES
        self._streams = [torch.cuda.Stream(device) for _ in LANES]  # type: ignore[no-untyped-call]
        self._engine: CUDAEngine | None = None
        if compiled is not False:
            try:
                self._engine = CUDAEngine(
                    registration, pool.address, pool.row_bytes, host_rows, self._streams,
                    copy_mode, self._dma_min_bytes, coalesce_depth, pool,
                )  # fmt: skip
            except RuntimeError as exc:
                if compiled or coalesce_depth:
                    raise
                # Several times slower for jobs of a few MiB: worth a line at the default level.
                logger.warning("kvtier: CUDA copies use torch ops (%s)", exc)
        self._contexts: dict[int, tuple[int, int]] = {}
        if self._engine is not None:
            self._ctx_keep, self._contexts = self._engine.submit_contexts(self._planner)
        self.copy_path = "compiled" if self._engine is not None else "torch"
        """"compiled" (`cuda_engine`) or "torch" (index kernels through torch ops)."""
        self.coalesce_depth = coalesce_depth
        # The submit call without ctypes, where the extension builds (native.py).
        ext = submit_extension() if self._engine is not None else None
        self._ext_submit = ext.submit if ext is not None else None
        self._live: dict[int, _Live] = {}
        """Jobs queued on the compiled path whose results are not yet in `_ready`."""
        self._next_seq = [1] * len(LANES)
        self._staging = IdStaging()  # used under self._lock
        self._lanes: dict[str, _Lane] = {}
        self._dma: DmaCopier | None = None
        if self._engine is None:
            rows = alias.view(host_rows, pool.row_bytes)
            self._lanes = {
                name: _Lane(registration, rows, stage_bytes, stream)
                for name, stream in zip(LANES, self._streams, strict=True)
            }
            if copy_mode == "dma" or (copy_mode == "auto" and cuda_dma.available()):
                self._dma = DmaCopier(registration, pool.address, pool.row_bytes, device.index or 0)
        self._indices = _IndexBuffers(device)
        self._events: list[torch.cuda.Event] = []
        self._by_id: dict[int, _Record] = {}
        if self._engine is None:
            # Dropped without shutdown() (or at exit), the lanes' copies may still run: their
            # index and staging buffers would go back to torch's allocator for other work, and
            # the pool be unpinned and unmapped, under them. The engine's finalizer does this
            # for the compiled path.
            self._lanes_finalizer = weakref.finalize(
                self, _sync_lanes, self._streams, (self._lanes, self._indices, pool), os.getpid()
            )
        pool._add_user(self)  # last: a worker that failed to build never held the pool

    def _check_job_id(self, job_id: int) -> None:
        # The engine is freed at interpreter exit (its finalizer), possibly before a later exit
        # handler submits: refuse as after shutdown() rather than hand C a freed engine.
        if self._engine is not None and not self._engine.alive:
            raise RuntimeError("the transfer worker is shut down (its engine was freed at exit)")
        super()._check_job_id(job_id)

    def _plans_ids(self) -> bool:
        # The fault injector runs in Python before a job's copies: planned jobs only.
        return self._engine is not None and self._fault_injector is None

    def _submit_ids(
        self, job_id: int, direction: Direction, device_blocks: IdsLike, slots: IdsLike,
        group: int, skip: int, urgent: bool,
    ) -> None:  # fmt: skip
        """A job planned in C (`kvt_plan_rows`, as the CPU engine does): the planner's numpy
        calls alone cost 9-28 µs a job on the H100 host. The ids go to C through the submit
        extension where it is built (as for the CPU engine, which it took from 4.6 to 2-3 µs
        a submit there), else through ctypes (`_submit_staged`). Arguments the C side refuses
        go through the planner, which raises with its usual message."""
        engine = self._engine
        assert engine is not None
        submit = self._ext_submit
        contexts = self._contexts.get(group)
        if submit is None or contexts is None:
            self._submit_staged(job_id, direction, device_blocks, slots, group, skip, urgent)
            return
        store = direction is Direction.STORE
        with self._lock:
            self._check_job_id(job_id)
            lane = _lane(direction, urgent)
            seq = self._next_seq[lane]
            try:
                # Recorded first: an interrupt may come as the engine's call returns.
                live = self._live[job_id] = _Live(lane, seq, 0)
                self._next_seq[lane] = seq + 1
                self._unreported.add(job_id)
                n = submit(
                    engine.submit_fn, engine.handle, contexts[0 if store else 1], job_id, lane,
                    engine.compute_stream(), device_blocks, slots, skip,
                )  # fmt: skip
                if n >= 0:
                    live.nbytes = n * self._planner.page_bytes[group]
                    return
            except BaseException:
                if self._kept(job_id, lane):  # queued: the ids were read, len() works
                    page = self._planner.page_bytes[group]
                    self._live[job_id].nbytes = len(device_blocks) * page
                raise
            # Refused. Undone without a call into Python, where an interrupt could come first.
            self._next_seq[lane] = seq
            del self._live[job_id]
            self._unreported.discard(job_id)
            if n == EXT_STOPPED:
                raise _not_queued(job_id, engine.last_error())
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
        """`_submit_ids` through ctypes, the ids converted with numpy and copied into one
        staging buffer whose address is known."""
        assert self._engine is not None
        ids = self._plain_ids(device_blocks, slots, group, skip)
        with self._lock:
            self._check_job_id(job_id)
            if ids is not None:
                dev, sl, page = ids
                lane = _lane(direction, urgent)
                context = self._contexts[group][0 if direction is Direction.STORE else 1]
                dev_at, sl_at = self._staging.put(dev, sl)
                seq = self._next_seq[lane]
                try:
                    # Recorded first, as in `_submit_ids`.
                    self._live[job_id] = _Live(lane, seq, int(dev.shape[0]) * page)
                    self._next_seq[lane] = seq + 1
                    self._unreported.add(job_id)
                    rc = self._engine.submit_ids(
                        context, lane, job_id, dev_at, int(dev.shape[0]), sl_at,
                        int(sl.shape[0]), skip,
                    )  # fmt: skip
                    if rc == 0:
                        return
                except BaseException:
                    self._kept(job_id, lane)
                    raise
                self._next_seq[lane] = seq  # refused: undone as in `_submit_ids`
                del self._live[job_id]
                self._unreported.discard(job_id)
                if rc != 1:
                    raise _not_queued(job_id, rc)
            # The planner's path: it raises, saying why, where the C side refused the call.
            call = SubmitCall(job_id, direction, device_blocks, slots, group, skip, urgent)
            self._plan_and_submit(call)

    def _kept(self, job_id: int, lane: int) -> bool:
        """After a compiled submit raised (lock held): whether the engine queued the job. An
        interrupt may come as the engine's call returns, with the job queued: its records stay
        then; otherwise they go. Either way the lane's count resumes where the engine's does
        (it numbers a lane's jobs itself, and `wait` names them so)."""
        assert self._engine is not None
        accepted = self._engine.accepted(lane)
        self._next_seq[lane] = accepted + 1
        live = self._live.get(job_id)
        if live is not None and live.seq <= accepted:
            return True
        self._live.pop(job_id, None)
        self._unreported.discard(job_id)
        return False

    def _accepted(self, job_id: int) -> bool:
        return job_id in self._live or job_id in self._by_id

    def _copying(self) -> list[int]:
        engine = self._engine
        if engine is None:
            return [j for j, r in self._by_id.items() if not _ended(r.end)]
        if not engine.alive:
            return []  # freed at exit: synced, or the pool kept for good (`cuda_engine._close`)
        # Not waited for (no slice): -1 while pending, a CUresult where the wait failed (the
        # copies may then still run), 0 once done. The engine has no other query.
        query, handle = engine._wait_for, engine.handle
        return [j for j, live in self._live.items() if query(handle, live.lane, live.seq, 0)]

    def _inject(self, job: Job) -> bool:
        """Run the fault injector; False if it raised (the job then fails)."""
        if self._fault_injector is None:
            return True
        try:
            self._fault_injector(job.job_id, job.direction.value)
        except Exception:
            logger.exception("transfer job %d (%s) failed", job.job_id, job.direction.value)
            return False
        return True

    def _on_copy_engines(self, job: Job) -> bool:
        """Whether the torch-ops path hands `job` to the copy engines (COPY_MODES)."""
        if self._dma is None:
            return False
        if self._dma_min_bytes == 0:  # copy_mode="dma"
            return True
        return (
            job.nbytes >= self._dma_min_bytes
            and self._dma.mean_copy_bytes(job) >= DMA_MIN_COPY_BYTES
        )

    def _submit(self, job: Job) -> None:
        if self._engine is not None:
            store = job.direction is Direction.STORE
            lane = _lane(job.direction, job.urgent)
            ok = self._inject(job)
            table = self._engine.tables[job.group][0 if store else 1].number
            dst, src = (job.host_rows, job.dev_rows) if store else (job.dev_rows, job.host_rows)
            dst = np.ascontiguousarray(dst, dtype=np.int64)
            src = np.ascontiguousarray(src, dtype=np.int64)
            seq = self._next_seq[lane]
            try:
                # Recorded first, as in `_submit_ids` (`_queue` counts it unreported).
                self._live[job.job_id] = _Live(lane, seq, job.nbytes)
                self._next_seq[lane] = seq + 1
                rc = self._engine.submit_rows(lane, job.job_id, not ok, table, job.nbytes, dst, src)
            except BaseException:
                self._kept(job.job_id, lane)
                raise
            if rc != 0:
                self._next_seq[lane] = seq  # refused: undone as in `_submit_ids`
                del self._live[job.job_id]
                raise _not_queued(job.job_id, rc)
            return
        # Before anything is recorded: under capture, the torch calls below would be captured
        # (or fail), as cudaengine.c's submit explains. One runtime call.
        if torch.cuda.is_current_stream_capturing():
            raise _capture_error(job.job_id)
        if job.direction is Direction.STORE:
            ln = self._lanes["store"]
        else:
            ln = self._lanes["urgent" if job.urgent else "load"]
        n = len(job)
        buf = None
        if not self._on_copy_engines(job):
            buf = self._indices.take(max(1, 2 * n))
            staged = buf.host.numpy()
            staged[:n] = job.dev_rows
            staged[n : 2 * n] = job.host_rows
        start, end = self._event(), self._event()
        record = _Record(job.job_id, job.nbytes, False, start, end, buf)
        try:
            # Stores read KV the compute stream is producing; loads overwrite blocks it may
            # still be reading or zeroing. Both wait for the compute queued so far.
            ln.stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(ln.stream):
                start.record(ln.stream)
                try:
                    # Recorded before any copy is queued: an interrupt may come after any
                    # torch call, and the job is then reported failed (`ok` is still False)
                    # once the copies it queued have ended.
                    self._by_id[job.job_id] = record
                    ln.records.append(record)
                    ok = self._inject(job)
                    try:
                        if ok and buf is None:
                            assert self._dma is not None
                            self._dma.run(job, ln.stream.cuda_stream)
                        elif ok and buf is not None:
                            idx = buf.device[: 2 * n]
                            idx.copy_(buf.host[: 2 * n], non_blocking=True)
                            ln.copier.run(job, idx[:n], idx[n:])
                    except Exception:
                        logger.exception(
                            "transfer job %d (%s) failed", job.job_id, job.direction.value
                        )
                        ok = False
                    record.ok = ok
                finally:
                    # Recorded even on failure: kernels already launched must finish before
                    # the job is reported and its buffers are reused.
                    self._end(ln, record)
        except BaseException:
            if self._by_id.get(job.job_id) is not record:
                # Raised before the job was recorded (a CUDA call refused the lane's wait
                # or start): no copy reads its buffers, which were otherwise lost for good.
                self._events += (start, end)
                if buf is not None:
                    self._indices.give(buf)
            raise

    def _end(self, ln: _Lane, record: _Record) -> None:
        """Record `record`'s end event on its lane. Where that raises, the event keeps an
        older state, which `get_finished` would take for the end of these copies (its index
        buffer then handed to the next job under them): the lane is synced first and the
        job failed, its buffer never reused if even that fails."""
        try:
            record.end.record(ln.stream)
        except BaseException:
            record.ok = False
            try:
                ln.stream.synchronize()
            except BaseException:
                record.indices = None
                raise
            raise

    def _event(self) -> torch.cuda.Event:
        if self._events:
            return self._events.pop()
        return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]

    def _take_finished(self) -> None:
        """Move the finished results into `_ready` (lock held), losing none to an interrupt:
        nothing leaves the engine before the worker holds it (`CUDAEngine.peek`, then `drop`),
        and each result goes into `_ready` with its job's removal from `_live` in steps with
        no call between them. A call cut short leaves the results it moved in the engine, and
        the next one skips them (no longer live) and drops them. In a forked child it raises
        (as `wait` does) before any CUDA call: the driver's state and the engine's threads are
        the parent's, and its mutex may have been held by one of them at the fork."""
        if self._forked:
            raise RuntimeError(FORKED)
        engine = self._engine
        if engine is None:
            self._take_records(self._ready, self._ready_ids)
            return
        freed = not engine.alive  # before the peeks: they then return all it ever will
        live, ready, ready_ids = self._live, self._ready, self._ready_ids
        while True:
            seen = engine.peek()
            for r in seen:
                job_id = r.job_id
                job = live.get(job_id)
                if job is None:
                    continue  # moved by a call cut short before its drop, or failed already
                one, ids = (job_result(job_id, bool(r.ok), job.nbytes, r.seconds),), {job_id}
                # No call from here to the loop's end: an interrupt comes before or after.
                ready += one
                ready_ids |= ids
                del live[job_id]
            engine.drop(len(seen))
            if len(seen) < engine.poll_size:
                break
        if freed and live:
            # Freed at exit after a sync that failed (`cuda_engine._close`): the engine will
            # never report these, and their copies cannot be known to have finished.
            self._fail_live()

    def _take_records(self, ready: list[TransferResult], ready_ids: set[int]) -> None:
        """The torch-ops path's finished jobs into `ready`, their ids into `ready_ids`, each
        lane's in submission order (lock held). A result goes in with its job's removal from
        `_by_id` in steps with no call between them, and its record leaves the lane after: a
        call cut short in between leaves a record no longer in `_by_id`, which the next call
        drops without reporting it again."""
        for lane in self._lanes.values():
            records = lane.records
            while records:
                r = records[0]
                if r.job_id not in self._by_id:
                    records.popleft()  # reported; its events and buffer are not reused
                    continue
                try:
                    if not r.end.query():  # type: ignore[no-untyped-call]
                        break
                    seconds = r.start.elapsed_time(r.end) / 1e3
                except RuntimeError:
                    # torch raises a CUDA error (sticky after a fault) from the query: the job
                    # is failed, not left unreported, and so is each later one that raises.
                    # Its events and index buffer are not reused.
                    logger.exception("transfer job %d failed: its end event reports an error",
                                     r.job_id)  # fmt: skip
                    one, ids = (TransferResult(r.job_id, False, 0, 0.0),), {r.job_id}
                    ready += one  # these three steps have no call between them
                    ready_ids |= ids
                    del self._by_id[r.job_id]
                    records.popleft()
                    continue
                one, ids = (job_result(r.job_id, r.ok, r.nbytes, seconds),), {r.job_id}
                ready += one  # these three steps have no call between them
                ready_ids |= ids
                del self._by_id[r.job_id]
                records.popleft()
                self._events += (r.start, r.end)
                if r.indices is not None:
                    self._indices.give(r.indices)

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until every job in `job_ids` has finished (ids not in flight are ignored)."""
        if self._forked:
            raise RuntimeError(FORKED)
        job_ids = job_ids_of(job_ids)
        if self._engine is not None:
            last = [0] * len(LANES)
            waited: list[list[int]] = [[] for _ in LANES]
            with self._lock:
                for j in job_ids:
                    live = self._live.get(j)
                    if live is not None:
                        waited[live.lane].append(j)
                        last[live.lane] = max(last[live.lane], live.seq)
            # A lane finishes in order: its last job covers the others. Outside the lock, so
            # that submits and polls go on meanwhile.
            failed = []
            for lane, seq in enumerate(last):
                if seq and (rc := self._engine.wait(lane, seq)):
                    failed.append(f"{LANES[lane]} jobs {waited[lane]} (CUresult {rc})")
            if failed:
                # Returning would tell the caller that copies which may still run are done
                # (a store's blocks or a load's slots then reused under them).
                raise _wait_failed(failed)
            return
        with self._lock:
            events = [self._by_id[j].end for j in job_ids if j in self._by_id]
        for event in events:
            _wait_until(event.query, event.synchronize)

    def _fail_live(self) -> None:
        """Report the jobs still live failed, each lane in submission order, into `_ready` at
        once (lock held). The engine's later results for them are skipped: they are no longer
        live, and no job is queued after this (the worker is shut down, or its engine freed)."""
        left = sorted(self._live.items(), key=lambda item: (item[1].lane, item[1].seq))
        failed = [TransferResult(job_id, False, 0, 0.0) for job_id, _ in left]
        ids = {job_id for job_id, _ in left}
        none: dict[int, _Live] = {}
        # No call from here on: an interrupt comes before these steps or after them.
        self._ready += failed
        self._ready_ids |= ids
        self._live = none

    def _fail_records(self) -> list[int]:
        """The torch-ops path's `_fail_live` (lock held): report every job still recorded
        failed, each lane in submission order; returns their ids. Their copies may still run:
        their index buffers are kept for good, and their events are not reused."""
        left = [r for ln in self._lanes.values() for r in ln.records if r.job_id in self._by_id]
        failed = [TransferResult(r.job_id, False, 0, 0.0) for r in left]
        ids = {r.job_id for r in left}
        if left:
            _KEPT.append([r.indices for r in left])
        by_id: dict[int, _Record] = {}
        # No call from here on: an interrupt comes before these steps or after them. The
        # records left in the lanes are dropped by `_take_records`, no longer in `_by_id`.
        self._ready += failed
        self._ready_ids |= ids
        self._by_id = by_id
        return [r.job_id for r in left]

    def shutdown(self) -> None:
        """Wait for every launched copy (CUDA work cannot be cancelled) and refuse new jobs.
        If the driver's wait fails (a poisoned context, say), logs it and reports every job
        not known to have finished failed, rather than hang or raise. In a forked child it
        only refuses new jobs (as `wait` refuses there): the engine's launch threads, context
        and streams are the parent's, which alone waits for their copies."""
        with self._lock:
            self._closed = True
        if self._forked:
            return
        # Every call waits, not only the first: a second one (another thread's) returned while
        # the first still waited for the launched copies, with jobs neither done nor reported.
        if self._engine is None:
            streams = self._streams

            def sync_all() -> None:
                for stream in streams:
                    stream.synchronize()

            try:
                _wait_until(None, sync_all)  # rare: no polling, the thread at once
            except RuntimeError as exc:
                # As the compiled path: raised, it left the jobs held for good (and escaped
                # `__exit__`); waiting more could hang.
                with self._lock:
                    self._take_finished()
                    failed = self._fail_records()
                logger.error("kvtier: shutdown: %s; jobs %s are reported failed", exc, failed)
            return
        engine = self._engine
        for lane in range(len(LANES)):
            # In slices first (Ctrl-C is seen between them), then the sync below is short.
            if engine.alive and engine.wait(lane, engine.accepted(lane)):
                break  # failed: the sync below fails too, and says so
        try:
            self._engine.sync()  # the lanes' streams are the engine's: synced there
        except RuntimeError as exc:
            # Returning with the jobs held would leave them unreported, or reported done later
            # with copies that were never known to finish; waiting more could hang.
            with self._lock:
                before = len(self._ready)
                self._take_finished()
                self._fail_live()
                failed = [r.job_id for r in self._ready[before:] if not r.success]
            logger.error("kvtier: shutdown: %s; jobs %s are reported failed", exc, failed)
