"""`--jobs N`: Ctrl-C or SIGTERM to the parent stops its workers; a parent killed outright
takes them too."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from kvtier.sim import runner
from kvtier.sim.runner import ReplayOptions, run_grid
from kvtier.sim.trace import Trace

pytestmark = [
    pytest.mark.skipif(
        "fork" not in multiprocessing.get_all_start_methods(), reason="workers need fork"
    ),
]
_linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.path.exists("/proc/self/task"),
    reason="reads /proc; the parent-death signal is Linux's",
)

# Registers a policy that sleeps a second per store, so each replay lasts a minute and more.
_SLOW_CLI = """
import sys, time
from kvtier.policies.base import register_policy
from kvtier.policies.lru import LRUPolicy

@register_policy("slow", "a second per store")
class Slow(LRUPolicy):
    def insert(self, keys, ctx):
        time.sleep(1.0)
        super().insert(keys, ctx)

from kvtier.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


@pytest.fixture
def trace(tmp_path: Path, trace_file: Callable[[Path, list[dict[str, object]]], Path]) -> Path:
    """A Mooncake-format trace of 60 requests of fresh blocks: 60 slow stores per replay."""
    rows = [
        {"timestamp": t, "input_length": 1024, "hash_ids": [2 * t, 2 * t + 1]} for t in range(60)
    ]
    return trace_file(tmp_path / "trace.jsonl", rows)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def _wait(done: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _default_sigint() -> None:
    # A shell's background job ignores SIGINT, and Python keeps it ignored.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def _slow_simulate(trace: Path) -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    """`kvtier simulate --jobs 2` with its two workers replaying; killed with its group after."""
    args = ["simulate", str(trace), "--policies", "slow", "--capacities", "5,6,7", "--jobs", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CLI, *args, "-q"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )
    try:
        workers: list[int] = []

        def forked() -> bool:
            workers[:] = _children(proc.pid)
            return len(workers) == 2 or proc.poll() is not None

        assert _wait(forked, 60) and len(workers) == 2, "the workers never started"
        yield proc, workers
    finally:
        # Whatever the test left behind, workers included: they share the session's group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


@_linux_only
@pytest.mark.parametrize(
    ("sig", "to_group", "status", "message"),
    [
        (signal.SIGINT, False, 130, "kvtier: interrupted"),
        (signal.SIGINT, True, 130, "kvtier: interrupted"),  # as a terminal's Ctrl-C sends it
        (signal.SIGTERM, False, 143, "kvtier: terminated"),
    ],
    ids=["sigint", "sigint-group", "sigterm"],
)
def test_a_signal_stops_every_worker_at_once(
    trace: Path, sig: signal.Signals, to_group: bool, status: int, message: str
) -> None:
    with _slow_simulate(trace) as (proc, workers):
        time.sleep(0.5)  # into the replays
        start = time.monotonic()
        if to_group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        assert proc.wait(timeout=60) == status
        assert time.monotonic() - start < 15  # the replays take minutes
        assert proc.stderr is not None and proc.stderr.read() == message + "\n"
        assert _wait(lambda: not any(_alive(w) for w in workers), 10)


@_linux_only
def test_workers_die_with_a_parent_killed_outright(trace: Path) -> None:
    with _slow_simulate(trace) as (proc, workers):
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        assert _wait(lambda: not any(_alive(w) for w in workers), 15), "workers outlived it"


@_linux_only
def test_a_worker_whose_parent_already_died_ends_itself() -> None:
    # The parent can die between the fork and the prctl call; the worker sees another parent.
    ctx = multiprocessing.get_context("fork")
    not_the_parent = os.getppid()
    proc = ctx.Process(target=runner._worker_init, args=(not_the_parent,))
    proc.start()
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    proc = ctx.Process(target=runner._worker_init, args=(os.getpid(),))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0


def _sleep_when_ready(ready: Any) -> None:
    ready.set()
    time.sleep(60)


def test_a_worker_forked_with_the_parents_handler_dies_of_sigterm() -> None:
    # Between its fork and its initializer a worker holds the parent's handler; raising there
    # would print a traceback from the pool's machinery instead of ending quietly.
    ctx = multiprocessing.get_context("fork")
    with runner._sigterm_raises():
        ready = ctx.Event()
        proc = ctx.Process(target=_sleep_when_ready, args=(ready,))
        proc.start()
        try:
            # Python drops a signal that arrives while a child is still leaving fork.
            assert ready.wait(30)
            assert proc.pid is not None
            os.kill(proc.pid, signal.SIGTERM)
            proc.join(30)
        finally:
            if proc.exitcode is None:
                proc.kill()
                proc.join()
    assert proc.exitcode == -signal.SIGTERM


@pytest.mark.parametrize("jobs", [1, 2])
def test_sigterm_is_caught_only_during_a_multi_process_run(
    make_trace: Callable[..., Trace], jobs: int
) -> None:
    def mine(signum: int, frame: FrameType | None) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        during: list[object] = []
        trace = make_trace(1)
        runs = [("lru", 5), ("arc", 5), ("opt", 5)]
        run_grid(
            trace,
            runs,
            ReplayOptions(),
            jobs=jobs,
            progress=lambda n: during.append(signal.getsignal(signal.SIGTERM)),
        )
        assert during
        if jobs == 1:
            assert all(h is mine for h in during)  # unchanged: nothing to stop
        else:
            assert all(h is not mine and callable(h) for h in during)
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)
