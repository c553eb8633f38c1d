"""Edge cases of submitting jobs: ids numpy cannot type as integers, options that a backend
would drop unread, and a failure before a pageable CUDA job's copy."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.base import TransferResult
from kvtier.transfer import (
    CPUTransferWorker,
    HostPool,
    KVCacheRegistration,
    TransferWorker,
    make_transfer_worker,
)
from kvtier.transfer.pageable import BounceCopier, PageableCUDATransferWorker
from kvtier.transfer.plan import JobPlanner
from kvtier.transfer.testing import NUM_BLOCKS, assert_block_equals, make_layout, snapshot

WORKERS = [make_transfer_worker, CPUTransferWorker]


def _setup() -> tuple[KVCacheRegistration, HostPool]:
    reg = KVCacheRegistration(make_layout("flash", torch.float16))
    return reg, HostPool(reg, 1, num_slots=8)


@pytest.mark.parametrize(
    "blocks",
    [
        [np.uint64(3), 4],  # numpy promotes uint64 with a Python int to float64
        np.array([3, 4], dtype=object),
        (np.uint64(3), np.int64(4)),
    ],
    ids=["uint64-and-int", "object-array", "uint64-and-int64"],
)
@pytest.mark.parametrize("make", WORKERS)
def test_integer_ids_that_numpy_does_not_type_as_integers_are_taken(blocks: Any, make: Any) -> None:
    reg, pool = _setup()
    kvs = list(reg.tensors)
    before = snapshot(kvs)
    with make(reg, pool) as w:
        w.submit_store(1, blocks, [5, 6])
        w.submit_load(2, [5, 6], [40, 41])
        w.wait([1, 2])
        assert [r.success for r in w.get_finished()] == [True, True]
    assert_block_equals(kvs, 40, before[3])
    assert_block_equals(kvs, 41, before[4])


@pytest.mark.parametrize(
    ("blocks", "bad"),
    [([-1, 2**63], -1), ([3, 2**64 + 1], 2**64 + 1), ([np.uint64(2**63), 1], 2**63)],
)
def test_an_out_of_range_id_is_named_whatever_dtype_numpy_gives_the_list(
    blocks: list[int], bad: int
) -> None:
    planner = JobPlanner(NUM_BLOCKS, 8, 1, {0: 64})
    with pytest.raises(ValueError, match=rf"device_blocks contains {bad}, outside 0\.\.47"):
        planner.store(1, blocks, [1, 2], 0)
    with pytest.raises(ValueError, match=rf"device_blocks contains {bad}, outside 0\.\.47"):
        planner.load(1, [1, 2], blocks, 0, 0, False)


@pytest.mark.parametrize("blocks", [[1, 2.0], [1, "2"], [True, 2.5], np.array([1.0, 2.0])])
def test_ids_that_are_not_integers_are_still_refused(blocks: Any) -> None:
    planner = JobPlanner(NUM_BLOCKS, 8, 1, {0: 64})
    with pytest.raises(ValueError, match="device_blocks must hold integers"):
        planner.store(1, blocks, [1, 2], 0)


@pytest.mark.parametrize(
    ("option", "match"),
    [
        ({"compiled": "yes"}, "compiled='yes' must be None, True or False"),
        ({"coalesce_depth": 99}, "coalesce_depth=99 is not valid"),
        ({"coalesce_depth": True}, "coalesce_depth=True is not valid"),
        ({"stage_bytes": "1M"}, "stage_bytes='1M' must be a positive int"),
        ({"stage_bytes": 0}, "stage_bytes=0 must be a positive int"),
        ({"fault_injector": 3}, "fault_injector=3 must be a callable"),
        ({"copy_mode": "engine"}, "copy_mode='engine' is unknown; expected one of"),
    ],
)
def test_a_bad_option_is_refused_even_by_a_backend_that_ignores_it(
    option: dict[str, Any], match: str
) -> None:
    # A CUDA option checked only on a GPU lets a typo pass every CPU test run.
    reg, pool = _setup()
    with pytest.raises(ValueError, match=match):
        make_transfer_worker(reg, pool, "cpu", **option)


def test_good_cuda_options_are_still_ignored_on_the_cpu() -> None:
    reg, pool = _setup()
    with make_transfer_worker(
        reg, pool, copy_mode="kernel", compiled=False, coalesce_depth=2, stage_bytes=1
    ) as w:
        w.submit_store(1, [0], [0])
        w.wait([1])
        assert w.get_finished()[0].success


class _Event:
    def record(self, stream: object) -> None:
        pass


class _Stream:
    """A side stream whose `n`th wait for the compute's event fails for each `n` in `fail`."""

    def __init__(self, fail: set[int]) -> None:
        self.fail, self.waits = fail, 0

    def wait_event(self, event: object) -> None:
        self.waits += 1
        if self.waits in self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


def _finished(w: TransferWorker, n: int, timeout: float = 10.0) -> list[TransferResult]:
    """Results of `n` jobs, polled: a copy thread that died would never report them."""
    results: list[TransferResult] = []
    deadline = time.monotonic() + timeout
    while len(results) < n and time.monotonic() < deadline:
        results += w.get_finished()
        time.sleep(0.01)
    return results


def test_a_failed_wait_for_the_compute_fails_the_pageable_job_and_later_jobs_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The pageable CUDA worker, on CPU tensors: the device-side pieces are replaced with fakes
    # and the bounce copier runs on the CPU, as in test_pageable.py.
    stream = _Stream({2})

    def make_copier(self: PageableCUDATransferWorker, stage_bytes: int) -> BounceCopier:
        self._stream = stream  # type: ignore[assignment]
        return BounceCopier(self.registration, self.pool.rows, stage_bytes)

    monkeypatch.setattr(PageableCUDATransferWorker, "_DEVICE", ("cpu", "the CPU"))
    monkeypatch.setattr(PageableCUDATransferWorker, "_make_copier", make_copier)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: None)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the old thread's death
    reg, pool = _setup()
    kvs = list(reg.tensors)
    before = snapshot(kvs)
    w = PageableCUDATransferWorker(reg, pool)
    try:
        w.submit_store(1, [3], [1])
        w.submit_store(2, [4], [2])
        w.submit_load(3, [1], [40])
        results = _finished(w, 3)
        assert [(r.job_id, r.success) for r in results] == [(1, True), (2, False), (3, True)]
        assert_block_equals(kvs, 40, before[3])
        assert not w._events
    finally:
        w.shutdown()
