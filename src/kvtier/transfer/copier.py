"""Executes one job's copies with batched torch index ops; the same code serves CPU and CUDA.

Per segment, a job is one gather (`index_select` into a strided `out=` view) when the
destination rows form one run, one scatter (`index_copy_`) when the source rows do, one plain
copy per run of consecutive rows when runs are long (`plan.RUN_BYTES`), and otherwise a gather
into a small staging buffer followed by one scatter of whole pages. On the CPU, a job scattered
on both sides is instead one call of the compiled row copier (`native`, streaming stores) over
addresses computed with numpy, or one libc `memmove` per row and segment where it is not built:
torch and numpy have no single-pass gather-scatter, and the two-pass detour through the staging
buffer reached only about half of the contiguous-copy bandwidth here (see
docs/bench/transfer.md). The staging buffer is sized
to stay in cache (CPU) so the detour costs cache traffic, not memory traffic. Bytes are
viewed as the widest integer-like dtype their alignment allows, because the scatter kernel copies
one element per iteration.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvtier.transfer.native import row_copier, segment_tables
from kvtier.transfer.plan import Direction, Job
from kvtier.transfer.registration import KVCacheRegistration

# Element types used only to move bytes: copies never interpret them as numbers.
_WIDE: tuple[tuple[int, torch.dtype], ...] = (
    (16, torch.complex128),
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)


def _wide(*views: torch.Tensor) -> list[torch.Tensor]:
    """`views` (uint8, 2-D, rows contiguous) as the widest dtype all of them allow: one dtype
    for all, because the index ops between them need it. The storage offsets count too (a
    storage need not be 16-byte aligned where its data is, as with `torch.from_numpy`)."""
    g = 0
    for v in views:
        for a in (v.shape[1], v.stride(0), v.data_ptr(), v.storage_offset()):
            g = math.gcd(g, a)
    for size, dtype in _WIDE:
        if g % size == 0:
            return [v.view(dtype) for v in views]
    raise AssertionError("unreachable: 1 divides everything")


def _rows(flat: torch.Tensor, num_rows: int, width: int, stride: int, offset: int) -> torch.Tensor:
    return flat.as_strided((num_rows, width), (stride, 1), flat.storage_offset() + offset)


@dataclass(slots=True)
class _SegmentCopy:
    dev: torch.Tensor
    """(num_blocks, w) device rows"""
    host: torch.Tensor
    """(host_rows, w) columns of the host rows"""
    stage: torch.Tensor
    """(stage_rows, w) columns of the staging rows"""


@dataclass(slots=True)
class _GroupCopy:
    segments: list[_SegmentCopy]
    host_page: torch.Tensor
    stage_page: torch.Tensor
    stage_rows: int
    store_table: npt.NDArray[np.uint64]
    """Segment table of the compiled copier for stores (`native.RowCopy`); loads swap sides."""
    load_table: npt.NDArray[np.uint64]
    storages: list[tuple[torch.UntypedStorage, int, int]]
    """Per segment: its storage, the address the tables recorded, the bytes they reach."""

    def check_storages(self) -> None:
        """Refuse a job before raw-address copies when a registered tensor's memory was freed
        or moved (`untyped_storage().resize_()`): torch's ops raise then, but the addresses of
        the tables pointed into freed memory, and the copy killed the process (SIGSEGV)."""
        for storage, address, need in self.storages:
            have, at = storage.nbytes(), storage.data_ptr()
            if at != address or have < need:
                raise RuntimeError(
                    f"a registered KV tensor's storage was freed or moved (at {at:#x} with "
                    f"{have} bytes, expected {address:#x} with at least {need}); register the "
                    "tensors again and build a new worker"
                )


class BlockCopier:
    """Copies a job's blocks between the registered device tensors and the host rows.

    `host_rows` is the pool's `(rows, row_bytes)` uint8 view as the copy device sees it (the pool
    itself on CPU, a device alias of pinned memory on CUDA); `stage` a flat uint8 scratch buffer
    on the copy device of at least `row_bytes` bytes. Not thread-safe: one caller at a time.
    """

    def __init__(
        self, registration: KVCacheRegistration, host_rows: torch.Tensor, stage: torch.Tensor
    ) -> None:
        row_bytes = int(host_rows.shape[1])
        if stage.numel() < row_bytes:
            raise ValueError(f"stage of {stage.numel()} bytes cannot hold one {row_bytes}-byte row")
        n_host = int(host_rows.shape[0])
        host_flat = host_rows.reshape(-1)
        self._on_cpu = host_rows.device.type == "cpu" and stage.device.type == "cpu"
        tables = segment_tables(registration, host_rows.data_ptr(), row_bytes)
        self._groups: dict[int, _GroupCopy] = {}
        for g in registration.groups:
            page = registration.page_bytes(g)
            stage_rows = stage.numel() // page
            segments = []
            # One entry per storage (K and V of a layer share one): checked before every job.
            storages: dict[int, tuple[torch.UntypedStorage, int, int]] = {}
            col = 0
            for seg in registration.segments(g):
                reach = seg.offset + (seg.num_blocks - 1) * seg.stride + seg.width
                known = storages.get(seg.storage_ptr)
                if known is None or known[2] < reach:
                    storage = seg.storage_view.untyped_storage()
                    storages[seg.storage_ptr] = (storage, seg.storage_ptr, reach)
                dev = seg.rows
                host = _rows(host_flat, n_host, seg.width, row_bytes, col)
                st = _rows(stage, stage_rows, seg.width, page, col)
                segments.append(_SegmentCopy(*_wide(dev, host, st)))
                col += seg.width
            host_page, stage_page = _wide(
                _rows(host_flat, n_host, page, row_bytes, 0),
                _rows(stage, stage_rows, page, page, 0),
            )
            self._groups[g] = _GroupCopy(
                segments, host_page, stage_page, stage_rows, *tables[g], list(storages.values())
            )

    def run(self, job: Job, dev_idx: torch.Tensor, host_idx: torch.Tensor) -> None:
        """Copy `job`'s blocks; `dev_idx`/`host_idx` are its rows as int64 on the copy device."""
        n = len(job)
        if n == 0:
            return
        group = self._groups[job.group]
        if self._on_cpu and job.host_run is None and job.dev_run is None:
            _copy_rows(group, job.direction is Direction.STORE, job.dev_rows, job.host_rows)
        elif job.direction is Direction.STORE:
            self._store(group, job, n, dev_idx, host_idx)
        else:
            self._load(group, job, n, dev_idx, host_idx)

    @staticmethod
    def _store(
        g: _GroupCopy, job: Job, n: int, dev_idx: torch.Tensor, host_idx: torch.Tensor
    ) -> None:
        if job.host_run is not None:
            h = job.host_run
            for s in g.segments:
                torch.index_select(s.dev, 0, dev_idx, out=s.host[h : h + n])
        elif job.dev_run is not None:
            d = job.dev_run
            for s in g.segments:
                s.host.index_copy_(0, host_idx, s.dev[d : d + n])
        elif job.runs is not None:
            for d, h, k in zip(*job.runs, strict=True):
                for s in g.segments:
                    s.host[h : h + k].copy_(s.dev[d : d + k], non_blocking=True)
        else:
            step = g.stage_rows
            for a in range(0, n, step):
                b = min(n, a + step)
                for s in g.segments:
                    torch.index_select(s.dev, 0, dev_idx[a:b], out=s.stage[: b - a])
                g.host_page.index_copy_(0, host_idx[a:b], g.stage_page[: b - a])

    @staticmethod
    def _load(
        g: _GroupCopy, job: Job, n: int, dev_idx: torch.Tensor, host_idx: torch.Tensor
    ) -> None:
        if job.dev_run is not None:
            d = job.dev_run
            for s in g.segments:
                torch.index_select(s.host, 0, host_idx, out=s.dev[d : d + n])
        elif job.host_run is not None:
            h = job.host_run
            for s in g.segments:
                s.dev.index_copy_(0, dev_idx, s.host[h : h + n])
        elif job.runs is not None:
            for d, h, k in zip(*job.runs, strict=True):
                for s in g.segments:
                    s.dev[d : d + k].copy_(s.host[h : h + k], non_blocking=True)
        else:
            step = g.stage_rows
            for a in range(0, n, step):
                b = min(n, a + step)
                torch.index_select(g.host_page, 0, host_idx[a:b], out=g.stage_page[: b - a])
                for s in g.segments:
                    s.dev.index_copy_(0, dev_idx[a:b], s.stage[: b - a])


_memmove = ctypes.memmove
# Below this a job is one thread's work: handing half to another thread costs tens of µs.
_PARALLEL_BYTES = 2 << 20
_pool: ThreadPoolExecutor | None = None


# As many copy threads as torch uses for its own parallel copies.
_THREADS = max(1, torch.get_num_threads())


def _helpers() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_THREADS - 1, thread_name_prefix="kvtier-memmove")
        return _pool


def _forget_helpers() -> None:
    """In a forked child: the parent's helper threads are not there, and an executor that
    believes it has them queues work that nobody runs (the child's first split copy hung)."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


_pool_lock = threading.Lock()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helpers)


def _memmove_all(dst: list[int], src: list[int], width: int) -> None:
    for d, s in zip(dst, src, strict=True):
        _memmove(d, s, width)


def _split(n: int, nbytes: int) -> range:
    """Row offsets of the pieces a job of `n` rows and `nbytes` bytes is split into."""
    threads = 1 if nbytes < _PARALLEL_BYTES else min(_THREADS, n)
    return range(0, n, -(-n // threads)) if n else range(0)


def _copy_rows(
    g: _GroupCopy, store: bool, dev_rows: npt.NDArray[np.int64], host_rows: npt.NDArray[np.int64]
) -> None:
    """Copy a job scattered on both sides: one call of the compiled row copier over the row
    indices, or one libc memmove per row and segment where it is unavailable. Both release
    the GIL, so large jobs are split across threads."""
    g.check_storages()
    native = row_copier()
    if native is None:
        _memmove_rows(g, store, dev_rows, host_rows)
        return
    table = g.store_table if store else g.load_table
    dst = np.ascontiguousarray(host_rows if store else dev_rows, dtype=np.int64)
    src = np.ascontiguousarray(dev_rows if store else host_rows, dtype=np.int64)
    n = int(dst.shape[0])
    starts = _split(n, n * int(table[:, 4].sum()))
    step = starts.step if len(starts) > 1 else n
    tab, nseg, d0, s0 = table.ctypes.data, int(table.shape[0]), dst.ctypes.data, src.ctypes.data
    futures = [
        _helpers().submit(native, tab, nseg, d0 + 8 * i, s0 + 8 * i, min(step, n - i))
        for i in starts[1:]
    ]
    native(tab, nseg, d0, s0, min(step, n))
    for f in futures:
        f.result()


def _memmove_rows(
    g: _GroupCopy, store: bool, dev_rows: npt.NDArray[np.int64], host_rows: npt.NDArray[np.int64]
) -> None:
    """The fallback of `_copy_rows`: one libc memmove per (row, segment)."""
    by_width: dict[int, tuple[list[npt.NDArray[np.int64]], list[npt.NDArray[np.int64]]]] = {}
    for s in g.segments:
        width = s.dev.shape[1] * s.dev.element_size()
        dev = s.dev.data_ptr() + dev_rows * (s.dev.stride(0) * s.dev.element_size())
        host = s.host.data_ptr() + host_rows * (s.host.stride(0) * s.host.element_size())
        dsts, srcs = by_width.setdefault(width, ([], []))
        dsts.append(host if store else dev)
        srcs.append(dev if store else host)
    for width, (dst_parts, src_parts) in by_width.items():
        dl = np.concatenate(dst_parts).tolist()
        sl = np.concatenate(src_parts).tolist()
        n = len(dl)
        starts = _split(n, n * width)
        step = starts.step if len(starts) > 1 else n
        futures = [
            _helpers().submit(_memmove_all, dl[i : i + step], sl[i : i + step], width)
            for i in starts[1:]
        ]
        _memmove_all(dl[:step], sl[:step], width)
        for f in futures:
            f.result()
