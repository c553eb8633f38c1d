"""Transfer fixes of the 2026-11-30 review."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.transfer import HostPool, KVCacheRegistration
from kvtier.transfer.cpu_worker import CPUTransferWorker
from kvtier.transfer.pageable import BounceCopier
from kvtier.transfer.plan import JobPlanner
from kvtier.transfer.testing import NUM_BLOCKS, assert_block_equals, make_layout, snapshot


def test_results_not_yet_taken_are_appended_to_not_copied() -> None:
    # The copy thread rebuilt the results list and id set on every job, so a caller that
    # collects rarely paid time in proportion to the results pending, per job (40,000 stores
    # without get_finished took 11.5 s against 1.5 s appending in place).
    kvs = make_layout("mla", torch.float32, seed=3)
    reg = KVCacheRegistration(kvs)
    w = CPUTransferWorker(reg, HostPool(reg, 1, num_slots=8))
    try:
        pending, pending_ids = w._jobs.results, w._jobs.result_ids
        for i in range(5):
            w.submit_store(i, [i], [i])
        w.wait(range(5))
        assert w._jobs.results is pending and w._jobs.result_ids is pending_ids
        assert [r.job_id for r in pending] == list(range(5)) and pending_ids == set(range(5))
        assert [r.job_id for r in w.get_finished()] == list(range(5))
        assert all(w.holds(i) is False for i in range(5))
        w.submit_load(5, [0], [6])
        w.wait([5])
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(5, True)]
        assert len(pending) == 5  # a list already taken is not appended to
    finally:
        w.shutdown()


def test_a_stage_too_large_to_allocate_is_named() -> None:
    # torch's allocator error named only a byte count ("you tried to allocate ... bytes").
    kvs = make_layout("mla", torch.float32, seed=4)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 1, num_slots=8)
    threads = threading.active_count()
    with pytest.raises(MemoryError, match=r"stage_bytes=1125899906842624: .*smaller stage_bytes"):
        CPUTransferWorker(reg, pool, stage_bytes=1 << 50)
    assert threading.active_count() == threads  # no copy thread was started
    w = CPUTransferWorker(reg, pool)  # the pool is still free for a worker
    try:
        w.submit_store(0, [1], [2])
        w.wait([0])
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(0, True)]
    finally:
        w.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bounce_copier_indices_are_ready_on_its_own_stream() -> None:
    # The copier's row index was filled by a kernel on the constructing thread's stream and
    # read on the copier's stream, which does not wait for it: with that stream busy, the
    # first piece gathered through an index not yet written.
    kvs = make_layout("mla", torch.float16, "cuda", seed=5)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 1, num_slots=8, pin=False)
    planner = JobPlanner(NUM_BLOCKS, pool.num_slots, 1, {g: reg.page_bytes(g) for g in reg.groups})
    before = snapshot(kvs)
    piece = 4
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    warm = BounceCopier(reg, pool.rows, piece * pool.row_bytes, stream)
    store = planner.store(1, [1, 2, 3, 4], [4, 5, 6, 7], 0)
    warm.run(store, torch.from_numpy(store.dev_rows), torch.from_numpy(store.host_rows))
    # Freed blocks of zeros, which the allocator hands to the next small tensors of this
    # stream: the old index among them.
    junk = [torch.zeros(piece, dtype=torch.int64, device="cuda") for _ in range(16)]
    del junk
    torch.cuda._sleep(1 << 30)  # type: ignore[no-untyped-call]  # the stream stays busy
    copier = BounceCopier(reg, pool.rows, piece * pool.row_bytes, stream)
    load = planner.load(2, [4, 5, 6, 7], [20, 21, 22, 23], 0, 0, False)
    copier.run(load, torch.from_numpy(load.dev_rows), torch.from_numpy(load.host_rows))
    torch.cuda.synchronize()
    for src, dst in zip([1, 2, 3, 4], [20, 21, 22, 23], strict=True):
        assert_block_equals(kvs, dst, before[src])
