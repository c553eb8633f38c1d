"""Shutdown from two threads at once: whichever call returns second, it returns only once every
submitted job is reported, as one call does (the first call used to be the only one that
waited, and the second returned with the running job neither finished nor reported)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from helpers import HeldJob
from kvtier.transfer import (
    CPUTransferWorker,
    HostPool,
    KVCacheRegistration,
    NativeCPUTransferWorker,
    TransferWorker,
)
from kvtier.transfer.native import library
from kvtier.transfer.testing import make_layout

Make = Callable[[KVCacheRegistration, HostPool, Callable[[int, str], object]], TransferWorker]


def _native(
    reg: KVCacheRegistration, pool: HostPool, hook: Callable[[int, str], object]
) -> TransferWorker:
    if library() is None:
        pytest.skip("no compiled copy engine here")
    return NativeCPUTransferWorker(reg, pool, fault_injector=hook)


WORKERS: dict[str, Make] = {
    "python": lambda reg, pool, hook: CPUTransferWorker(reg, pool, fault_injector=hook),
    "native": _native,
}


@pytest.mark.parametrize("worker", list(WORKERS))
def test_a_second_shutdown_waits_for_the_first(worker: str) -> None:
    hook = HeldJob()
    reached, gate = hook.running, hook.gate

    reg = KVCacheRegistration(make_layout("flash", torch.float16))
    pool = HostPool(reg, 1, num_slots=4)
    w = WORKERS[worker](reg, pool, hook)
    w.submit_store(1, [3], [0])
    w.submit_store(2, [4], [1])
    assert reached.wait(30)
    first = threading.Thread(target=w.shutdown)
    first.start()
    while not w._closed:  # the first call is in, waiting for job 1
        time.sleep(0.001)
    releaser = threading.Timer(0.3, gate.set)
    releaser.start()
    try:
        w.shutdown()
        # Both jobs are reported once shutdown() returned: job 1 ran, job 2 was cancelled.
        assert {(r.job_id, r.success) for r in w.get_finished()} == {(1, True), (2, False)}
    finally:
        gate.set()
        first.join(30)
        releaser.cancel()
    with pytest.raises(RuntimeError, match="shut down"):
        w.submit_store(3, [5], [2])


@pytest.mark.parametrize("worker", list(WORKERS))
def test_shutdown_from_the_fault_injector_twice_does_not_deadlock(worker: str) -> None:
    """A guard for the fix above: the copy thread must not wait for its own end."""
    box: list[TransferWorker] = []

    def hook(job_id: int, direction: str) -> None:
        if job_id == 1:
            box[0].shutdown()
            box[0].shutdown()

    reg = KVCacheRegistration(make_layout("flash", torch.float16))
    pool = HostPool(reg, 1, num_slots=4)
    w = WORKERS[worker](reg, pool, hook)
    box.append(w)
    w.submit_store(1, [3], [0])
    w.submit_store(2, [4], [1])
    w.wait([1, 2])
    w.shutdown()
    results = w.get_finished()
    # Job 2 ran only where the native engine had taken it into one batch with job 1.
    assert sorted(r.job_id for r in results) == [1, 2] and results[0].success


_LATE_EXIT = """
import atexit
box = []


def late():
    w = box[0]
    results = w.get_finished()
    w.wait([1, 2])
    # Each job once; whether it ran or was cancelled depends on when the exit came.
    print("late", sorted(r.job_id for r in results), flush=True)


atexit.register(late)  # before torch: it runs after every exit handler torch and kvtier add
import torch
from kvtier.transfer import HostPool, KVCacheRegistration, NativeCPUTransferWorker
from kvtier.transfer.testing import make_layout

reg = KVCacheRegistration(make_layout("flash", torch.float16))
w = NativeCPUTransferWorker(reg, HostPool(reg, 1, num_slots=4))
box.append(w)
w.submit_store(1, [3], [0])
w.submit_store(2, [4], [1])
"""


def test_the_native_engine_is_not_freed_under_a_late_exit_handler() -> None:
    """At exit the worker is shut down, and results may still be polled: the engine was also
    freed then, and an exit handler (or daemon thread) that polled or waited afterwards read
    freed memory (with glibc's MALLOC_PERTURB_ it hung, or read a garbage job id)."""
    import os
    import subprocess
    import sys

    if library() is None:
        pytest.skip("no compiled copy engine here")
    env = {**os.environ, "MALLOC_PERTURB_": "165"}
    proc = subprocess.run(
        [sys.executable, "-c", _LATE_EXIT], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "late [1, 2]" in proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
