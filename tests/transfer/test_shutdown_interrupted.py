"""An interrupt (KeyboardInterrupt, Ctrl-C) while `CPUTransferWorker.shutdown()` waits for the
running job: the jobs queued behind it must still be reported failed, once, a second
`shutdown()` must return once they are, and exit must still wait for the running job. (They
were reported by the interrupted call after its wait, so they never were, and the second call
waited for good.) The compiled worker stops in one C call, which an interrupt cannot cut short.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable

import pytest

from helpers import HeldJob, interrupt_once, small_worker
from kvtier.transfer import CPUTransferWorker


def test_queued_jobs_are_reported_after_an_interrupted_shutdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hooks: set[Callable[[], None]] = set()  # the exit hooks registered and not unregistered
    register, unregister = atexit.register, atexit.unregister

    def record(hook: Callable[[], None]) -> Callable[[], None]:
        hooks.add(hook)
        return register(hook)

    def forget(hook: Callable[[], None]) -> None:
        hooks.discard(hook)
        unregister(hook)

    monkeypatch.setattr(atexit, "register", record)
    monkeypatch.setattr(atexit, "unregister", forget)
    hold = HeldJob()
    gate, running = hold.gate, hold.running
    w = small_worker(False, hold)
    assert isinstance(w, CPUTransferWorker)  # its copy thread and exit hook are checked
    try:
        w.submit_store(1, [1], [1])
        assert running.wait(30)
        w.submit_store(2, [2], [2])  # queued behind job 1
        thread = w._jobs.thread
        thread.join = interrupt_once(thread.join, "before")  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            w.shutdown()
        assert w._at_exit in hooks, "exit would no longer wait for the running job"
        gate.set()
        again = threading.Thread(target=w.shutdown, daemon=True)
        again.start()
        again.join(30)
        assert not again.is_alive(), "a second shutdown() after an interrupted one hung"
        assert w._at_exit not in hooks
        results = {r.job_id: r.success for r in w.get_finished()}
        assert results == {1: True, 2: False}
        assert not w.holds(2) and w.get_finished() == []
        with pytest.raises(RuntimeError, match="shut down"):
            w.submit_store(3, [3], [3])
    finally:
        gate.set()
