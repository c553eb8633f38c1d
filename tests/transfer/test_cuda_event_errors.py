"""The CUDA worker's torch-ops path when an end event's query raises a CUDA error (sticky after
a fault): each such job is reported failed, never left unreported, and the jobs that ended
before it keep their results. Runs without a GPU: the events are stand-ins."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace
from typing import Any

from helpers import FakeCudaEvent
from kvtier.base import TransferResult
from kvtier.transfer.cuda_worker import CUDATransferWorker, _Live, _Record


def _taken(w: Any) -> list[TransferResult]:
    """What one `_take_finished` moves into the worker's ready results."""
    w._ready, w._ready_ids = [], set()
    CUDATransferWorker._take_finished(w)
    assert w._ready_ids == {r.job_id for r in w._ready}
    return list(w._ready)


def _record(job_id: int, end: bool | None, ok: bool = True) -> _Record:
    return _Record(job_id, 64, ok, FakeCudaEvent(True), FakeCudaEvent(end), None)  # type: ignore[arg-type]


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
    assert _taken(w) == [
        TransferResult(1, True, 64, 0.002),
        TransferResult(2, False, 0, 0.0),
        TransferResult(3, False, 0, 0.0),
    ]
    assert list(w._by_id) == [4]  # still copying: reported by a later call
    assert [r.job_id for r in w._lanes["load"].records] == [4]
    assert len(w._events) == 2  # only the healthy job's events are reused


def test_a_failed_job_reports_no_bytes_and_no_time_on_the_torch_ops_path() -> None:
    w: Any = object.__new__(CUDATransferWorker)
    w._engine = None
    w._lanes = {"store": SimpleNamespace(records=deque([_record(1, True, ok=False)]))}
    w._events, w._indices = [], SimpleNamespace(give=lambda buf: None)
    w._by_id = {1: None}
    assert _taken(w) == [TransferResult(1, False, 0, 0.0)]


def test_the_compiled_path_reports_no_time_for_a_failed_job_or_a_negative_one() -> None:
    """The engine shares a batch's time among its jobs, failed ones too, and a batch timed from
    a stale start event comes out negative."""
    w: Any = object.__new__(CUDATransferWorker)
    polled = [
        SimpleNamespace(job_id=j, ok=ok, seconds=t)
        for j, ok, t in ((1, False, 0.003), (2, True, -0.001), (3, True, 0.002))
    ]

    def drop(k: int) -> None:
        del polled[:k]

    w._engine = SimpleNamespace(alive=True, poll_size=256, peek=lambda: list(polled), drop=drop)
    w._live = {j: _Live(0, j, 64) for j in (1, 2, 3)}
    assert _taken(w) == [
        TransferResult(1, False, 0, 0.0),
        TransferResult(2, True, 64, 0.0),
        TransferResult(3, True, 64, 0.002),
    ]
