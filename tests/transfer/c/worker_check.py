"""`CUDATransferWorker` itself, compiled path, over c/fake_cuda.c: run by test_native_c.py with
the fake as the `libcuda.so.1` on LD_LIBRARY_PATH. Only what needs a GPU is stood in: torch's
CUDA calls (streams, the current stream, device properties, the device copy of the segment
tables, the mapping of the pinned pool) and NVRTC. Everything from the worker's Python down to
the driver calls runs as on a GPU, and the fake moves the bytes in host memory.

It checks the worker's side of the contract on both submit routes (the extension, and ctypes
for ids the extension does not read), the planner's errors, a failed job, `wait` from another
thread while jobs are submitted, and shutdown with jobs in flight. Argument: the launch
threads' depth (0: none). Prints "ok" when every check passes.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import types
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from kvtier.transfer import HostPool, KVCacheRegistration, KVTensor, cuda_engine, cuda_worker, nvrtc
from kvtier.transfer.cuda_worker import CUDATransferWorker
from kvtier.transfer.testing import assert_block_equals, make_layout, snapshot

COMPUTE = 9  # the fake's stream handle for "compute"
FAKE = ctypes.CDLL("libcuda.so.1")  # the library the engine opened: the same instance


class _Stream:
    """torch.cuda.Stream's part the worker uses: a handle the fake knows, and synchronize."""

    _next = 1

    def __init__(self, device: object = None) -> None:
        self.cuda_stream = _Stream._next
        _Stream._next += 1

    def synchronize(self) -> None:
        FAKE.cuStreamSynchronize(ctypes.c_void_p(self.cuda_stream))


class _Tables:
    """torch.from_numpy's result for the segment tables: `.to(device)` stays in host memory,
    where the fake's kernel reads it."""

    def __init__(self, array: np.ndarray) -> None:
        self._tensor = torch.from_numpy(array)

    def to(self, device: object) -> torch.Tensor:
        return self._tensor


def stand_in_for_the_gpu(pool: HostPool) -> None:
    """Replace the torch CUDA calls of cuda_worker and cuda_engine (their module's `torch`)."""
    real = torch
    cuda = types.SimpleNamespace(
        Stream=_Stream,
        current_stream=lambda device=None: types.SimpleNamespace(cuda_stream=COMPUTE),
        get_device_capability=lambda device=None: (9, 0),
        get_device_properties=lambda device=None: types.SimpleNamespace(multi_processor_count=2),
        device=lambda device=None: nullcontext(),
        synchronize=lambda device=None: None,
    )

    def as_tensor(obj: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(obj, cuda_worker._DevicePointer):
            return pool.tensor  # the mapping of the pinned pool: the pool itself, here
        return real.as_tensor(obj, **kwargs)

    class _Torch(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    fake = _Torch("torch")
    fake.cuda = cuda  # type: ignore[attr-defined]
    fake.as_tensor = as_tensor  # type: ignore[attr-defined]
    fake.from_numpy = _Tables  # type: ignore[attr-defined]
    fake._C = types.SimpleNamespace()  # type: ignore[attr-defined]  # no raw-stream call
    cuda_worker.torch = fake  # type: ignore[attr-defined]
    cuda_engine.torch = fake  # type: ignore[attr-defined]
    nvrtc.cubin = lambda capability: b"image"


def fake_cuda_worker(
    pages: int = 1, num_slots: int = 8, seed: int = 5, **options: Any
) -> tuple[CUDATransferWorker, list[KVTensor]]:
    """A compiled-path `CUDATransferWorker` (kernel copies, `options` added) over the stand-in
    driver, for a flash layout's tensors made on the CPU, returned too."""
    kvs = make_layout("flash", torch.float16, "cpu", seed=seed)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, pages, num_slots=num_slots, pin=False)
    reg.device = torch.device("cuda", 0)  # as the worker will see it
    pool.pinned = True
    stand_in_for_the_gpu(pool)
    worker = CUDATransferWorker(reg, pool, **{"copy_mode": "kernel", "compiled": True, **options})
    return worker, kvs


def main(depth: int) -> None:
    w, kvs = fake_cuda_worker(2, 12, coalesce_depth=depth)
    reg, pool = w.registration, w.pool
    before = snapshot(kvs)

    def fail_seven(job_id: int, direction: str) -> None:
        if job_id == 7:
            raise RuntimeError("injected")

    assert w.copy_path == "compiled" and w.coalesce_depth == depth
    assert w._ext_submit is not None, "the submit extension did not build"

    # Stores through the extension (lists) and through ctypes (numpy scalars it does not read).
    w.submit_store(1, [0, 1, 2, 3], [0, 1])
    w.submit_store(2, [np.int64(4), np.int64(5)], [np.int64(2)])  # type: ignore[list-item]
    w.submit_store(3, np.arange(6, 10), np.array([3, 4]))
    bad_submits: tuple[Callable[[], None], ...] = (
        lambda: w.submit_store(4, [10, 11], [12]),
        lambda: w.submit_store(3, [10], [5]),
    )
    for bad in bad_submits:
        try:
            bad()
        except ValueError:
            pass
        else:
            raise AssertionError("a bad submit was not refused")
    w.wait([1, 2, 3])
    got = sorted((r.job_id, r.success, r.bytes) for r in w.get_finished())
    page = reg.page_bytes(0)
    assert got == [(1, True, 4 * page), (2, True, 2 * page), (3, True, 4 * page)], got

    # Loads from mid-chunk, one urgent, waited for from another thread while more go in.
    w.submit_load(10, [0, 1], [30, 31, 32], skip_blocks=1)
    waiter = threading.Thread(target=w.wait, args=([10],))
    waiter.start()
    w.submit_load(11, [2], [33, 34])
    w.submit_load(12, np.array([3, 4]), np.array([35, 36, 37, 38]), urgent=True)
    waiter.join(60)
    assert not waiter.is_alive(), "wait() did not return"
    w.wait([11, 12])
    got = sorted((r.job_id, r.success, r.bytes) for r in w.get_finished())
    assert got == [(10, True, 3 * page), (11, True, 2 * page), (12, True, 4 * page)], got
    for dst, src in zip(range(30, 39), [1, 2, 3, 4, 5, 6, 7, 8, 9], strict=True):
        assert_block_equals(kvs, dst, before[src])

    # Shutdown with jobs in flight: every job reported once, then submits refused.
    for j in range(20, 26):
        w.submit_store(j, [2 * (j - 20), 2 * (j - 20) + 1], [j - 14])
    w.shutdown()
    assert sorted(r.job_id for r in w.get_finished() if r.success) == list(range(20, 26))
    try:
        w.submit_store(30, [0, 1], [0])
    except RuntimeError:
        pass
    else:
        raise AssertionError("a submit after shutdown was accepted")

    # The fault injector's path (planned in Python, queued with submit_rows): job 7 fails.
    with CUDATransferWorker(
        reg, pool, copy_mode="kernel", compiled=True, coalesce_depth=depth,
        fault_injector=fail_seven,
    ) as f:  # fmt: skip
        f.submit_store(6, [12, 13], [10])
        f.submit_store(7, [14, 15], [11])
        f.submit_store(9, [16, 17], [9])  # the store lane goes on after the failure
        # A slot is loaded only once its store is reported (the contract): the load lane
        # does not wait for the store lane, and with launch threads it may overtake it.
        f.wait([6, 7, 9])
        ok = {r.job_id: (r.success, r.bytes) for r in f.get_finished()}
        f.submit_load(8, [10], [40, 41])
        f.wait([8])
        ok.update({r.job_id: (r.success, r.bytes) for r in f.get_finished()})
    want = {6: (True, 2 * page), 7: (False, 0), 9: (True, 2 * page), 8: (True, 2 * page)}
    assert ok == want, ok
    assert_block_equals(kvs, 40, before[12])
    assert_block_equals(kvs, 41, before[13])
    pool.pinned = False
    pool.close()
    print("ok")


if __name__ == "__main__":
    main(int(sys.argv[1]))
