"""The worker half's clean-up after a submit that raised, hit by a second interrupt (a second
Ctrl-C while it asks the transfer worker whether it queued the job, or while it logs): the job
is still reported exactly once, so the scheduler half ends with nothing held.

The first interrupt (or error) comes from the submit; the second from `holds`, wherever the
worker half asks it. tests/connector/test_interrupt_worker.py covers a single interrupt over
the real transfer workers."""

from __future__ import annotations

import pytest

import kvtier.connector.worker as worker_module
from engine_sim import BLOCK_SHAPE, block_hashes
from helpers import FakeTransfer, interrupt_once
from kvtier.base import TransferResult
from kvtier.connector import OffloadingScheduler, OffloadingWorker, StepProgress
from kvtier.cpu import CPUOffloadingManager

TPB = BLOCK_SHAPE[1]  # tokens per block


class _Interrupted(FakeTransfer):
    """A submit that raises `first` (before queueing the job, or after if `queued`)."""

    def __init__(self, first: type[BaseException], queued: bool) -> None:
        super().__init__()
        self.first, self.queued = first, queued

    def _submit(self, job_id: int) -> None:
        if self.queued:
            self.done.append(TransferResult(job_id, True))
        raise self.first


def _reports(worker: OffloadingWorker) -> list[TransferResult]:
    """`get_finished` until it returns without an interrupt, its results collected."""
    got: list[TransferResult] = []
    for _ in range(3):
        try:
            got += worker.get_finished()
        except KeyboardInterrupt:
            continue
        got += worker.get_finished()
        return got
    raise AssertionError("get_finished kept raising")


@pytest.mark.parametrize("queued", [False, True])
@pytest.mark.parametrize(
    ("first", "second"),
    [(KeyboardInterrupt, "holds"), (RuntimeError, "holds"), (RuntimeError, "logging")],
)
def test_a_second_interrupt_in_the_clean_up_loses_no_report(
    first: type[BaseException], second: str, queued: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = CPUOffloadingManager(8)
    s = OffloadingScheduler(m, tokens_per_block=TPB)
    transfer = _Interrupted(first, queued)
    worker = OffloadingWorker(transfer)
    if second == "holds":
        monkeypatch.setattr(transfer, "holds", interrupt_once(transfer.holds, "before"))
    else:  # the error path logs the exception
        log = worker_module.logger
        monkeypatch.setattr(log, "exception", interrupt_once(log.exception, "before"))
    s.add_request("a", block_hashes("a", 2), 2 * TPB + 1)
    meta = s.build_step_metadata([StepProgress("a", [[0, 1, 2]], 2 * TPB)])
    (store,) = meta.stores
    try:
        worker.finish_step(meta)
    except KeyboardInterrupt:
        pass  # the first interrupt, or the second if it lands here
    else:
        assert first is RuntimeError and second == "holds"  # an error alone is handled inside
    worker.finish_step(meta)  # fed again after the interrupt: skipped, not submitted twice
    results = _reports(worker)
    assert [(r.job_id, r.success) for r in results] == [(store.job_id, queued)]
    s.on_worker_results(results)
    assert s.num_jobs_in_flight() == 0
    st = m.get_stats()
    assert (st.pending_writes, st.ready) == ((0, 2) if queued else (0, 0))
    assert not s.request_finished("a") and s.num_requests() == 0
