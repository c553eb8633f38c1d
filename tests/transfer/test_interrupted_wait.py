"""An interrupt (KeyboardInterrupt) inside `CPUTransferWorker.wait`: the ids it waited for must
not stay wanted (each would wake every waiter when its job ends), and another call waiting for
the same ids must still be woken. Interrupts come where a Ctrl-C is raised: as `Condition.wait`
starts (Python raises a pending one as a function starts) or as it returns after a wake-up.
The interrupts of a submit are tests/transfer/test_interrupt.py's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from helpers import interrupt_once
from kvtier.transfer import CPUTransferWorker, HostPool, KVCacheRegistration, KVTensor


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """Holds job 2's copy until set (set at the end in any case)."""
    g = threading.Event()
    yield g
    g.set()


def _worker(gate: threading.Event, waits: threading.Event | None = None) -> CPUTransferWorker:
    """Job 2 waits for `gate`; job 1 for `waits`, if given."""
    kv = torch.zeros(8, 256, dtype=torch.uint8)
    reg = KVCacheRegistration([KVTensor(kv, 0)])

    def hold(job_id: int, direction: str) -> None:
        if job_id == 2:
            gate.wait(30)
        elif job_id == 1 and waits is not None:
            waits.wait(30)

    return CPUTransferWorker(reg, HostPool(reg, 1, num_slots=4), fault_injector=hold)


def _done(w: CPUTransferWorker, ids: set[int]) -> None:
    """Wait, without `wait()`, until every job of `ids` is reported."""
    got: set[int] = set()
    deadline = time.monotonic() + 30
    while not ids <= got and time.monotonic() < deadline:
        got |= {r.job_id for r in w.get_finished()}
        time.sleep(0.005)
    assert ids <= got, f"jobs {ids - got} were never reported"


@pytest.mark.parametrize("when", ["before", "after"])
def test_an_interrupted_wait_leaves_no_wake_ups_behind(when: str, gate: threading.Event) -> None:
    waits = threading.Event()
    with _worker(gate, waits) as w:
        jobs = w._jobs
        w.submit_store(1, [1], [1])  # ends once the wait below blocks, and wakes it
        w.submit_store(2, [2], [2])  # held until the interrupt is over
        interrupted = interrupt_once(jobs.done_cv.wait, when)

        def wait(timeout: float | None = None) -> bool:
            waits.set()
            return bool(interrupted(timeout))

        jobs.done_cv.wait = wait  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            w.wait([1, 2])
        del jobs.done_cv.wait
        woken = [0]
        real_notify = jobs.done_cv.notify_all

        def notify_all() -> None:
            woken[0] += 1
            real_notify()

        jobs.done_cv.notify_all = notify_all  # type: ignore[method-assign]
        gate.set()
        _done(w, {1, 2})
        assert woken[0] == 0, "a job nobody waits for any more woke the waiters"
        w.submit_store(3, [3], [3])  # and a later wait still works
        w.wait([3])
        assert 3 not in w._in_flight


def test_an_interrupted_wait_does_not_take_the_wake_up_of_another_waiting_for_the_same_job(
    gate: threading.Event,
) -> None:
    with _worker(gate) as w:
        jobs = w._jobs
        w.submit_store(2, [2], [2])  # held until the gate opens
        real_wait = jobs.done_cv.wait
        other_waits = threading.Event()
        main = threading.current_thread()

        def wait(timeout: float | None = None) -> bool:
            if threading.current_thread() is main:
                raise KeyboardInterrupt  # this thread's Ctrl-C, as it starts to wait
            other_waits.set()
            return real_wait(timeout)

        jobs.done_cv.wait = wait  # type: ignore[method-assign]
        other = threading.Thread(target=w.wait, args=([2],), daemon=True)
        other.start()
        assert other_waits.wait(10)
        with pytest.raises(KeyboardInterrupt):  # runs once `other` released the lock to wait
            w.wait([2])
        gate.set()
        other.join(10)
        assert not other.is_alive(), "the other wait was never woken for job 2"
