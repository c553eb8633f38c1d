"""An interrupt inside `OffloadingWorker.get_finished`, after the transfer worker handed over
its batch, loses no result: the next call returns it."""

from __future__ import annotations

import pytest

from helpers import small_worker
from kvtier.connector import OffloadingWorker


class _DiscardInterrupted(set[int]):
    """A set whose first `discard` raises KeyboardInterrupt as it returns, as a signal can."""

    armed = True

    def discard(self, element: object) -> None:
        super().discard(element)
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt


def test_an_interrupt_after_the_batch_is_taken_loses_none_of_it() -> None:
    transfer = small_worker(False)
    try:
        w = OffloadingWorker(transfer)
        for j in (1, 2, 3):
            transfer.submit_store(j, [j], [j])
        transfer.wait([1, 2, 3])
        w._submitted = _DiscardInterrupted({1, 2, 3})
        with pytest.raises(KeyboardInterrupt):
            w.get_finished()
        assert not any(transfer.holds(j) for j in (1, 2, 3))  # taken from the transfer
        got = w.get_finished()
        assert sorted((r.job_id, r.success) for r in got) == [(1, True), (2, True), (3, True)]
        assert w.get_finished() == []
    finally:
        transfer.shutdown()
