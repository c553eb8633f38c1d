"""Ctrl-C (a real SIGINT to the main thread) while `wait()` blocks on a job that is still
running: both CPU workers must raise KeyboardInterrupt then, not once the job has ended. The
compiled worker's wait was one C call, in which Python cannot raise it: Ctrl-C did nothing
until the job it waited for was done. The job itself is unaffected and reported once.
"""

from __future__ import annotations

import signal
import threading

import pytest

from helpers import small_worker
from kvtier.transfer.native import library


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_ctrl_c_interrupts_a_wait_for_a_running_job(native: bool) -> None:
    if native and library() is None:
        pytest.skip("the compiled library is unavailable")
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    gate, running, released = threading.Event(), threading.Event(), threading.Event()

    def hold(job_id: int, direction: str) -> None:
        running.set()
        gate.wait(20)
        released.set()

    w = small_worker(native, hold)
    main = threading.main_thread().ident
    assert main is not None

    def ctrl_c() -> None:
        if running.wait(20):
            signal.pthread_kill(main, signal.SIGINT)

    armed = [True]  # a late signal (the test failed) must not end the test session

    def on_sigint(signum: int, frame: object) -> None:
        if armed.pop() if armed else False:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    sender = threading.Thread(target=ctrl_c, daemon=True)
    try:
        sender.start()
        with pytest.raises(KeyboardInterrupt):
            w.submit_store(1, [1], [1])
            w.wait([1])  # the signal comes once job 1 runs, held until the gate opens
        assert not released.is_set(), "Ctrl-C was raised only once the job had ended"
        assert w.holds(1)
        gate.set()
        w.wait([1])
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
    finally:
        armed.clear()
        gate.set()
        sender.join(30)
        signal.signal(signal.SIGINT, previous)
        w.shutdown()
