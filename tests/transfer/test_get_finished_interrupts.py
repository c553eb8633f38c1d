"""An interrupt (KeyboardInterrupt) inside `get_finished`, at every point where CPython can raise
one in the frames of the worker's code (`helpers.interrupt_at`): the results it took from the
backend must not be lost. Each job is reported exactly once, by that call or the next, is held
until then, and its id is free again afterwards. (They were lost: an interrupt as the compiled
engine's poll returned, or in the loop that discarded the ids, dropped them, and their ids stayed
taken for good.) The interrupts of a submit are tests/transfer/test_interrupt.py's.
"""

from __future__ import annotations

import pytest

import kvtier.transfer.cpu_worker
import kvtier.transfer.native_worker
import kvtier.transfer.worker
from helpers import get_finished_interrupted, small_worker
from kvtier.transfer.native import library

JOBS = [1, 2, 3]


@pytest.mark.parametrize(
    ("native", "module"),
    [
        (False, kvtier.transfer.worker),
        (False, kvtier.transfer.cpu_worker),
        (True, kvtier.transfer.worker),
        (True, kvtier.transfer.native_worker),
    ],
    ids=["python-worker.py", "python-cpu_worker.py", "native-worker.py", "native-native_worker.py"],
)
def test_an_interrupted_get_finished_loses_no_result(
    native: bool, module: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    if native and library() is None:
        pytest.skip("the compiled library is unavailable")
    # Two results per engine poll: the interrupts also fall between two polls of one call.
    monkeypatch.setattr(kvtier.transfer.native_worker, "_POLL", 2)
    filename = str(getattr(module, "__file__", ""))
    n = 0
    while True:
        w = small_worker(native)
        try:
            for j in JOBS:
                w.submit_store(j, [j], [j])
            w.wait(JOBS)
            got, fired = get_finished_interrupted(w, n, filename, JOBS)
            where = fired[0] if fired else "nowhere"
            assert sorted(r.job_id for r in got) == JOBS, f"interrupted {where}"
            assert all(r.success and r.bytes == 256 for r in got), where
            assert not any(w.holds(j) for j in JOBS), where
            assert w.get_finished() == []
            w.submit_store(1, [4], [4])  # the id is free again
            w.wait([1])
            assert [r.job_id for r in w.get_finished()] == [1]
        finally:
            w.shutdown()
        if not fired:
            break
        n += 1
    assert n > 0, "no interrupt point was reached"
