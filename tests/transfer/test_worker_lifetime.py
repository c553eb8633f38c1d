"""A CPU transfer worker dropped without `shutdown()` is collected, and its copy threads end;
`shutdown()` and the stop at interpreter exit work as before."""

from __future__ import annotations

import atexit
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Callable

import pytest
import torch

from kvtier.transfer import HostPool, KVCacheRegistration, KVTensor
from kvtier.transfer.cpu_worker import CPUTransferWorker
from kvtier.transfer.native import library
from kvtier.transfer.native_worker import NativeCPUTransferWorker

CPUWorker = type[CPUTransferWorker] | type[NativeCPUTransferWorker]

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task (Linux)"
)


@pytest.fixture(params=["python", "native"])
def worker_cls(request: pytest.FixtureRequest) -> CPUWorker:
    """Both CPU backends: the copy thread in Python, and in compiled code."""
    if request.param == "python":
        return CPUTransferWorker
    if library() is None:
        pytest.skip("the compiled copy engine cannot be built here")
    return NativeCPUTransferWorker


def _setup() -> tuple[KVCacheRegistration, HostPool]:
    kv = torch.arange(8 * 4096, dtype=torch.int32).view(8, 4096)
    reg = KVCacheRegistration([KVTensor(kv, 0)])
    return reg, HostPool(reg, 1, num_slots=8)


def _tasks() -> set[int]:
    """The process's threads, Python's and compiled code's alike."""
    return {int(t) for t in os.listdir("/proc/self/task")}


def _until(done: Callable[[], bool], seconds: float = 10.0) -> bool:
    """Collect garbage until `done()` or `seconds` pass; whether `done()` came true."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        if done():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def _gone(ref: Callable[[], object], threads: set[int]) -> None:
    """Assert that the worker behind `ref` is collected and `threads` have ended."""
    assert _until(lambda: ref() is None), "the dropped worker was never collected"
    assert _until(lambda: not threads & _tasks()), "the dropped worker's threads still run"


def test_a_dropped_worker_is_collected_and_its_threads_end(worker_cls: CPUWorker) -> None:
    reg, pool = _setup()
    before = _tasks()
    w = worker_cls(reg, pool)
    threads = _tasks() - before
    assert threads, "the worker started no thread"
    w.submit_store(1, [0], [0])
    w.wait([1])
    assert [r.success for r in w.get_finished()] == [True]
    ref = weakref.ref(w)
    del w
    _gone(ref, threads)


def test_a_worker_dropped_with_jobs_queued_and_running_is_collected(
    worker_cls: CPUWorker,
) -> None:
    """Dropped while its copy thread is inside job 0 (in the fault injector) with jobs queued
    behind it: once job 0 ends, the worker goes, and its threads with it."""
    reg, pool = _setup()
    gate, started = threading.Event(), threading.Event()

    def hold_first(job_id: int, direction: str) -> None:
        if job_id == 0:
            started.set()
            gate.wait(10)

    before = _tasks()
    w = worker_cls(reg, pool, fault_injector=hold_first)
    threads = _tasks() - before
    for j in range(6):
        w.submit_store(j, [j], [j])
    assert started.wait(10)
    ref = weakref.ref(w)
    del w
    gc.collect()
    gate.set()
    _gone(ref, threads)


def test_a_worker_dropped_with_copies_queued_is_collected(worker_cls: CPUWorker) -> None:
    """No fault injector: the copy thread may be copying when the worker goes."""
    kv = torch.zeros(64, 64 * 1024, dtype=torch.int32)
    reg = KVCacheRegistration([KVTensor(kv, 0)])
    pool = HostPool(reg, 1, num_slots=64)
    before = _tasks()
    w = worker_cls(reg, pool)
    threads = _tasks() - before
    for j in range(64):
        w.submit_store(j, [j], [j])
    ref = weakref.ref(w)
    del w
    _gone(ref, threads)


def test_a_worker_shut_down_then_dropped_is_collected(worker_cls: CPUWorker) -> None:
    reg, pool = _setup()
    before = _tasks()
    w = worker_cls(reg, pool)
    threads = _tasks() - before
    w.submit_store(1, [0], [0])
    w.shutdown()
    w.shutdown()  # idempotent
    # A joined thread leaves /proc a moment after join() returns.
    assert _until(lambda: not threads & _tasks()), "shutdown() left a copy thread running"
    assert len(w.get_finished()) == 1
    ref = weakref.ref(w)
    del w
    _gone(ref, threads)


def test_two_dropped_workers_leave_no_thread_and_no_exit_hook(
    worker_cls: CPUWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    hooks: list[Callable[[], None]] = []
    register, unregister = atexit.register, atexit.unregister

    def recording_register(f: Callable[[], None]) -> Callable[[], None]:
        hooks.append(f)
        return register(f)

    def recording_unregister(f: Callable[[], None]) -> None:
        hooks[:] = [h for h in hooks if h != f]
        unregister(f)

    monkeypatch.setattr(atexit, "register", recording_register)
    monkeypatch.setattr(atexit, "unregister", recording_unregister)
    reg, pool = _setup()
    before = _tasks()
    workers = [worker_cls(reg, pool) for _ in range(2)]
    threads = _tasks() - before
    assert len(hooks) == 2, "each worker registers one exit hook"
    for w in workers:
        w.submit_store(1, [0], [0])
    refs = [weakref.ref(w) for w in workers]
    del workers, w
    assert _until(lambda: all(r() is None for r in refs)), "a dropped worker was never collected"
    assert _until(lambda: not threads & _tasks()), "a dropped worker's threads still run"
    assert hooks == [], "a collected worker left its exit hook registered"


@pytest.mark.parametrize("kept", [True, False])
def test_a_live_worker_is_still_stopped_at_exit(worker_cls: CPUWorker, kept: bool) -> None:
    """At exit the running job finishes and the queued ones are dropped, whether the worker is
    still referenced or dropped (and maybe still running a job)."""
    module = worker_cls.__module__
    script = textwrap.dedent(f"""
        import threading, time, torch
        from kvtier.transfer import HostPool, KVCacheRegistration, KVTensor
        from {module} import {worker_cls.__name__} as Worker

        running = threading.Event()

        def slow(job_id, direction):
            print("start", job_id, flush=True)
            running.set()
            time.sleep(0.3)
            print("end", job_id, flush=True)

        kv = torch.arange(8 * 4096, dtype=torch.int32).view(8, 4096)
        reg = KVCacheRegistration([KVTensor(kv, 0)])
        w = Worker(reg, HostPool(reg, 1, num_slots=8), fault_injector=slow)
        for j in range(4):
            w.submit_store(j, [j], [j])
        running.wait(10)
        if not {kept}:
            del w
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["start", "0", "end", "0"], out.stdout
