"""A worker inherited by a forked child: its copy threads stayed in the parent. A submit there
was queued and never run, and `wait` for it hung for good; both must raise RuntimeError saying
why. `shutdown()` there returns, every time.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable

import pytest

from helpers import HeldJob, in_child, small_worker
from kvtier.transfer.native import library

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_submit_and_wait_in_a_forked_child_raise(native: bool) -> None:
    if native and library() is None:
        pytest.skip("the compiled library is unavailable")
    w = small_worker(native)
    try:
        w.submit_store(1, [1], [1])
        w.wait([1])

        def check() -> bool:
            refused = 0
            calls: list[Callable[[], object]] = [
                lambda: w.submit_store(2, [2], [2]),
                lambda: w.submit_load(3, [1], [3]),
                lambda: w.wait([2]),
            ]
            for call in calls:
                try:
                    call()
                except RuntimeError as exc:
                    refused += "forked" in str(exc)
            return refused == 3 and not w.holds(2)

        in_child(check, "an inherited worker")
        # The parent's worker is untouched.
        w.submit_store(2, [2], [2])
        w.wait([2])
        assert [r.job_id for r in w.get_finished()] == [1, 2]
    finally:
        w.shutdown()


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_shutdown_in_a_forked_child_returns_every_time(native: bool) -> None:
    """The Python worker reports the jobs queued at the fork failed; the compiled one leaves
    its engine, whose threads are the parent's, alone (a second stop, or the free when the
    worker was collected after one, waited for good)."""
    if native and library() is None:
        pytest.skip("the compiled library is unavailable")
    hold = HeldJob()
    gate, running = hold.gate, hold.running
    w = small_worker(native, hold)
    try:
        w.submit_store(1, [1], [1])
        assert running.wait(30)
        w.submit_store(2, [2], [2])  # queued behind job 1 when the process forks

        def check() -> bool:
            nonlocal w
            w.shutdown()
            w.shutdown()  # returns too: nothing is left to wait for
            results = [(r.job_id, r.success) for r in w.get_finished()]
            del w
            gc.collect()  # the compiled engine is not freed (nor waited for) here
            return results == ([] if native else [(2, False)])

        in_child(check, "an inherited worker")
        gate.set()
        w.wait([1, 2])
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True), (2, True)]
    finally:
        gate.set()
        w.shutdown()
