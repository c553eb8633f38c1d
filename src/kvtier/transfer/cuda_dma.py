"""Scattered block copies on the GPU's copy engines: one `cuMemcpyBatchAsync` per job.

The driver function (CUDA 12.8+) takes arrays of destination and source addresses and sizes
and queues every copy on one stream in a single call, so a job of any number of blocks costs
one call into the driver instead of one per block and segment. It is looked up at run time with
`cuGetProcAddress` from the driver library that torch already loaded; where it is missing,
`available()` is False and the CUDA backend uses its kernels instead. The compiled path
(`cuda_engine`) calls the function found here from C; `DmaCopier` is the torch-ops path's.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import numpy.typing as npt

from kvtier.transfer.plan import Direction, Job
from kvtier.transfer.registration import KVCacheRegistration

logger = logging.getLogger(__name__)

_SRC_ACCESS_ORDER_STREAM = 1
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2


class _Attributes(ctypes.Structure):
    """CUmemcpyAttributes: access order, source and destination location hints, flags."""

    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_type", ctypes.c_int),
        ("src_id", ctypes.c_int),
        ("dst_type", ctypes.c_int),
        ("dst_id", ctypes.c_int),
        ("flags", ctypes.c_uint),
    ]


_Fn = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,  # dsts
    ctypes.c_void_p,  # srcs
    ctypes.c_void_p,  # sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p,  # attrs
    ctypes.c_void_p,  # attrsIdxs
    ctypes.c_size_t,  # numAttrs
    ctypes.c_void_p,  # stream (13.0 signature; 12.8 has a failIdx pointer before it)
)
_Fn12 = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p,
)  # fmt: skip

_cached: tuple[object, bool] | None = None
_looked_up = False
"""Whether `_cached` holds the answer, a failed lookup's None too: it opened libcuda (or
searched the library path for it) again on every call."""
_NOT_INITIALIZED = 3
"""CUDA_ERROR_NOT_INITIALIZED: a driver that may answer once CUDA is set up, so not cached."""


def _lookup() -> tuple[object, bool] | None:
    """The driver's cuMemcpyBatchAsync and whether it has the CUDA 13 signature."""
    global _cached, _looked_up
    if _looked_up or _cached is not None:
        return _cached
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        err = lib.cuDriverGetVersion(ctypes.byref(version))
        if err != 0:
            _looked_up = err != _NOT_INITIALIZED
            return None
        new = version.value >= 13000
        get = lib.cuGetProcAddress_v2
        get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                        ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]  # fmt: skip
        pfn, status = ctypes.c_void_p(), ctypes.c_int()
        want = 13000 if new else 12080
        err = get(b"cuMemcpyBatchAsync", ctypes.byref(pfn), want, 0, ctypes.byref(status))
        if err != 0 or not pfn.value:
            _looked_up = err != _NOT_INITIALIZED
            return None
        _cached = ((_Fn if new else _Fn12)(pfn.value), new)
    except (OSError, AttributeError):
        _cached = None  # no driver library, or one without these entry points
    _looked_up = True
    return _cached


def available() -> bool:
    """Whether the driver offers batched copies."""
    return _lookup() is not None


class DmaCopier:
    """Copies a job's (row, segment) pieces with one batched driver call on a given stream."""

    def __init__(self, registration: KVCacheRegistration, host_address: int, row_bytes: int,
                 device_index: int) -> None:  # fmt: skip
        found = _lookup()
        if found is None:
            raise RuntimeError("this CUDA driver has no cuMemcpyBatchAsync (CUDA 12.8+)")
        self._fn, self._new = found
        self._segments: dict[int, list[tuple[int, int, int, int]]] = {}
        for g in registration.groups:
            col, segs = 0, []
            for s in registration.segments(g):
                segs.append((s.address, s.stride, s.width, col))
                col += s.width
            self._segments[g] = segs
        self._host = host_address
        self._row_bytes = row_bytes
        self._attrs = {
            Direction.STORE: _Attributes(_SRC_ACCESS_ORDER_STREAM, _LOCATION_DEVICE,
                                         device_index, _LOCATION_HOST, 0, 0),
            Direction.LOAD: _Attributes(_SRC_ACCESS_ORDER_STREAM, _LOCATION_HOST, 0,
                                        _LOCATION_DEVICE, device_index, 0),
        }  # fmt: skip
        self._zero = (ctypes.c_size_t * 1)(0)
        self._fail = ctypes.c_size_t(0)

    def mean_copy_bytes(self, job: Job) -> float:
        """Bytes of one of the job's copies, on average (a copy per block and segment)."""
        return job.nbytes / max(1, len(job) * len(self._segments[job.group]))

    def run(self, job: Job, stream_handle: int) -> None:
        """Queue every copy of `job` on the stream; raises if the driver refuses the batch."""
        if len(job) == 0:
            return  # the driver refuses a batch of no copies: such a job failed on this path
        dev_parts, host_parts, sizes = [], [], []
        for address, stride, width, col in self._segments[job.group]:
            dev_parts.append(address + job.dev_rows * stride)
            host_parts.append(self._host + job.host_rows * self._row_bytes + col)
            sizes.append(np.full(len(job), width, dtype=np.uint64))
        dev = np.concatenate(dev_parts).astype(np.uint64)
        host = np.concatenate(host_parts).astype(np.uint64)
        size = np.concatenate(sizes)
        dst, src = (host, dev) if job.direction is Direction.STORE else (dev, host)
        self._call(dst, src, size, self._attrs[job.direction], stream_handle)

    def _call(self, dst: npt.NDArray[np.uint64], src: npt.NDArray[np.uint64],
              size: npt.NDArray[np.uint64], attr: _Attributes, stream: int) -> None:  # fmt: skip
        args = (dst.ctypes.data, src.ctypes.data, size.ctypes.data, int(dst.shape[0]),
                ctypes.addressof(attr), ctypes.addressof(self._zero), 1)  # fmt: skip
        if self._new:
            err = self._fn(*args, stream)  # type: ignore[operator]
        else:
            err = self._fn(*args, ctypes.addressof(self._fail), stream)  # type: ignore[operator]
        if err != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync failed with CUresult {err}")
