"""The compiled CPU copy engine's failure paths: stopped from its own fault hook, and every
allocation it makes failing in turn (c/engine_faults.c, also under the sanitizers where the
compiler has them); from Python, a worker shut down by its fault injector, and wait() from a
thread that took over the id of the engine's ended thread."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import kvtier.transfer
from kvtier.transfer import HostPool, KVCacheRegistration, KVTensor
from kvtier.transfer.native import library
from kvtier.transfer.native_worker import NativeCPUTransferWorker

SOURCES = Path(kvtier.transfer.__file__).parent
HARNESS = Path(__file__).with_name("c") / "engine_faults.c"
CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")

_SANITIZERS = {
    "plain": ["-O2"],
    "address": ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
    "thread": ["-O1", "-g", "-fsanitize=thread"],
}


def _compile(flags: list[str], out: Path, *sources: Path) -> subprocess.CompletedProcess[str]:
    assert CC is not None
    cmd = [CC, *flags, "-Wall", "-Werror", "-pthread", f"-I{SOURCES}", "-o", str(out)]
    return subprocess.run([*cmd, *map(str, sources)], capture_output=True, text=True, timeout=300)


def _sanitizer_works(flags: list[str], tmp_path: Path) -> bool:
    """Whether a threaded program builds and runs with `flags` here: a compiler without the
    sanitizer's runtime, or a kernel whose memory layout it refuses, is a reason to skip."""
    src, exe = tmp_path / "probe.c", tmp_path / "probe"
    src.write_text(
        "#include <pthread.h>\nstatic void *f(void *a) { return a; }\n"
        "int main(void) { pthread_t t; pthread_create(&t, 0, f, 0); return pthread_join(t, 0); }\n"
    )
    if _compile(flags, exe, src).returncode != 0:
        return False
    try:
        return subprocess.run([str(exe)], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.skipif(CC is None, reason="needs a C compiler")
@pytest.mark.parametrize("variant", list(_SANITIZERS))
def test_stops_from_the_hook_and_failed_allocations_in_c(tmp_path: Path, variant: str) -> None:
    """c/engine_faults.c: stopped from its hook, the engine reports the running job, then the
    queued ones failed, each lane in order, and is joined when freed (it reported the queued
    jobs first, and was freed under its running thread); every allocation failing in turn
    leaves no job lost, repeated or half-queued."""
    flags = _SANITIZERS[variant]
    if variant != "plain" and not _sanitizer_works(flags, tmp_path):
        pytest.skip(f"-fsanitize={variant} does not build or run here")
    exe = tmp_path / "engine_faults"
    built = _compile(flags, exe, HARNESS, SOURCES / "rowcopy.c")
    assert built.returncode == 0, built.stderr
    # Under ThreadSanitizer, every 8th allocation of the sweep: the rest take seconds there.
    args = ["8"] if variant == "thread" else []
    out = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("ok:"), out.stdout + out.stderr


def _setup() -> tuple[torch.Tensor, KVCacheRegistration, HostPool]:
    kv = torch.arange(8 * 1024, dtype=torch.int32).view(8, 1024)
    reg = KVCacheRegistration([KVTensor(kv, 0)])
    return kv, reg, HostPool(reg, 1, num_slots=8)


_SHUT_DOWN_BY_THE_INJECTOR = """
import gc, os, sys, threading, time, torch
from kvtier.transfer import CPUTransferWorker, HostPool, KVCacheRegistration, KVTensor
from kvtier.transfer.native_worker import NativeCPUTransferWorker

backend, threads = sys.argv[1], int(sys.argv[2])
kv = torch.arange(8 * 1024, dtype=torch.int32).view(8, 1024)
reg = KVCacheRegistration([KVTensor(kv, 0)])
pool = HostPool(reg, 1, num_slots=8)
gate, box = threading.Event(), {}

def inject(job_id, direction):
    if job_id == 0:
        gate.wait(5)  # until jobs 1-3 are queued behind it
    if job_id == 1:
        box["worker"].shutdown()

def tasks():
    return set(os.listdir("/proc/self/task"))

before = tasks()
if backend == "native":  # without shared backlogs: jobs 1-3 might be copied as one batch
    w = NativeCPUTransferWorker(
        reg, pool, fault_injector=inject, copy_threads=threads, share_backlog=False
    )
else:
    w = CPUTransferWorker(reg, pool, fault_injector=inject)
box["worker"] = w
for j in range(4):
    w.submit_store(j, [j + 2], [j])
gate.set()
w.wait(range(4))
print(*(f"{r.job_id}:{r.success}" for r in w.get_finished()))
print("bytes", torch.equal(pool.rows[1, :4096], kv[3].view(torch.uint8)))
try:
    w.submit_store(9, [0], [0])
except RuntimeError as exc:
    print("submit:", exc)
box.clear()
del w
deadline = time.monotonic() + 10
while tasks() - before and time.monotonic() < deadline:
    gc.collect()
    time.sleep(0.01)
print("threads left", len(tasks() - before))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads (Linux)")
@pytest.mark.parametrize(("backend", "threads"), [("python", 1), ("native", 1), ("native", 2)])
def test_a_worker_shut_down_by_its_fault_injector(backend: str, threads: int) -> None:
    """shutdown() from the injector, on the copy thread: the job it runs for still finishes and
    is reported first, the queued ones fail after it, and the threads end once the worker goes.
    The compiled engine's thread tried to join itself: it reported the queued jobs before the
    running one, so that its lane went back to an earlier job and wait() never returned, and
    it was never joined (its engine was then freed under it). In a child process, for that."""
    if backend == "native" and library() is None:
        pytest.skip("the compiled copy engine cannot be built here")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    script = [sys.executable, "-c", _SHUT_DOWN_BY_THE_INJECTOR, backend, str(threads)]
    try:
        out = subprocess.run(script, capture_output=True, text=True, timeout=30, env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"it hung; it printed {exc.stdout!r}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == [
        "0:True 1:True 2:False 3:False",
        "bytes True",
        "submit: the transfer worker is shut down",
        "threads left 0",
    ], out.stdout + out.stderr[-2000:]


def test_wait_from_a_thread_that_took_the_ended_engine_threads_id() -> None:
    """wait() refuses to run on the engine's thread (inside the fault injector, it would
    deadlock), but not on a thread started after shutdown() that was given the ended thread's
    id, as the C library gives a new thread the stack, and so the id, of one that ended."""
    if library() is None:
        pytest.skip("the compiled copy engine cannot be built here")
    _, reg, pool = _setup()
    engine: list[int] = []
    w = NativeCPUTransferWorker(
        reg, pool, fault_injector=lambda j, d: engine.append(threading.get_ident())
    )
    w.submit_store(1, [0], [0])
    w.wait([1])
    w.shutdown()
    outcome: list[str] = []
    started = threading.Event()

    def waiter() -> None:
        if threading.get_ident() == engine[0]:
            try:
                w.wait([1])
                outcome.append("returned")
            except RuntimeError as exc:
                outcome.append(str(exc))
        started.wait(10)  # alive until all have started: each takes another ended one's place

    threads = [threading.Thread(target=waiter) for _ in range(8)]
    for t in threads:
        t.start()
    started.set()
    for t in threads:
        t.join()
    if not outcome:
        pytest.skip("no new thread was given the ended thread's id here")
    assert outcome == ["returned"]
    assert [r.job_id for r in w.get_finished()] == [1]
