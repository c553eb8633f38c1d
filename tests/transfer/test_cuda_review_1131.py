"""Review of the CUDA worker (2026-11-28, the loose ends of earlier reviews), without a GPU where
the compiled engine runs over c/fake_cuda.c and the torch-ops path over stand-in streams and
events; the `gpu` tests are their twins on a device.

- `wait` blocked in one call into C (`kvt_cuda_wait`): a Ctrl-C was not seen until the copies
  ended, or ever where they never did. It now waits in slices (`kvt_cuda_wait_for`).
- In a forked child, `get_finished` called into the parent's CUDA driver state (and could block
  on the engine's mutex, held by a parent's thread at the fork). It now raises, naming the fork.
- A worker dropped without `shutdown()` freed what its queued copies used: on the compiled path
  its pool went before its engine waited for the copies; on the torch-ops path nothing waited,
  and the lanes' index and staging buffers went back to torch's allocator under them.
- On the torch-ops path, a CUDA call that raised before the job was recorded (the lane's wait
  for compute, its start event) lost the job's index buffer and events for good; one that raised
  recording its end event left the job to be reported, and its buffer reused, while its copies
  could still run.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time
import types
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from helpers import FORK_WITH_A_STORE_IN_FLIGHT, gpu_cuda_worker, run_over_fake_cuda
from kvtier.base import TransferResult
from kvtier.transfer import HostPool, KVCacheRegistration, cuda_worker
from kvtier.transfer.cuda_worker import CUDATransferWorker
from kvtier.transfer.testing import make_layout

# ---- the compiled engine over the stand-in driver (child processes) ----

INTERRUPTED_WAIT = r"""
import os, signal, sys, threading, time

from worker_check import FAKE, fake_cuda_worker

w, _ = fake_cuda_worker(2, 12, coalesce_depth=int(sys.argv[1]))
store = w._streams[0].cuda_stream
w.submit_store(1, [0, 1], [0])
w.wait([1])  # done: no waiter thread needed
FAKE.fake_hold(store, 1)  # the lane's copies cannot run: a long or stuck kernel
w.submit_store(2, [2, 3], [1])
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
start = time.monotonic()
try:
    w.wait([2])
    print("wait returned", flush=True)
except KeyboardInterrupt:
    print("interrupted after", "under 3 s" if time.monotonic() - start < 3 else "3 s or more")
FAKE.fake_hold(store, 0)
w.wait([2])  # the job is still held, and waited for
print("results", sorted((r.job_id, r.success) for r in w.get_finished()), flush=True)
w.shutdown()
"""


@pytest.mark.parametrize("depth", [0, 2])
def test_a_ctrl_c_ends_a_compiled_wait_for_copies_that_do_not_end(
    tmp_path: Path, depth: int
) -> None:
    """Old: the wait sat in the stand-in driver's synchronize until it gave up (10 s), and
    the KeyboardInterrupt came only then."""
    out = run_over_fake_cuda(tmp_path, INTERRUPTED_WAIT, str(depth), timeout=120)
    lines = out.splitlines()
    assert "interrupted after under 3 s" in lines, out
    assert "results [(1, True), (2, True)]" in lines, out


# The driver's calls that make a context current, counted per process: the first call of any
# engine entry point (peek, wait, submit) is one.
PID_DRIVER = r"""
#define cuCtxGetCurrent fake_ctx_get_current
#include "fake_cuda.c"
#undef cuCtxGetCurrent
#include <unistd.h>

static volatile int last_pid;

int fake_last_pid(void) { return last_pid; }

CUresult cuCtxGetCurrent(void **ctx) {
    last_pid = getpid();
    return fake_ctx_get_current(ctx);
}
"""

FORKED_GET_FINISHED = (
    r"""
import os, signal, sys

from worker_check import FAKE, fake_cuda_worker
"""
    + FORK_WITH_A_STORE_IN_FLIGHT
    + r"""    try:
        seen = ("returned", [r.job_id for r in w.get_finished()])
    except RuntimeError as exc:
        seen = ("refused", "forked" in str(exc))
    touched = FAKE.fake_last_pid() == os.getpid()
    print("child", seen, "driver called" if touched else "driver untouched", flush=True)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
w.wait([2])
print("parent", [(r.job_id, r.success) for r in w.get_finished()], flush=True)
w.shutdown()
"""
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("depth", [0, 2])
def test_get_finished_in_a_forked_child_raises_without_touching_cuda(
    tmp_path: Path, depth: int
) -> None:
    """Old: the child's get_finished asked the parent's events through the driver and
    reported the parent's jobs there."""
    out = run_over_fake_cuda(tmp_path, FORKED_GET_FINISHED, str(depth), wrapper=PID_DRIVER)
    lines = out.splitlines()
    assert "child ('refused', True) driver untouched" in lines, out
    assert "child exit 0" in lines, out
    assert "parent [(1, True), (2, True)]" in lines, out


DROPPED_WITH_POOL = r"""
import ctypes, gc, sys, weakref

import torch
from worker_check import fake_cuda_worker

from kvtier.transfer import cuda_worker

w, kvs = fake_cuda_worker(2, 12, coalesce_depth=int(sys.argv[1]))
pool = w.pool


def alias(obj, **kwargs):
    # The mapping of the pinned pool without a reference to the pool (worker_check's holds it).
    address, _ = obj.__cuda_array_interface__["data"]
    n = obj.__cuda_array_interface__["shape"][0]
    return torch.frombuffer((ctypes.c_uint8 * n).from_address(address), dtype=torch.uint8)


cuda_worker.torch.as_tensor = alias
w.shutdown()
w = cuda_worker.CUDATransferWorker(w.registration, pool, copy_mode="kernel", compiled=True,
                                   coalesce_depth=int(sys.argv[1]))
slots = pool.tensor  # keeps the memory mapped here, to read it as the pool goes
seen = []
weakref.finalize(pool, lambda: seen.append(bool(slots[0].any())))
w.submit_store(1, [4, 5], [0])  # queued: the stand-in runs it at the engine's sync
del pool, w  # as an owner of both drops them (a connector that made the pool first)
gc.collect()
print("pool freed", "after the copy" if seen == [True] else f"before the copy {seen}", flush=True)
"""


@pytest.mark.parametrize("depth", [0, 2])
def test_a_compiled_worker_dropped_with_its_pool_frees_the_pool_after_its_copies(
    tmp_path: Path, depth: int
) -> None:
    """Old: the worker's attributes went in order, the pool (unpinned, unmapped) before the
    engine, whose finalizer waits for the copies."""
    out = run_over_fake_cuda(tmp_path, DROPPED_WITH_POOL, str(depth), timeout=120)
    assert "pool freed after the copy" in out.splitlines(), out


# ---- the torch-ops path over stand-in streams and events ----


class _Gpu:
    """The stand-in device of the torch-ops path: a stream's recorded events are reached when
    it is synchronized; the CUDA calls named in `fail` raise once each."""

    def __init__(self) -> None:
        self.fail: set[str] = set()
        self.queries = 0

    def check(self, call: str) -> None:
        if call in self.fail:
            self.fail.discard(call)
            raise RuntimeError(f"CUDA error: {call} refused (stand-in)")


class _Stream:
    def __init__(self, gpu: _Gpu) -> None:
        self.gpu = gpu
        self.cuda_stream = 1
        self.pending: list[_Event] = []

    def wait_stream(self, other: object) -> None:
        self.gpu.check("wait_stream")

    def synchronize(self) -> None:
        for event in self.pending:
            event.done = True
        self.pending.clear()


class _Event:
    def __init__(self, gpu: _Gpu) -> None:
        self.gpu = gpu
        self.done = True  # torch: an event never recorded queries as done

    def record(self, stream: _Stream) -> None:
        self.gpu.check("record")
        self.done = False
        self.stream = stream
        stream.pending.append(self)

    def query(self) -> bool:
        self.gpu.queries += 1
        return self.done

    def elapsed_time(self, end: _Event) -> float:
        return 1.0

    def synchronize(self) -> None:
        self.stream.synchronize()


@contextlib.contextmanager
def _current(stream: object) -> Iterator[None]:
    yield


def _empty(*shape: Any, **kwargs: Any) -> torch.Tensor:
    kwargs.pop("pin_memory", None)
    kwargs.pop("device", None)
    return torch.empty(*shape, **kwargs)


def torch_ops_worker(monkeypatch: pytest.MonkeyPatch) -> tuple[CUDATransferWorker, _Gpu]:
    """A torch-ops `CUDATransferWorker` over a flash layout on the CPU, its torch CUDA calls
    stood in (`_Gpu`): the copies themselves run at once, in host memory."""
    gpu = _Gpu()
    kvs = make_layout("flash", torch.float16, "cpu", seed=7)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 1, num_slots=8, pin=False)
    reg.device = torch.device("cuda", 0)
    pool.pinned = True

    class _Torch(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

    fake = _Torch("torch")
    fake.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        Stream=lambda device=None: _Stream(gpu),
        Event=lambda enable_timing=False: _Event(gpu),
        current_stream=lambda device=None: None,
        stream=_current,
        is_current_stream_capturing=lambda: False,
    )
    slots = pool.tensor  # not the pool: the test sees it collected
    fake.as_tensor = lambda obj, **kw: slots.view(-1)  # type: ignore[attr-defined]
    fake.empty = _empty  # type: ignore[attr-defined]
    monkeypatch.setattr(cuda_worker, "torch", fake)
    monkeypatch.setattr(
        cuda_worker, "stage_buffer", lambda stage, n, *a: torch.empty(n, dtype=torch.uint8)
    )
    w = CUDATransferWorker(reg, pool, compiled=False, copy_mode="kernel")
    assert w.copy_path == "torch"
    return w, gpu


def test_a_torch_ops_submit_refused_before_its_record_keeps_its_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Old: the index buffer and both events taken for the job were never given back."""
    w, gpu = torch_ops_worker(monkeypatch)
    gpu.fail = {"wait_stream"}
    with pytest.raises(RuntimeError, match="wait_stream refused"):
        w.submit_store(1, [0], [0])
    assert not w.holds(1)
    (buf,) = w._indices._free[1024]
    assert len(w._events) == 2
    w.submit_store(1, [0], [0])  # the same id, and the same buffer
    assert w._by_id[1].indices is buf
    w.wait([1])
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
    assert w._indices._free[1024] == [buf]
    w.shutdown()


def test_a_torch_ops_job_whose_end_event_fails_is_failed_after_its_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Old: the end event kept its older state, so the job was reported done (success) at
    once, its index buffer handed on while its copies could still run."""
    w, _ = torch_ops_worker(monkeypatch)
    w.submit_store(1, [0], [0])  # the end event that job 2 takes from the pool was recorded
    w.wait([1])
    assert [r.job_id for r in w.get_finished()] == [1]
    lane = w._lanes["store"]
    real_record = _Event.record
    calls = [0]

    def record_fails_second(self: _Event, stream: _Stream) -> None:
        calls[0] += 1
        if calls[0] == 2:  # the job's end event (its start is the first)
            raise RuntimeError("CUDA error: record refused (stand-in)")
        real_record(self, stream)

    monkeypatch.setattr(_Event, "record", record_fails_second)
    with pytest.raises(RuntimeError, match="record refused"):
        w.submit_store(2, [1], [1])
    assert w.holds(2)
    stream: Any = lane.stream
    synced = not stream.pending  # the job's copies ended before it can be reported
    assert w.get_finished() == [TransferResult(2, False, 0, 0.0)]
    assert synced
    monkeypatch.setattr(_Event, "record", real_record)
    w.submit_store(3, [2], [2])  # the lane goes on
    w.wait([3])
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(3, True)]
    w.shutdown()


def test_a_torch_ops_worker_dropped_with_copies_in_flight_waits_for_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Old: nothing waited; the index buffer and the pool went while the copies ran."""
    w, _ = torch_ops_worker(monkeypatch)
    w.submit_store(1, [0], [0])
    record: Any = w._by_id[1]
    end = record.end
    freed: list[tuple[str, bool]] = []
    weakref.finalize(record.indices.device, lambda: freed.append(("index", end.done)))
    weakref.finalize(w.pool, lambda: freed.append(("pool", end.done)))
    del w, record
    gc.collect()
    assert sorted(freed) == [("index", True), ("pool", True)]


def test_get_finished_on_a_torch_ops_worker_in_a_forked_child_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Marked as `_forked_child` marks it (a real fork is the compiled test's): old, it asked
    the parent's events from the child."""
    w, gpu = torch_ops_worker(monkeypatch)
    w.submit_store(1, [0], [0])
    w._forked = True
    before = gpu.queries
    with pytest.raises(RuntimeError, match="forked"):
        w.get_finished()
    assert gpu.queries == before and w.holds(1)
    w._forked = False
    w.wait([1])
    assert [r.job_id for r in w.get_finished()] == [1]
    w.shutdown()


# ---- on a GPU ----


def _gpu_worker(compiled: bool) -> tuple[CUDATransferWorker, HostPool]:
    reg = KVCacheRegistration(make_layout("flash", torch.float16, "cuda", seed=2))
    return gpu_cuda_worker(reg, compiled)


class _CtrlC(Exception):
    """Raised by the test's SIGINT handler: a KeyboardInterrupt that came late would end the
    whole session instead of failing this test."""


def _raise_ctrl_c(signum: int, frame: object) -> None:
    raise _CtrlC


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_ctrl_c_ends_a_compiled_wait_on_a_gpu() -> None:
    """The store waits for about 2 s of compute; the signal comes at 0.2 s."""
    w, pool = _gpu_worker(True)
    previous = signal.signal(signal.SIGINT, _raise_ctrl_c)
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
    try:
        cycles_per_ms = torch.cuda.get_device_properties(0).clock_rate  # kHz
        torch.cuda._sleep(2000 * cycles_per_ms)  # type: ignore[no-untyped-call]
        w.submit_store(1, [0], [0])
        timer.start()
        start = time.monotonic()
        with pytest.raises(_CtrlC):
            w.wait([1])
        assert time.monotonic() - start < 1.5
        w.wait([1])
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGINT, previous)
        w.shutdown()
        pool.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_torch_ops_submit_refused_before_its_record_keeps_its_buffers_on_a_gpu() -> None:
    w, pool = _gpu_worker(False)
    try:
        lane = w._lanes["store"]
        real = lane.stream

        class _Refusing:
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

            def wait_stream(self, other: object) -> None:
                raise RuntimeError("CUDA error: refused (test)")

        lane.stream = _Refusing()  # type: ignore[assignment]
        with pytest.raises(RuntimeError, match="refused"):
            w.submit_store(1, [0], [0])
        lane.stream = real
        assert not w.holds(1)
        (buf,) = w._indices._free[1024]
        w.submit_store(1, np.array([0]), np.array([0]))
        assert w._by_id[1].indices is buf
        w.wait([1])
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
    finally:
        w.shutdown()
        pool.close()
