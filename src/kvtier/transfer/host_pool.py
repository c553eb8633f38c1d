"""The host (CPU) pool: `num_slots` slots, each holding one chunk of one KV-cache group.

A slot is `blocks_per_chunk` *host rows* of `row_bytes = registration.max_page_bytes` each; host
row `slot * blocks_per_chunk + j` holds device block `j` of the chunk, laid out as the group's
page (its segments back to back). Groups with smaller pages leave the row's tail unused, so
`slot_bytes` is exactly `max over groups of blocks_per_chunk * page_bytes(group)`.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
import warnings
import weakref
from typing import NoReturn, Protocol, SupportsIndex

import numpy as np
import torch

from kvtier.base import checked_int
from kvtier.transfer.registration import KVCacheRegistration

logger = logging.getLogger(__name__)


class PoolUser(Protocol):
    """A transfer worker as `HostPool.close` sees it."""

    def _pool_jobs(self) -> list[int] | None:
        """None once it will never again copy to or from the pool (shut down and no copy
        running); else the ids of its jobs whose copies may still run (none: idle, not shut
        down)."""
        ...


_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 1 | 2
"""cudaHostRegisterPortable | cudaHostRegisterMapped: usable by every device, and addressable
from kernels (the CUDA backend's copy kernels read and write the pool directly)."""


class HostPool:
    """Page-aligned host memory of `(num_slots, slot_bytes)` bytes, allocated once.

    Give exactly one of `num_slots` or `byte_budget` (then `num_slots = byte_budget //
    slot_bytes`, no rounding beyond that). `pin=None` pins when CUDA is available; if pinning
    fails the pool stays pageable and one warning is emitted.
    """

    def __init__(
        self,
        registration: KVCacheRegistration,
        blocks_per_chunk: int = 1,
        *,
        num_slots: int | None = None,
        byte_budget: int | None = None,
        pin: bool | None = None,
    ) -> None:
        _check_registration(registration)
        blocks_per_chunk = _positive_int("blocks_per_chunk", blocks_per_chunk)
        if pin is not None and not isinstance(pin, (bool, np.bool_)):
            # bool() would read pin="no" or pin=0.5 as a request to pin.
            raise ValueError(f"pin={pin!r} must be True, False or None (pin when CUDA is there)")
        if (num_slots is None) == (byte_budget is None):
            raise ValueError(
                f"give exactly one of num_slots={num_slots!r} and byte_budget={byte_budget!r}"
            )
        if byte_budget is not None:
            num_slots = self.slots_for_budget(registration, blocks_per_chunk, byte_budget)
        num_slots = _positive_int("num_slots", num_slots)
        self.registration = registration
        self.blocks_per_chunk = blocks_per_chunk
        self.row_bytes = registration.max_page_bytes
        self.slot_bytes = self.slot_bytes_for(registration, blocks_per_chunk)
        self.num_slots = num_slots
        self.nbytes = num_slots * self.slot_bytes
        if self.nbytes > sys.maxsize:
            raise ValueError(
                f"num_slots={num_slots} x {self.slot_bytes}-byte slots (blocks_per_chunk="
                f"{blocks_per_chunk}) is {self.nbytes} bytes, more than any address space"
            )
        # An anonymous mapping is page-aligned and exactly this size; torch's pinned allocator
        # would round the request up to a power of two.
        # MAP_POPULATE faults every page in now: a first write into a never-touched page costs a
        # kernel fault and zero-fill (a 4 MiB store into fresh slots took 10-20x longer than
        # into used ones), which would otherwise land on the first requests to reach each slot.
        # MAP_PRIVATE, as any process memory: a MAP_SHARED pool stayed shared with a forked
        # child, whose own worker's stores then overwrote the parent's slots, and the parent
        # served those bytes as its own. (It also maps 2-8x faster here.) A pinned pool is
        # not inherited at all (`_pin`).
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
        try:
            self._mmap: mmap.mmap | None = mmap.mmap(-1, self.nbytes, flags=flags)
        except OSError as exc:
            raise MemoryError(
                f"could not allocate the host pool: {num_slots} slots x {self.slot_bytes} bytes "
                f"= {self.nbytes / 2**30:.2f} GiB ({exc.strerror}); give a smaller num_slots "
                f"or byte budget (cpu_bytes)"
            ) from exc
        flat = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.tensor: torch.Tensor = flat.view(num_slots, self.slot_bytes)
        """The pool as a uint8 `(num_slots, slot_bytes)` tensor."""
        want_pin = torch.cuda.is_available() if pin is None else bool(pin)
        self.pinned = want_pin and self._pin()
        self.forked = False
        """True in a forked child for a pinned pool, whose memory the child does not have."""
        if self.pinned:
            _pinned_pools.add(self)
        # A pool dropped without close() must still be unregistered before its memory is
        # unmapped: CUDA would otherwise keep the range registered, and the next pool mapped at
        # the same address could not be pinned.
        self._finalizer = (
            weakref.finalize(self, _unregister, self.address, os.getpid()) if self.pinned else None
        )
        if self._finalizer is not None:
            self._finalizer.atexit = False  # process exit frees it; CUDA may be torn down by then
        self.closed = False
        """True once `close()` returned: no worker copies to or from the pool again."""
        self._users: weakref.WeakSet[PoolUser] = weakref.WeakSet()
        """The workers built on the pool (`_add_user`), which `close()` asks."""
        self._users_lock = threading.RLock()  # reentrant: a finalizer may close it meanwhile
        """Held by `close()` from its check of the workers to `closed`, and by `_add_user`:
        a worker built by another thread meanwhile is refused, not left on a closed pool."""

    @staticmethod
    def slot_bytes_for(registration: KVCacheRegistration, blocks_per_chunk: int) -> int:
        """Bytes of one slot: `blocks_per_chunk` rows of the registration's largest page."""
        # Checked here too, as it is public: 0 or a negative count gave a 0 or negative size,
        # and a numpy integer wrapped around (np.int64(2**60) gave 0).
        _check_registration(registration)
        blocks_per_chunk = _positive_int("blocks_per_chunk", blocks_per_chunk)
        return blocks_per_chunk * registration.max_page_bytes

    @staticmethod
    def slots_for_budget(
        registration: KVCacheRegistration, blocks_per_chunk: int, byte_budget: int
    ) -> int:
        """Number of slots that fit in `byte_budget` bytes (exact, no rounding up)."""
        _check_registration(registration)
        blocks_per_chunk = _positive_int("blocks_per_chunk", blocks_per_chunk)
        byte_budget = _positive_int("byte_budget", byte_budget)
        slot_bytes = HostPool.slot_bytes_for(registration, blocks_per_chunk)
        if byte_budget < slot_bytes:
            raise ValueError(
                f"byte_budget={byte_budget} is smaller than one slot ({slot_bytes} bytes = "
                f"{blocks_per_chunk} blocks x {registration.max_page_bytes} bytes)"
            )
        return byte_budget // slot_bytes

    @property
    def rows(self) -> torch.Tensor:
        """The pool as `(num_slots * blocks_per_chunk, row_bytes)`: one row per device block."""
        return self.tensor.view(self.num_slots * self.blocks_per_chunk, self.row_bytes)

    @property
    def address(self) -> int:
        """Address of the first byte (page-aligned)."""
        return int(self.tensor.data_ptr())

    def _pin(self) -> bool:
        """Page-lock the pool for DMA; on failure warn once and stay pageable."""
        registered = False
        try:
            if not torch.cuda.is_available():
                raise RuntimeError("CUDA is not available")
            err = int(
                torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
                    self.address, self.nbytes, _CUDA_HOST_REGISTER_PORTABLE_MAPPED
                )
            )
            if err != 0:
                _clear_cuda_error()
                raise RuntimeError(f"cudaHostRegister returned error {err}")
            registered = True
            # Not inherited by a forked child: its copy-on-write would give the first writer
            # after the fork a new page, and where the driver does not pin pages for fork (old
            # kernels or drivers) that writer could be this process, with the device still
            # reading and writing the child's page: slots served with stale bytes.
            if self._mmap is not None and hasattr(mmap, "MADV_DONTFORK"):
                self._mmap.madvise(mmap.MADV_DONTFORK)
        except Exception as exc:
            if registered:
                # A pageable pool is never unregistered, so a registration left here (madvise
                # failed after it) outlived the pool and kept a later one at its address from
                # being pinned.
                _unregister(self.address, os.getpid())
            warnings.warn(
                f"could not pin the {self.nbytes}-byte host pool ({exc}); using pageable memory, "
                "so host<->device copies will be slower",
                RuntimeWarning,
                stacklevel=3,
            )
            return False
        return True

    def _add_user(self, worker: PoolUser) -> None:
        """Record a transfer worker built on the pool (once, as its construction ends), for
        `close()`; held weakly. Raises ValueError where the pool was closed after the worker's
        `check_pool` (by another thread): its copies would go to an unpinned pool."""
        with self._users_lock:
            if self.closed:
                raise ValueError(
                    "this host pool was closed while a transfer worker was built on it; "
                    "expected an open HostPool (create a new one)"
                )
            self._users.add(worker)

    def close(self) -> None:
        """Unpin the pool; the memory itself goes when the last view of it is dropped. Closing
        again does nothing.

        Raises RuntimeError, leaving the pool open (and pinned) as it was, while a transfer
        worker built on it is not shut down or still has copies running: they read and write
        the pool by address, and a GPU's copies fault once it is unpinned. Shut the workers
        down first (`shutdown()` waits for the copies running and fails the queued jobs)."""
        with self._users_lock:  # a second close() returns once this one has decided
            if self.closed:
                return
            busy = [(w, jobs) for w in list(self._users) if (jobs := w._pool_jobs()) is not None]
            if busy:
                named = "; ".join(
                    f"{type(w).__name__} at {id(w):#x} ("
                    + (f"jobs {jobs} queued or copying" if jobs else "idle, not shut down")
                    + ")"
                    for w, jobs in busy
                )
                raise RuntimeError(
                    f"cannot close the host pool: transfer workers still use it: {named}; call "
                    "their shutdown() first (an interrupted one: again), then close the pool"
                )
            self.closed = True
        if self.pinned:
            self.pinned = False
            if self._finalizer is not None:
                self._finalizer()
        self._mmap = None

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        # copy.copy made a second pool over the same memory, pin and finalizer, which the
        # first one's close() then unpinned under it; pickle failed on a bare "cannot pickle
        # 'mmap.mmap' object".
        raise not_copyable(self)

    def __repr__(self) -> str:
        return (
            f"HostPool(num_slots={self.num_slots}, slot_bytes={self.slot_bytes}, "
            f"blocks_per_chunk={self.blocks_per_chunk}, pinned={self.pinned})"
        )


_pinned_pools: weakref.WeakSet[HostPool] = weakref.WeakSet()


def _forked_child() -> None:
    """Mark the pinned pools a forked child inherited: their memory is not mapped here
    (MADV_DONTFORK), so a worker built on one is refused rather than fault on it."""
    for pool in list(_pinned_pools):
        pool.forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked_child)


def _unregister(address: int, pid: int) -> None:
    if os.getpid() != pid:
        return  # a forked child's copy of the pool: nothing of it is registered, or mapped, here
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    err = int(cudart.cudaHostUnregister(address))
    if err != 0:
        _clear_cuda_error()
        logger.warning("cudaHostUnregister failed with error %d", err)


def _clear_cuda_error() -> None:
    """Reset CUDA's last-error slot: a failed register call leaves its error there, and torch
    would report it at its next kernel launch as if that launch had failed."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


def not_copyable(obj: object) -> TypeError:
    """The error for pickling or copying a pool or a transfer worker: each owns memory, pins or
    threads of this process, which a copy would share (and free, or stop, under the other)."""
    kind = type(obj).__name__
    return TypeError(
        f"a {kind} cannot be pickled or copied: it holds memory (a worker also threads) of "
        f"this process, which a copy would share; create a new {kind} where one is needed"
    )


def _check_registration(registration: object) -> None:
    if not isinstance(registration, KVCacheRegistration):
        raise TypeError(
            f"registration must be a KVCacheRegistration, got {type(registration).__name__}"
        )


def _positive_int(name: str, value: object) -> int:
    """`value` as a positive int; numpy's and 0-d integer tensors too, as everywhere else."""
    try:
        return checked_int(name, value, 1)
    except ValueError:
        raise ValueError(f"{name}={value!r} must be a positive int") from None
