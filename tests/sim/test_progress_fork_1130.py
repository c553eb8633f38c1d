"""`kvtier simulate --jobs N` with its progress bar: no worker is forked while the bar's redraw
thread holds a lock, so a worker that prints cannot wait for ever on one held by nobody."""

from __future__ import annotations

import io
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from rich.console import Console
from rich.progress import Progress, TextColumn, TimeElapsedColumn

from kvtier.sim.advise import advise
from kvtier.sim.command import _Bar
from kvtier.sim.runner import ReplayOptions, map_trace
from kvtier.sim.trace import Trace

_fork_only = pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="workers need fork"
)

# `kvtier simulate` with stderr on a pseudo-terminal (so the bar shows) that stops reading
# just as the first worker forks, as a terminal does on Ctrl-S or a stalled ssh link, and
# resumes a second later. Its policy prints, as a user's policy being debugged does.
_STALLED_TERMINAL_CLI = """
import os, pty, sys, threading, time
from kvtier.policies.base import register_policy
from kvtier.policies.lru import LRUPolicy

@register_policy("chatty", "prints as it is made")
class Chatty(LRUPolicy):
    def __init__(self, capacity):
        super().__init__(capacity)
        print(f"chatty policy of {capacity} slots")

master, slave = pty.openpty()
os.dup2(slave, 2)
shown = []
stalled = []
threads_at_fork = []

def resume():
    time.sleep(1.0)
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:
            return
        if not data:
            return
        shown.append(data)

def stall():
    if stalled:
        return
    stalled.append(True)
    threads_at_fork.extend(t.name for t in threading.enumerate())
    fd = os.open(os.ttyname(slave), os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        while True:
            os.write(fd, b"." * 1024)
    except BlockingIOError:
        pass
    # A redraw thread, if one runs, is now stuck in its write to the full terminal, holding
    # rich's locks and stderr's.
    time.sleep(0.5)
    threading.Thread(target=resume, daemon=True).start()

os.register_at_fork(before=stall)
from kvtier.cli import main
rc = main(sys.argv[1:])
deadline = time.monotonic() + 5
while time.monotonic() < deadline and b"chatty policy" not in b"".join(shown):
    time.sleep(0.05)
terminal = b"".join(shown)
print("forked:", bool(stalled))
print("threads at fork:", ",".join(threads_at_fork))
print("bar shown:", b"replaying" in terminal)
print("worker prints shown:", b"chatty policy" in terminal)
sys.stdout.flush()
os._exit(rc)
"""


@pytest.fixture
def trace_path(tmp_path: Path, trace_file: Callable[[Path, list[dict[str, object]]], Path]) -> Path:
    """A Mooncake-format trace of 40 requests that share a prefix."""
    rows = [
        {"timestamp": t, "input_length": 2048, "hash_ids": [0, 1, 2 + t % 7, 100 + t]}
        for t in range(40)
    ]
    return trace_file(tmp_path / "trace.jsonl", rows)


@_fork_only
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs a pseudo-terminal")
@pytest.mark.parametrize(
    "extra",
    [["--capacities", "25%,50%"], ["--advise"]],
    ids=["grid", "advise"],
)
def test_workers_that_print_finish_when_the_terminal_stalls_as_they_fork(
    trace_path: Path, extra: list[str]
) -> None:
    # Before the fix every worker inherited the redraw thread's locks held, and its first print
    # waited for ever: the run never ended, even after the terminal resumed.
    policies = "chatty,lru" if "--advise" in extra else "chatty"
    args = ["simulate", str(trace_path), "--policies", policies, "--jobs", "2", *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    env["TERM"] = "xterm-256color"  # a dumb terminal gets no redraws
    proc = subprocess.Popen(
        [sys.executable, "-c", _STALLED_TERMINAL_CLI, *args],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()  # its workers die with it (parent-death signal)
        proc.communicate()
        pytest.fail("kvtier simulate --jobs 2 hung: a worker waits on a lock nobody holds")
    assert proc.returncode == 0, out
    assert "forked: True" in out
    assert "bar shown: True" in out  # else the bar never ran and nothing was tested
    assert "worker prints shown: True" in out
    assert "chatty" in out.split("forked:")[0]  # the results table
    threads = out.split("threads at fork: ", 1)[1].splitlines()[0].split(",")
    assert threads == ["MainThread"]  # no redraw thread that could hold a lock


def _bar(out: io.StringIO) -> tuple[Progress, _Bar]:
    console = Console(file=out, force_terminal=True, width=60)
    progress = Progress(
        TextColumn("replaying"), TimeElapsedColumn(), console=console, auto_refresh=False
    )
    return progress, _Bar(progress, progress.add_task("replay", total=10))


def _redraw_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvtier-progress"]


def _grows(out: io.StringIO, seconds: float) -> bool:
    before = len(out.getvalue())
    time.sleep(seconds)
    return len(out.getvalue()) > before


def test_the_bar_redraws_until_paused_and_again_after() -> None:
    out = io.StringIO()
    progress, bar = _bar(out)
    with progress:
        bar.start()
        try:
            assert _grows(out, 0.5)  # the elapsed time moves with no advance
            with bar.paused():
                assert _redraw_threads() == []  # ended, not just told to stop
                assert not _grows(out, 0.3)
            assert len(_redraw_threads()) == 1
            assert _grows(out, 0.5)
            bar.advance(3)
            assert progress.tasks[0].completed == 3
        finally:
            bar.stop()
    assert _redraw_threads() == []


def test_a_failure_while_paused_restarts_the_redraws_and_is_raised() -> None:
    out = io.StringIO()
    progress, bar = _bar(out)
    with progress:
        bar.start()
        try:
            with pytest.raises(OSError, match="no fork"), bar.paused():
                raise OSError("no fork")
            assert len(_redraw_threads()) == 1
            assert _grows(out, 0.5)
        finally:
            bar.stop()
    assert _redraw_threads() == []


@_fork_only
def test_map_trace_forks_every_worker_inside_forking(make_trace: Callable[..., Trace]) -> None:
    trace = make_trace(3, num_requests=20)
    workers: list[int] = []  # this process's children as `forking` is entered and left

    @contextmanager
    def forking() -> Iterator[None]:
        workers.append(len(multiprocessing.active_children()))
        yield
        workers.append(len(multiprocessing.active_children()))

    args = [(p, 0.5, ReplayOptions(), 1) for p in ("lru", "arc", "sieve")]
    serial = [advise(trace, *a) for a in args]
    assert map_trace(trace, advise, args, jobs=3, forking=forking) == serial
    assert len(workers) == 2
    assert workers[1] - workers[0] == 3
    # No fork (one job): nothing to guard.
    workers.clear()
    assert map_trace(trace, advise, args, jobs=1, forking=forking) is None
    assert workers == []
