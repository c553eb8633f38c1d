"""The CUDA worker's torch-ops path when an end event's query raises a CUDA error (sticky after
a fault): each such job is reported failed, never left unreported, and the jobs that ended
before it keep their results. Runs without a GPU: the events are stand-ins."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace
from typing import Any

from kvtier.base import TransferResult
from kvtier.transfer.cuda_worker import CUDATransferWorker, _Record


class _Event:
    def __init__(self, done: bool | None) -> None:
        self.done = done  # None: the query raises, as torch does on a CUDA error

    def query(self) -> bool:
        if self.done is None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.done

    def elapsed_time(self, end: Any) -> float:
        return 2.0


def _record(job_id: int, end: bool | None) -> _Record:
    return _Record(job_id, 64, True, _Event(True), _Event(end), None)  # type: ignore[arg-type]


def test_an_end_event_that_raises_fails_its_job_and_keeps_the_results_before_it() -> None:
    w: Any = object.__new__(CUDATransferWorker)
    records = [_record(1, True), _record(2, None), _record(3, None)]
    w._engine = None
    pending = _record(4, False)
    w._lanes = {
        "store": SimpleNamespace(records=deque(records[:2])),
        "load": SimpleNamespace(records=deque([records[2], pending])),
    }
    w._events, w._indices = [], SimpleNamespace(give=lambda buf: None)
    w._by_id = {r.job_id: r for r in records} | {4: None}
    assert CUDATransferWorker._collect(w) == [
        TransferResult(1, True, 64, 0.002),
        TransferResult(2, False, 0, 0.0),
        TransferResult(3, False, 0, 0.0),
    ]
    assert list(w._by_id) == [4]  # still copying: reported by a later call
    assert [r.job_id for r in w._lanes["load"].records] == [4]
    assert len(w._events) == 2  # only the healthy job's events are reused
