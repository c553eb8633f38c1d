"""Transfer follow-ups: `HostPool.close()` refused while a worker built on the pool may still
copy (it unpinned the pool under running copies, and a later submit wrote into a closed pool),
the torch-ops CUDA path's waits in slices (a Ctrl-C was not seen until the copies ended), its
shutdown after a failed stream sync (the RuntimeError escaped, the jobs held for good), and
the DMA lookup's failure cached. Without a GPU, the CUDA parts run over stand-in events,
streams and engines; the GPU tests check the same on a device."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from helpers import FakeCudaEvent, gpu_cuda_worker, run_over_fake_cuda, small_worker
from kvtier.base import TransferResult
from kvtier.transfer import HostPool, NativeCPUTransferWorker, cuda_dma, native_worker
from kvtier.transfer.cuda_worker import CUDATransferWorker, _Live, _Record
from kvtier.transfer.worker import TransferWorker

# ---- HostPool.close() while a CPU worker copies ----


def _pool_bytes(w: TransferWorker) -> np.ndarray[Any, Any]:
    return w.pool.tensor.numpy().copy()


@pytest.mark.parametrize("native", [False, True], ids=["python", "compiled"])
def test_close_is_refused_while_a_worker_on_the_pool_copies_or_is_open(native: bool) -> None:
    """Job 1 is copying (held in the fault injector), job 2 queued behind it: close() names
    both and leaves the pool open; once they ended it names the idle worker; after shutdown()
    it closes, and nothing writes into the pool after that."""
    entered, gate = threading.Event(), threading.Event()

    def held(job_id: int, direction: str) -> None:
        entered.set()
        gate.wait(10)

    w = small_worker(native, held)
    pool = w.pool
    w.registration.tensors[0].tensor.fill_(7)
    try:
        w.submit_store(1, [0], [0])
        w.submit_store(2, [1], [1])
        assert entered.wait(10)
        with pytest.raises(RuntimeError, match=rf"{type(w).__name__} at .*jobs \[1, 2\]"):
            pool.close()
        assert not pool.closed
        gate.set()
        w.wait([1, 2])
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True), (2, True)]
        assert (pool.tensor[:2] == 7).all()  # the copies ran into the open pool
        with pytest.raises(RuntimeError, match="idle, not shut down"):
            pool.close()
    finally:
        gate.set()
        w.shutdown()
    pool.close()
    assert pool.closed
    pool.close()  # closing again does nothing
    after = _pool_bytes(w)
    with pytest.raises(RuntimeError, match="shut down"):
        w.submit_store(3, [2], [2])
    time.sleep(0.05)
    assert (after == _pool_bytes(w)).all() and not w.holds(3)


@pytest.mark.parametrize("native", [False, True], ids=["python", "compiled"])
def test_close_is_refused_while_a_worker_shut_down_from_its_copy_thread_still_copies(
    native: bool,
) -> None:
    """shutdown() from the fault injector returns at once while the job goes on: close()
    from another thread names that job until it has ended, and never hangs."""
    shut, gate = threading.Event(), threading.Event()
    workers: list[TransferWorker] = []

    def stop_then_hold(job_id: int, direction: str) -> None:
        workers[0].shutdown()
        shut.set()
        gate.wait(10)

    w = small_worker(native, stop_then_hold)
    workers.append(w)
    w.registration.tensors[0].tensor.fill_(5)
    try:
        w.submit_store(1, [0], [0])
        assert shut.wait(10)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"jobs \[1\] queued or copying"):
            w.pool.close()
        assert time.monotonic() - start < 1.0
        assert not (w.pool.tensor[0] == 5).any()  # not yet copied: the job is held
    finally:
        gate.set()
        w.shutdown()  # from this thread: returns once the job has ended
    w.pool.close()
    assert (w.pool.tensor[0] == 5).all() and w.pool.closed
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]


@pytest.mark.parametrize("native", [False, True], ids=["python", "compiled"])
def test_a_closed_pool_takes_no_new_worker_and_a_failed_build_does_not_hold_it(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = small_worker(native)
    w.shutdown()
    reg, pool = w.registration, w.pool
    if native:
        # Refused after the base class took the pool: it must not keep the pool open.
        monkeypatch.setattr(native_worker, "library", lambda: None)
        with pytest.raises(RuntimeError, match="compiled copy engine is unavailable"):
            NativeCPUTransferWorker(reg, pool)
        monkeypatch.undo()
    pool.close()
    with pytest.raises(ValueError, match="closed"):
        type(w)(reg, pool)


# ---- the same on the CUDA worker, stand-ins for the GPU ----


def _cuda_worker(copy_path: str, done: list[bool]) -> Any:
    """A shut-down `CUDATransferWorker`'s state without a GPU, with job 1 on its lane 0,
    which has ended once `done[0]` is set."""
    w: Any = object.__new__(CUDATransferWorker)
    w._lock, w._closed = threading.Lock(), True
    if copy_path == "torch":
        end = SimpleNamespace(query=lambda: done[0])
        w._engine = None
        w._by_id = {1: _Record(1, 64, True, FakeCudaEvent(True), end, None)}  # type: ignore[arg-type]
    else:
        # kvt_cuda_wait_for's answers with no time to wait: -1 pending, 0 done.
        wait_for = lambda handle, lane, seq, timeout: 0 if done[0] else -1  # noqa: E731
        w._engine = SimpleNamespace(alive=True, handle=1, _wait_for=wait_for)
        w._live = {1: _Live(0, 1, 64)}
    return w


@pytest.mark.parametrize("copy_path", ["torch", "compiled"])
def test_close_is_refused_while_a_shut_down_cuda_workers_copies_run(copy_path: str) -> None:
    pool = small_worker(False).pool
    done = [False]
    w = _cuda_worker(copy_path, done)
    pool._add_user(w)
    with pytest.raises(RuntimeError, match=r"CUDATransferWorker at .*jobs \[1\]"):
        pool.close()
    assert not pool.closed
    done[0] = True
    pool.close()
    assert pool.closed


CLOSED_UNDER_COPIES = r"""
import sys

from worker_check import FAKE, fake_cuda_worker

w, _ = fake_cuda_worker(2, 12, coalesce_depth=int(sys.argv[1]))
store = w._streams[0].cuda_stream
FAKE.fake_hold(store, 1)  # the lane's copies cannot run yet
w.submit_store(1, [0, 1], [0])
for step in ("copying", "idle"):
    try:
        w.pool.close()
        print(step, "closed", flush=True)
        break
    except RuntimeError as exc:
        print(step, "refused:", str(exc).split("(")[1].split(")")[0], flush=True)
    FAKE.fake_hold(store, 0)
    w.wait([1])
w.shutdown()
w.pool.pinned = False  # pinned by hand: nothing to unregister
w.pool.close()
print("closed after shutdown", w.pool.closed, [(r.job_id, r.success) for r in w.get_finished()])
"""


@pytest.mark.parametrize("depth", [0, 2])
def test_close_is_refused_under_compiled_cuda_copies_over_the_stand_in_driver(
    tmp_path: Path, depth: int
) -> None:
    """The compiled engine itself says which jobs are still copying (no GPU: the stand-in
    driver holds the store lane's copies)."""
    out = run_over_fake_cuda(tmp_path, CLOSED_UNDER_COPIES, str(depth), timeout=120)
    assert out.splitlines() == [
        "copying refused: jobs [1] queued or copying",
        "idle refused: idle, not shut down",
        "closed after shutdown True [(1, True)]",
    ], out


def _gpu_worker(compiled: bool) -> tuple[CUDATransferWorker, HostPool]:
    from kvtier.transfer import KVCacheRegistration, KVTensor

    reg = KVCacheRegistration([KVTensor(torch.zeros(8, 256, dtype=torch.uint8, device="cuda"), 0)])
    return gpu_cuda_worker(reg, compiled)


def _sleep_on_gpu(ms: int) -> None:
    cycles_per_ms = torch.cuda.get_device_properties(0).clock_rate  # kHz
    torch.cuda._sleep(ms * cycles_per_ms)  # type: ignore[no-untyped-call]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
def test_close_is_refused_while_cuda_copies_run_on_a_gpu(compiled: bool) -> None:
    """The host-side twin is the test above. The store waits for about 0.5 s of compute."""
    w, pool = _gpu_worker(compiled)
    try:
        _sleep_on_gpu(500)
        w.submit_store(1, [0], [0])
        with pytest.raises(RuntimeError, match=r"jobs \[1\] queued or copying"):
            pool.close()
        assert pool.pinned
        w.wait([1])
        with pytest.raises(RuntimeError, match="idle, not shut down"):
            pool.close()
    finally:
        w.shutdown()
    pool.close()
    assert not pool.pinned and pool.closed
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]


# ---- the torch-ops path's waits in slices ----


class _CtrlC(Exception):
    """Raised by the test's SIGINT handler: a KeyboardInterrupt that came late would end the
    whole session instead of failing this test."""


def _raise_ctrl_c(signum: int, frame: FrameType | None) -> None:
    raise _CtrlC


class _Copying:
    """A stand-in CUDA event or stream whose copies end once `ended` is set: `query` answers
    at once; `synchronize` blocks as the driver's does, a Ctrl-C seen only once it returns."""

    def __init__(self) -> None:
        self.ended = threading.Event()
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.ended.is_set()

    def synchronize(self) -> None:
        pending: BaseException | None = None
        while not self.ended.is_set():
            try:
                self.ended.wait()
            except BaseException as exc:  # the handler's exception, raised in the wait
                pending = exc
        if pending is not None:
            raise pending


def _torch_ops_worker(end: Any, streams: list[Any]) -> Any:
    """A torch-ops `CUDATransferWorker`'s state without a GPU: store 1, whose end event is
    `end`, on the first of `streams`."""
    w: Any = object.__new__(CUDATransferWorker)
    record = _Record(1, 64, True, FakeCudaEvent(True), end, None)  # type: ignore[arg-type]
    w._engine, w._streams = None, streams
    w._lanes = {"store": SimpleNamespace(records=deque([record]))}
    w._events, w._indices = [], SimpleNamespace(give=lambda buf: None)
    w._by_id = {1: record}
    w._lock, w._closed = threading.Lock(), False
    w._ready, w._ready_ids, w._unreported = [], set(), {1}
    return w


@pytest.fixture
def ctrl_c() -> Iterator[Callable[[float], None]]:
    """`ctrl_c(s)`: a SIGINT to this process in `s` seconds, raised here as `_CtrlC`."""
    previous = signal.signal(signal.SIGINT, _raise_ctrl_c)
    timers: list[threading.Timer] = []

    def arm(delay: float) -> None:
        timers.append(threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)))
        timers[-1].start()

    try:
        yield arm
    finally:
        for timer in timers:
            timer.cancel()
            timer.join()
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("call", ["wait", "shutdown"])
def test_a_ctrl_c_ends_a_torch_ops_wait_and_shutdown(
    call: str, ctrl_c: Callable[[float], None]
) -> None:
    """The copies end after 3 s; the Ctrl-C comes at 0.2 s and is raised within a slice."""
    copying = _Copying()
    w = _torch_ops_worker(copying, [copying])
    release = threading.Timer(3.0, copying.ended.set)
    release.start()
    try:
        ctrl_c(0.2)
        start = time.monotonic()
        with pytest.raises(_CtrlC):
            getattr(CUDATransferWorker, call)(w, [1]) if call == "wait" else w.shutdown()
        assert time.monotonic() - start < 1.5
    finally:
        copying.ended.set()
        release.cancel()
        release.join()
    start = time.monotonic()
    CUDATransferWorker.wait(w, [1])
    w.shutdown()  # nothing left to wait for: both return at once
    assert time.monotonic() - start < 0.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("call", ["wait", "shutdown"])
def test_a_ctrl_c_ends_a_torch_ops_wait_and_shutdown_on_a_gpu(
    call: str, ctrl_c: Callable[[float], None]
) -> None:
    """The host-side twin is the test above. The store waits for about 1.5 s of compute;
    the Ctrl-C comes at 0.2 s."""
    w, pool = _gpu_worker(False)
    try:
        _sleep_on_gpu(1500)
        w.submit_store(1, [0], [0])
        ctrl_c(0.2)
        start = time.monotonic()
        with pytest.raises(_CtrlC):
            w.wait([1]) if call == "wait" else w.shutdown()
        assert time.monotonic() - start < 1.0
        w.wait([1])
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
    finally:
        w.shutdown()
        pool.close()


def test_a_torch_ops_wait_sees_a_short_copy_end_soon() -> None:
    copying = _Copying()
    w = _torch_ops_worker(copying, [copying])
    release = threading.Timer(0.005, copying.ended.set)
    start = time.monotonic()
    release.start()
    CUDATransferWorker.wait(w, [1])
    assert time.monotonic() - start < 0.1  # polled: the pauses grow to 1 ms at most
    assert copying.queries > 1
    release.join()


# ---- the torch-ops shutdown after a failed stream sync ----


class _Poisoned:
    """A stand-in stream of a context that a fault poisoned: every wait on it raises."""

    def query(self) -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    synchronize = query


def test_a_failed_torch_ops_shutdown_sync_is_logged_and_fails_the_jobs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As on the compiled path: logged, and the jobs not known to have ended reported failed
    (the one whose end event says it ended keeps its result), not raised (through
    `__exit__` too) with the jobs held for good."""
    w = _torch_ops_worker(FakeCudaEvent(False), [_Poisoned()])
    done = _Record(2, 64, True, FakeCudaEvent(True), FakeCudaEvent(True), None)  # type: ignore[arg-type]
    w._lanes["load"] = SimpleNamespace(records=deque([done]))
    w._by_id[2] = done
    w._unreported.add(2)
    with caplog.at_level(logging.ERROR, logger="kvtier.transfer.cuda_worker"):
        w.__exit__(None, None, None)
    assert "jobs [1] are reported failed" in caplog.text
    assert w.get_finished() == [TransferResult(2, True, 64, 0.002), TransferResult(1, False)]
    assert not w.holds(1) and not w._by_id
    assert w._events == [done.start, done.end]  # the failed job's events are not reused
    w.shutdown()  # again: logged again, nothing left to report
    assert w.get_finished() == []


# ---- the DMA lookup ----


def test_a_failed_dma_lookup_is_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []

    def no_driver(name: str) -> Any:
        opened.append(name)
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(cuda_dma, "_cached", None)
    monkeypatch.setattr(cuda_dma, "_looked_up", False, raising=False)
    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    assert not cuda_dma.available()
    assert not cuda_dma.available() and cuda_dma._lookup() is None
    assert opened == ["libcuda.so.1"]

    class _NotInitialized:
        def cuDriverGetVersion(self, out: object) -> int:
            opened.append("asked")
            return 3  # CUDA_ERROR_NOT_INITIALIZED: may answer later, so asked again

    monkeypatch.setattr(cuda_dma, "_looked_up", False, raising=False)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: _NotInitialized())
    assert not cuda_dma.available() and not cuda_dma.available()
    assert opened == ["libcuda.so.1", "asked", "asked"]
