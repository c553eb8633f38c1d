"""The compiled submit path of the CUDA backend: `cudaengine.c` driving `gather.cu`'s kernel.

A job is one call from Python: C validates its ids and computes its rows, records an event on
the caller's compute stream, and queues the job in its lane. Its launch makes the lane's stream
wait for that event, records a start event, launches one kernel per 480 rows (the row numbers
ride in the launch parameters: no index upload, no staging buffer) or, for large jobs, queues
one batched call to the copy engines, and records an end event. The submitting thread launches
each job at once, or, with `coalesce_depth`, a thread per lane launches the jobs that waited
while the lane had that many batches queued on the GPU as one batch.
`CUDATransferWorker` uses it wherever the native library builds (`native.library()`) and NVRTC
compiles the kernel (`nvrtc.cubin()`); elsewhere it copies with torch ops.
"""

from __future__ import annotations

import ctypes
import logging
import os
import weakref
from typing import NamedTuple

import numpy as np
import torch

from kvtier.transfer import cuda_dma, nvrtc
from kvtier.transfer.native import (
    EngineResult,
    SegmentTables,
    SubmitContext,
    library,
    segment_tables,
    submit_contexts,
)
from kvtier.transfer.plan import JobPlanner
from kvtier.transfer.registration import KVCacheRegistration

logger = logging.getLogger(__name__)

LANES = ("store", "load", "urgent")
MAX_COALESCE_DEPTH = 8
"""cudaengine.c's KVT_DEPTH_MAX."""
_POLL = 256
"""Results fetched per engine call."""
_WAIT_SLICE_NS = 50_000_000
"""`wait` blocks in C this long at a time, then returns to Python, which raises a pending
Ctrl-C (KeyboardInterrupt) only there: in one call, it waited until the copies ended."""
_WAIT_PENDING = -1
"""`kvt_cuda_wait_for`'s answer for a job not finished within the slice."""
_WaitFor = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64
)


class _Table(NamedTuple):
    number: int
    """The engine's table number."""
    device_copy: torch.Tensor
    """The table in device memory, which the kernel reads (kept alive here)."""


def _raw_stream(device_index: int) -> int:
    """The current stream's handle: `torch.cuda.current_stream()` costs several µs a call."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device_index))
    return int(torch.cuda.current_stream(device_index).cuda_stream)


_KEPT: list[object] = []
"""Device tables of engines freed after a sync that failed: copies may still read them."""


def _close(
    lib: ctypes.CDLL, handle: int, keep: object, drained: list[EngineResult], pid: int
) -> None:
    if os.getpid() != pid:
        # A forked child's copy of the engine (collected there, or at its exit): its launch
        # threads, context and streams are the parent's. Joining those threads crashed the
        # child (SIGSEGV), and the driver calls would act on handles it does not own.
        return
    # Copies may still be running when a worker is dropped without shutdown(): wait for them
    # before the tables they read (in `keep`) are freed.
    rc = lib.kvt_cuda_sync(handle)
    if rc:
        # They may still run: their tables are never freed. The jobs the poll below cannot
        # report stay unreported by the engine; the worker reports them failed.
        logger.error(
            "kvtier: waiting for CUDA copies failed as the engine was freed (CUresult %d); "
            "jobs not finished by then are reported failed",
            rc,
        )
        _KEPT.append(keep)
    # At interpreter exit this runs while the worker lives, and a later exit handler may still
    # collect its results: keep them, for `peek`, rather than free them with the engine.
    buf = (EngineResult * _POLL)()
    while k := lib.kvt_cuda_poll(handle, buf, _POLL):
        drained += [EngineResult(r.job_id, r.ok, r.lane, r.seconds) for r in buf[:k]]
    lib.kvt_cuda_free(handle)
    del keep


class CUDAEngine:
    """One compiled engine for a registration and a pinned pool at `host_address`.

    `host_memory` (the pool that owns that memory) is kept until the engine is freed, after its
    copies ended: a worker dropped with its pool could otherwise see the pool unpinned and
    unmapped first (the worker's attributes go in their order, the pool before the engine).

    Not thread-safe except `wait`: the worker calls the rest under its lock.
    Raises RuntimeError (with the reason) where it cannot be built.
    """

    def __init__(
        self,
        registration: KVCacheRegistration,
        host_address: int,
        row_bytes: int,
        host_rows: int,
        streams: list[torch.cuda.Stream],
        copy_mode: str,
        dma_min_bytes: int,
        coalesce_depth: int = 0,
        host_memory: object = None,
    ) -> None:
        lib = library()
        if lib is None:
            raise RuntimeError(
                "the native library is unavailable (no C compiler, or its build failed)"
            )
        if max(registration.num_blocks, host_rows) > 1 << 32:
            raise RuntimeError("the kernel takes 32-bit row numbers")
        device = registration.device
        image = nvrtc.cubin(torch.cuda.get_device_capability(device))
        if image is None:
            raise RuntimeError("NVRTC could not compile the copy kernel")
        batch, batch13 = None, 0
        found = cuda_dma._lookup() if copy_mode != "kernel" else None
        if found is not None:
            fn, new = found
            batch, batch13 = ctypes.cast(fn, ctypes.c_void_p).value, int(new)  # type: ignore[arg-type]
        elif copy_mode == "dma":
            raise RuntimeError("this CUDA driver has no cuMemcpyBatchAsync (CUDA 12.8+)")
        handles = (ctypes.c_uint64 * len(LANES))(*(s.cuda_stream for s in streams))
        err = ctypes.create_string_buffer(512)
        self._image = ctypes.create_string_buffer(image)  # the driver reads it during new()
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        with torch.cuda.device(device):  # makes the device's context current for new()
            handle = lib.kvt_cuda_new(
                self._image, handles, batch, batch13, dma_min_bytes, sms, err, len(err)
            )
        if not handle:
            raise RuntimeError(f"the CUDA copy engine failed to start: {err.value.decode()}")
        self._lib = lib
        # Its own prototype: native.py's signatures are the library's shared ones.
        self._wait_for = _WaitFor(("kvt_cuda_wait_for", lib))
        self.handle: int = handle
        """The engine's address (the submit extension takes it)."""
        self._device_index = device.index if device.index is not None else 0
        self.tables: dict[int, tuple[_Table, _Table]] = {}
        """Per KV-cache group, the store and load tables."""
        self._poll_buffer = (EngineResult * _POLL)()
        self.poll_size = _POLL
        """The most results one `peek` returns: fewer means the engine had no more."""
        self._peeked_drained = False
        """Whether the latest `peek` read `_drained` (the engine was freed) or the engine."""
        self._drained: list[EngineResult] = []
        """Results left when the engine was freed (at interpreter exit), for `peek`."""
        # Armed before anything else can fail: a table upload that ran out of device memory
        # (its RuntimeError sends `compiled=None` to torch ops) leaked the engine, its loaded
        # kernel image and its locks.
        self._finalizer = weakref.finalize(
            self, _close, lib, handle, (self.tables, streams, host_memory), self._drained,
            os.getpid(),
        )  # fmt: skip
        try:
            self._host_tables = self._add_tables(registration, host_address, row_bytes)
            torch.cuda.synchronize(device)  # the tables' uploads, before any kernel reads them
            if coalesce_depth and lib.kvt_cuda_coalesce(handle, coalesce_depth):
                raise RuntimeError("could not start the CUDA copy engine's launch threads")
        except BaseException:
            self._finalizer()
            raise
        self.coalesce_depth = coalesce_depth
        """Batches a lane keeps queued on the GPU before it holds jobs back (0: no launch
        threads; each job is launched by its submitter)."""
        self.submit_fn: int = ctypes.cast(lib.kvt_cuda_submit_ext, ctypes.c_void_p).value or 0
        """The address of the submit call in the shape the extension calls."""

    def _add_tables(
        self, registration: KVCacheRegistration, host_address: int, row_bytes: int
    ) -> SegmentTables:
        """Upload each group's store and load segment tables and register them with the
        engine, into `tables`; returns the host tables, which the submit contexts point at."""
        device = registration.device
        host_tables = segment_tables(registration, host_address, row_bytes)
        for g, pair in host_tables.items():
            made = []
            for store, table in zip((1, 0), pair, strict=True):
                on_device = torch.from_numpy(table.view(np.int64).copy()).to(device)
                index = self._lib.kvt_cuda_add_table(
                    self.handle, table.ctypes.data, table.shape[0], on_device.data_ptr(), store,
                    self._device_index,
                )  # fmt: skip
                if index < 0:
                    raise RuntimeError("out of memory registering the copy tables")
                made.append(_Table(index, on_device))
            self.tables[g] = (made[0], made[1])
        return host_tables

    @property
    def alive(self) -> bool:
        """False once the engine is freed (at interpreter exit, by its finalizer): every other
        call but `peek`, `drop`, `wait` and `sync` would then touch freed memory."""
        return self._finalizer.alive

    def compute_stream(self) -> int:
        """The handle of the caller's current stream, which a job waits for."""
        return _raw_stream(self._device_index)

    def last_error(self) -> int:
        """The CUresult behind the latest submit the extension reported as failed (-1: out
        of memory, or the engine stopping)."""
        return int(self._lib.kvt_cuda_last_error(self.handle))

    def accepted(self, lane: int) -> int:
        """The sequence number (as `wait` takes it) of the last job queued in `lane`, 0 for
        none: after a submit cut short by an interrupt, whether it queued its job."""
        return int(self._lib.kvt_cuda_accepted(self.handle, lane))

    def submit_ids(
        self, context: int, lane: int, job_id: int, blocks_at: int, nblocks: int, slots_at: int,
        nslots: int, skip: int,
    ) -> int:  # fmt: skip
        """Plan and queue a job in C (`context`: the address of the group and direction's
        `SubmitContext`); 0 queued, 1 invalid (nothing queued), else an error."""
        return int(
            self._lib.kvt_cuda_submit_ids(
                self.handle, context, lane, _raw_stream(self._device_index), job_id,
                blocks_at, nblocks, slots_at, nslots, skip,
            )
        )  # fmt: skip

    def submit_contexts(
        self, planner: JobPlanner
    ) -> tuple[list[SubmitContext], dict[int, tuple[int, int]]]:
        """`native.submit_contexts` for this engine's tables (see `submit_ids`)."""
        numbers = {g: (st.number, ld.number) for g, (st, ld) in self.tables.items()}
        return submit_contexts(self._host_tables, planner, numbers)

    def submit_rows(
        self, lane: int, job_id: int, fail: bool, table: int, nbytes: int,
        dst: np.ndarray, src: np.ndarray,
    ) -> int:  # fmt: skip
        """Queue a planned job (`dst`/`src`: int64 rows); `fail` records it as failed."""
        return int(
            self._lib.kvt_cuda_submit(
                self.handle, lane, _raw_stream(self._device_index), job_id, int(fail), table,
                nbytes, dst.ctypes.data, src.ctypes.data, dst.shape[0],
            )
        )  # fmt: skip

    def peek(self) -> list[EngineResult]:
        """Up to `poll_size` finished jobs' results, each lane's in submission order, left in
        the engine until `drop`: Python can raise an interrupt (Ctrl-C) as any call returns,
        and results taken out in the same call would be lost with it, so the caller drops
        them once it holds them. A peek repeated before the drop returns them
        again first. They are views of a buffer the next peek overwrites."""
        if not self._finalizer.alive:  # freed at exit: what `_close` collected
            self._peeked_drained = True
            return self._drained[: self.poll_size]
        self._peeked_drained = False
        k = self._lib.kvt_cuda_peek(self.handle, self._poll_buffer, self.poll_size)
        return self._poll_buffer[:k]

    def drop(self, k: int) -> None:
        """Remove the first `k` results of the latest `peek` (all of them, or the first few)."""
        if self._peeked_drained:
            del self._drained[:k]
        elif k and self._finalizer.alive:
            # (Freed since the peek, `_close` kept those results in `_drained` with the rest:
            # the caller skips the ones it holds.)
            self._lib.kvt_cuda_drop(self.handle, self._poll_buffer, k)

    def wait(self, lane: int, seq: int) -> int:
        """Block until `lane`'s job `seq` (counted from 1) is launched and its copies have
        finished; at once if it has been polled (releases the GIL; needs no lock). Returns 0,
        or the CUresult of a wait that failed: the job may then still be copying. Waits in
        slices, so that a Ctrl-C raises KeyboardInterrupt within one."""
        wait_for, handle = self._wait_for, self.handle
        while True:
            if not self._finalizer.alive:
                # Freed at exit: `_close` synced it, or its sync failed and the worker reports
                # the jobs it left failed. Either way nothing is left to wait for.
                return 0
            rc = wait_for(handle, lane, seq, _WAIT_SLICE_NS)
            if rc != _WAIT_PENDING:
                return int(rc)

    def sync(self) -> None:
        """Block until every queued copy has finished. Raises RuntimeError naming the CUresult
        where the driver's wait failed (a poisoned or lost context, say): copies may then
        still run, and every job stays queued, for `peek` to report once."""
        if not self._finalizer.alive:  # freed at exit (`_close` synced it): nothing is queued
            return
        if rc := self._lib.kvt_cuda_sync(self.handle):
            raise RuntimeError(f"waiting for the CUDA copy engine's copies failed (CUresult {rc})")
