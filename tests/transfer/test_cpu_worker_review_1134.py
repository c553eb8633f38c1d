"""Ctrl-C inside `CPUTransferWorker.wait` while the worker lock is away from the waiting thread.

`Condition.wait` hands the lock back by a Python call to an acquire that a signal interrupts.
A Ctrl-C that came while that acquire waited for another thread (the copy thread appending a
result, or any thread in `get_finished` or a submit) left `wait()` without the lock, and its
`with` then released the lock from under that thread: the copy thread died on its own release
("release unlocked lock"), so later jobs were never run and their waits never returned. A
Ctrl-C as `Condition.wait` has just released the lock (before its own `try`) surfaced as that
RuntimeError instead of KeyboardInterrupt.

The signals here are real (SIGINT to the main thread), sent once the main thread is blocked
in the call that takes the lock back (a profile hook sees the call, its frame shows it inside,
/proc shows it asleep), and the lock's holder lets go once the signal's wake-up fd says it was
delivered: no step depends on timing.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest
import torch

from kvtier.transfer import CPUTransferWorker, HostPool, KVCacheRegistration, KVTensor


@pytest.fixture
def gate() -> threading.Event:
    """Holds job 1's copy until set (set at the end in any case, by `w`)."""
    return threading.Event()


@pytest.fixture
def w(gate: threading.Event) -> Iterator[CPUTransferWorker]:
    """A CPU worker whose job 1 waits for `gate`."""
    kv = torch.zeros(8, 256, dtype=torch.uint8)
    reg = KVCacheRegistration([KVTensor(kv, 0)])

    def hold(job_id: int, direction: str) -> None:
        if job_id == 1:
            gate.wait(30)

    worker = CPUTransferWorker(reg, HostPool(reg, 1, num_slots=4), fault_injector=hold)
    yield worker
    gate.set()
    worker.shutdown()


class _CtrlC:
    """A SIGINT for the main thread, sent by `send()` from the thread holding the worker lock
    (`held`) once the main thread blocks taking it back; `send()` returns once the signal has
    been delivered (its C handler wrote the wake-up fd)."""

    def __init__(self) -> None:
        self.held, self.reacquiring = threading.Event(), threading.Event()
        self._main = threading.main_thread().ident
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._armed = [True]  # one KeyboardInterrupt; a stray signal later ends nothing

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self._armed.pop() if self._armed else False:
            raise KeyboardInterrupt

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        # As the acquire itself is called: the plain Lock's `Condition._acquire_restore` is a
        # Python function that calls `acquire`, the RLock's is the C call itself.
        if event != "c_call" or not self.held.is_set():
            return
        if "_acquire_restore" in (frame.f_code.co_name, getattr(arg, "__name__", "")):
            self.reacquiring.set()

    def _blocked(self) -> bool:
        assert self._main is not None
        if sys._current_frames()[self._main].f_code.co_name not in ("_acquire_restore", "wait"):
            return False  # not yet in the call, or in the profile hook
        with open(f"/proc/self/task/{threading.main_thread().native_id}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "S"  # the state, after the name

    def send(self) -> None:
        assert self.reacquiring.wait(10), "the waiting thread never went to take the lock back"
        assert self._main is not None
        # Sent once the main thread is inside that C call (its frame; this thread has the GIL)
        # and asleep there: delivered a moment before it slept, the signal interrupted nothing,
        # and it was raised once the lock had been taken.
        deadline = time.monotonic() + 10
        while not self._blocked():
            assert time.monotonic() < deadline, "the waiting thread never blocked on the lock"
            time.sleep(1e-4)  # lets the GIL go, for the main thread to get there
        signal.pthread_kill(self._main, signal.SIGINT)
        self._read.settimeout(10)
        self._read.recv(1)

    def run(self, fn: Callable[[], object]) -> None:
        """`fn()` on this (the main) thread, armed; it must raise KeyboardInterrupt."""
        previous = signal.signal(signal.SIGINT, self._handler)
        old_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        try:
            sys.setprofile(self._profile)
            try:
                with pytest.raises(KeyboardInterrupt):
                    fn()
            finally:
                sys.setprofile(None)
        finally:
            self._armed.clear()
            signal.set_wakeup_fd(old_fd)
            signal.signal(signal.SIGINT, previous)
            self._read.close()
            self._write.close()


def _in_main_thread() -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    if not os.path.exists("/proc/self/task"):
        pytest.skip("needs Linux's /proc to see the main thread asleep")


def _works_on(w: CPUTransferWorker, gate: threading.Event) -> None:
    """The worker is whole: the lock is free, no wait is left registered, job 1 is reported
    once, done, and a later job runs and its wait returns (on a thread: where the copy thread
    had died, that wait never returned)."""
    free: list[bool] = []

    def take() -> None:  # on another thread: an RLock this thread kept would let it in again
        free.append(w._lock.acquire(blocking=False))
        if free[0]:
            w._lock.release()

    taker = threading.Thread(target=take)
    taker.start()
    taker.join()
    assert free == [True], "the worker lock was left taken"
    assert w._jobs.waiting == {}
    gate.set()

    def then() -> None:
        w.wait([1])
        w.submit_store(2, [2], [2])
        w.wait([2])

    later = threading.Thread(target=then, daemon=True)
    later.start()
    later.join(10)
    assert not later.is_alive(), "a later wait never returned: the copy thread is gone"
    assert w._thread.is_alive()
    assert sorted((r.job_id, r.success) for r in w.get_finished()) == [(1, True), (2, True)]


def test_ctrl_c_as_wait_takes_the_lock_back_from_another_thread(
    w: CPUTransferWorker, gate: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_main_thread()
    ctrl_c, errors = _CtrlC(), []
    jobs = w._jobs
    real_wait, in_wait = jobs.done_cv.wait, threading.Event()

    def wait(timeout: float | None = None) -> bool:
        in_wait.set()
        return real_wait(timeout)

    monkeypatch.setattr(jobs.done_cv, "wait", wait)

    def holder() -> None:  # a thread in get_finished, a submit, ...
        try:
            assert in_wait.wait(10)
            with w._lock:  # taken once the waiting thread's Condition.wait released it
                ctrl_c.held.set()
                jobs.done_cv.notify_all()  # the waiting thread goes to take it back now
                ctrl_c.send()
        except BaseException as exc:
            errors.append(exc)

    w.submit_store(1, [1], [1])
    other = threading.Thread(target=holder, daemon=True)
    other.start()
    ctrl_c.run(lambda: w.wait([1]))
    other.join(10)
    monkeypatch.undo()
    assert errors == [], "the interrupted wait released the lock of the thread holding it"
    _works_on(w, gate)


def test_ctrl_c_as_wait_takes_the_lock_back_from_the_copy_thread(
    w: CPUTransferWorker, gate: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_main_thread()
    ctrl_c = _CtrlC()
    jobs = w._jobs
    real_wait = jobs.done_cv.wait

    def wait(timeout: float | None = None) -> bool:
        gate.set()  # job 1 ends now: its result is appended once this call released the lock
        return real_wait(timeout)

    monkeypatch.setattr(jobs.done_cv, "wait", wait)

    class Results(list[Any]):
        def append(self, result: Any) -> None:  # on the copy thread, the lock held
            if not ctrl_c.held.is_set():
                ctrl_c.held.set()
                ctrl_c.send()
            super().append(result)

    jobs.results = Results()
    w.submit_store(1, [1], [1])
    ctrl_c.run(lambda: w.wait([1]))
    monkeypatch.undo()
    _works_on(w, gate)


def test_ctrl_c_as_condition_wait_has_released_the_lock(
    w: CPUTransferWorker, gate: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where CPython raises a pending Ctrl-C as `_release_save` returns, `Condition.wait` leaves
    without the lock and before its `try`: the old `wait()` raised "release unlocked lock"."""
    cv = w._jobs.done_cv
    real = cv._release_save  # type: ignore[attr-defined]

    def release_save() -> Any:
        monkeypatch.setattr(cv, "_release_save", real)  # once
        real()
        raise KeyboardInterrupt

    monkeypatch.setattr(cv, "_release_save", release_save)
    w.submit_store(1, [1], [1])
    with pytest.raises(KeyboardInterrupt):
        w.wait([1])
    assert w.holds(1)
    _works_on(w, gate)
