"""Submit-time validation: bad arguments raise ValueError and queue nothing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvtier.transfer import (
    CPUTransferWorker,
    HostPool,
    KVCacheRegistration,
    KVTensor,
    NativeCPUTransferWorker,
)
from kvtier.transfer.native import library, submit_extension
from kvtier.transfer.plan import RUN_BYTES, JobPlanner


@pytest.fixture(params=["python", "native", "native-ctypes"])
def worker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Both CPU workers: the native one validates in C first (its ids read by the extension,
    or through ctypes), then asks the planner why."""
    reg = KVCacheRegistration([KVTensor(torch.zeros(16, 4, 8), "mla")])
    pool = HostPool(reg, 2, num_slots=4)
    if request.param == "python":
        w: Any = CPUTransferWorker(reg, pool)
    elif library() is None:
        pytest.skip("the compiled copy engine cannot be built here")
    else:
        if request.param == "native-ctypes":
            monkeypatch.setattr("kvtier.transfer.native_worker.submit_extension", lambda: None)
        elif submit_extension() is None:
            pytest.skip("the submit extension cannot be built here (no Python headers?)")
        w = NativeCPUTransferWorker(reg, pool)
    yield w
    w.shutdown()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda w: w.submit_store(1, [0, 1, 2], [0]), "whole chunks"),
        (lambda w: w.submit_store(1, [0, 16], [0]), "16, outside 0..15"),
        (lambda w: w.submit_store(1, [0, 1], [4]), "slots contains 4"),
        (lambda w: w.submit_store(1, [0, 1, 2, 3], [1, 1]), "repeats id 1"),
        (lambda w: w.submit_store(1, [0, 1], [0], group=2), "group=2"),
        (lambda w: w.submit_store(1, [[0, 1]], [0]), "1-D"),
        (lambda w: w.submit_store(1, b"\x00\x01", [0]), "1-D"),
        (lambda w: w.submit_store(1, [0.0, 1.0], [0]), "integers"),
        (lambda w: w.submit_store("a", [0, 1], [0]), "job_id"),
        (lambda w: w.submit_store(2**70, [0, 1], [0]), "does not fit in 64 bits"),
        (lambda w: w.submit_load(-(2**63) - 1, [0], [3]), "does not fit in 64 bits"),
        (lambda w: w.submit_store(1, [True, False], [0]), "dtype bool"),
        # Among ints numpy reads a bool as 0 or 1: block 1 would be copied.
        (lambda w: w.submit_store(1, [0, True], [0]), "got True at index 1"),
        (lambda w: w.submit_load(1, (np.True_, 2), [3, 4, 5, 6]), r"slots .* np\.True_ at index 0"),
        (lambda w: w.submit_store(1, [0, torch.tensor(False)], [0]), "got tensor\\(False\\)"),
        (lambda w: w.submit_store(1, [2**70, 1], [0]), "must hold integers"),
        (
            lambda w: w.submit_store(1, np.array([2**63, 1], np.uint64), [0]),
            "contains 9223372036854775808,",
        ),
        (lambda w: w.submit_store(1, [0, 1], np.array([-1], np.int8)), "slots contains -1"),
        (lambda w: w.submit_load(1, [0, 1], [3]), "does not fit"),
        (lambda w: w.submit_load(1, [0], [3, 4, 5]), "does not fit"),
        (lambda w: w.submit_load(1, [0], [3, 3]), "repeats id 3"),
        (lambda w: w.submit_load(1, [0], [3], skip_blocks=2), "skip_blocks=2"),
        (
            lambda w: w.submit_load(1, [0], [3], skip_blocks=2**64),
            "skip_blocks=18446744073709551616",
        ),
        (lambda w: w.submit_load(1, [0], [3], skip_blocks=2**64 + 1), "must be in 0..1"),
        (lambda w: w.submit_load(1, [0, 1, 2], [3, 4], skip_blocks=1), "does not fit"),
        # Slot 0 contributes no block: refused with skip_blocks=0, once taken with 1.
        (lambda w: w.submit_load(1, [0], [], skip_blocks=1), "expected 1..1"),
        # Not ints: a dict lookup took 0.0 for group 0 or raised TypeError on a list.
        (lambda w: w.submit_store(1, [0, 1], [0], group=0.0), r"group=0\.0 must be an int"),
        (lambda w: w.submit_store(1, [0, 1], [0], group=[0]), r"group=\[0\] must be an int"),
        (lambda w: w.submit_load(1, [0], [3], group=False), "group=False must be an int"),
        (lambda w: w.submit_load(1, [0], [3], urgent="no"), "urgent='no' must be a bool"),
        (lambda w: w.submit_load(1, [0], [3], urgent=None), "urgent=None must be a bool"),
    ],
)
def test_bad_submit_raises_and_queues_nothing(worker: Any, call: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(worker)
    worker.wait([1])
    assert worker.get_finished() == []
    worker.submit_store(1, [0, 1], [0])  # the id is still free
    worker.wait([1])
    assert [r.job_id for r in worker.get_finished()] == [1]


def test_numpy_group_and_urgent_are_taken(worker: Any) -> None:
    worker.submit_store(1, [0, 1], [0], group=np.int64(0))
    worker.submit_load(2, [0], [9], group=np.int32(0), urgent=np.bool_(True))
    worker.wait([1, 2])
    assert [r.success for r in worker.get_finished()] == [True, True]


def test_duplicate_job_id_is_refused_until_reported(worker: Any) -> None:
    worker.submit_store(5, [0, 1], [0])
    with pytest.raises(ValueError, match="job_id=5"):
        worker.submit_load(5, [0], [9])
    worker.wait([5])
    assert [r.job_id for r in worker.get_finished()] == [5]
    worker.submit_load(5, [0], [9])  # reported, so reusable
    worker.wait([5])


def test_load_rows_start_mid_chunk_and_may_end_mid_chunk() -> None:
    p = JobPlanner(num_blocks=32, num_slots=8, blocks_per_chunk=4, page_bytes={0: 64})
    job = p.load(1, [5, 2], [10, 11, 12, 13], 0, skip_blocks=3, urgent=False)
    assert job.host_rows.tolist() == [23, 8, 9, 10]
    assert job.nbytes == 4 * 64
    store = p.store(2, list(range(8)), [3, 4], 0)
    assert store.host_rows.tolist() == list(range(12, 20))
    assert store.host_run == 12 and store.dev_run == 0


def test_long_runs_are_found_only_when_long() -> None:
    page = RUN_BYTES // 2
    p = JobPlanner(num_blocks=64, num_slots=64, blocks_per_chunk=1, page_bytes={0: page})
    job = p.store(1, [1, 2, 3, 9, 10, 11], [40, 41, 42, 7, 8, 9], 0)
    assert job.runs == ([1, 9], [40, 7], [3, 3])
    rng = np.random.default_rng(0)
    scattered = p.store(2, rng.permutation(64)[:8], rng.permutation(64)[:8], 0)
    assert scattered.runs is None
