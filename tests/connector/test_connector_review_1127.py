"""Review 1127 of the connector halves: the same step metadata fed again once its jobs were
reported, and block tables of the wrong shape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvtier.base import TransferResult
from kvtier.connector import OffloadingScheduler, OffloadingWorker, StepProgress
from kvtier.cpu import CPUOffloadingManager
from kvtier.transfer import (
    HostPool,
    KVCacheRegistration,
    KVTensor,
    TransferWorker,
    make_transfer_worker,
)

TPB = 4  # tokens per block


@pytest.fixture
def kv() -> torch.Tensor:
    return torch.zeros(16, 2, TPB, 2, 8)


@pytest.fixture
def transfer(kv: torch.Tensor) -> Iterator[TransferWorker]:
    reg = KVCacheRegistration([KVTensor(kv, "flashinfer")])
    t = make_transfer_worker(reg, HostPool(reg, blocks_per_chunk=1, num_slots=4))
    yield t
    t.shutdown()


def _hashes(n: int) -> list[bytes]:
    return [bytes([i + 1]) * 32 for i in range(n)]


# -- the worker half: a step fed again after its jobs were reported ---------------------------


def test_metadata_fed_again_after_its_jobs_were_reported_runs_nothing_again(
    kv: torch.Tensor, transfer: TransferWorker
) -> None:
    s = OffloadingScheduler(CPUOffloadingManager(4), tokens_per_block=TPB)
    w = OffloadingWorker(transfer)
    s.add_request("a", _hashes(2), 9)
    kv[0].fill_(1.0)
    kv[1].fill_(2.0)
    meta = s.build_step_metadata([StepProgress("a", [[0, 1, 2]], 8)])
    w.start_step(meta)
    w.finish_step(meta)
    transfer.wait([j.job_id for j in meta.stores])
    s.on_worker_results(w.get_finished())
    assert s.request_finished("a") is False
    kv[0].fill_(7.0)  # the engine gave a's first block to another request
    # An error path hands the step over again: its store must not copy the reused block into
    # the chunk's slot, nor be reported a second time (the scheduler refuses the batch).
    w.start_step(meta)
    w.finish_step(meta)
    transfer.wait([j.job_id for j in meta.stores])
    assert w.get_finished() == []
    # A request with a's prefix loads a's bytes.
    s.add_request("b", _hashes(2), 9)
    n = s.get_num_new_matched_tokens("b", 0)
    assert n == 2 * TPB
    s.update_state_after_alloc("b", [[8, 9, 10]], n)
    loads = s.build_step_metadata()
    w.start_step(loads)
    w.wait_for_loads(loads)
    s.on_worker_results(w.get_finished())
    assert not s.take_finished().failed_loads
    assert torch.equal(kv[8], torch.full_like(kv[8], 1.0))
    assert torch.equal(kv[9], torch.full_like(kv[9], 2.0))
    # Fed again, the load does not overwrite blocks b has computed into since.
    kv[8].fill_(5.0)
    w.start_step(loads)
    w.wait_for_loads(loads)
    assert w.get_finished() == []
    assert torch.equal(kv[8], torch.full_like(kv[8], 5.0))
    s.request_finished("b")
    assert s.num_jobs_in_flight() == 0


def test_a_new_scheduler_may_reuse_job_ids_on_the_same_worker(
    kv: torch.Tensor, transfer: TransferWorker
) -> None:
    # Job ids are unique per scheduler only (benchmarks/worker_side.py starts a new one per
    # round): a new metadata with an id seen before is new work, and runs.
    w = OffloadingWorker(transfer)
    for value in (1.0, 3.0):
        s = OffloadingScheduler(CPUOffloadingManager(4), tokens_per_block=TPB)
        s.add_request("a", _hashes(1), 5)
        kv[0].fill_(value)
        meta = s.build_step_metadata([StepProgress("a", [[0, 1]], 4)])
        assert [j.job_id for j in meta.stores] == [1]
        w.finish_step(meta)
        transfer.wait([1])
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
        slot = int(meta.stores[0].slots[0])
        assert torch.equal(transfer.pool.rows[slot], kv[0].flatten().view(torch.uint8))


# -- the scheduler half: a block table of the wrong shape -------------------------------------


@pytest.mark.parametrize("table", [[5], None, 7])
def test_a_block_table_that_is_not_one_list_per_group_is_a_clear_error(table: object) -> None:
    m = CPUOffloadingManager(8)
    s = OffloadingScheduler(m, tokens_per_block=TPB)
    s.add_request("a", _hashes(2), 9)
    with pytest.raises(ValueError, match=r"request 'a': block_ids=.* is invalid; expected one"):
        s.build_step_metadata([StepProgress("a", table, 8)])  # type: ignore[arg-type]
    assert m.get_stats().pending_writes == 0
    # A corrected call stores.
    meta = s.build_step_metadata([StepProgress("a", [[0, 1, 2]], 8)])
    assert len(meta.stores) == 1
    assert m.get_stats().pending_writes == 2


@pytest.mark.parametrize("table", [[5], None])
def test_a_load_block_table_that_is_not_one_list_per_group_keeps_the_offer(
    table: object,
) -> None:
    m = CPUOffloadingManager(8)
    s = OffloadingScheduler(m, tokens_per_block=TPB)
    s.add_request("x", _hashes(2), 9)
    meta = s.build_step_metadata([StepProgress("x", [[0, 1, 2]], 8)])
    s.on_worker_results(TransferResult(j.job_id, True) for j in meta.stores)
    s.request_finished("x")
    s.add_request("b", _hashes(2), 9)
    n = s.get_num_new_matched_tokens("b", 0)
    assert n == 2 * TPB
    with pytest.raises(ValueError, match=r"request 'b': block_ids=.* is invalid; expected one"):
        s.update_state_after_alloc("b", table, n)  # type: ignore[arg-type]
    assert m.get_stats().pinned == 0
    s.update_state_after_alloc("b", [[4, 5, 6]], n)
    assert [j.device_blocks.tolist() for j in s.build_step_metadata().loads] == [[4, 5]]


@pytest.mark.parametrize("entry", [("a", [[0, 1, 2]], 8), "a"])
def test_a_step_entry_that_is_not_a_step_progress_is_a_clear_error(entry: object) -> None:
    m = CPUOffloadingManager(8)
    s = OffloadingScheduler(m, tokens_per_block=TPB)
    for r in "ab":
        s.add_request(r, _hashes(2), 9)
    good = StepProgress("b", [[3, 4, 5]], 8)
    with pytest.raises(ValueError, match=r"progress entry .* expected a StepProgress"):
        s.build_step_metadata([good, entry])  # type: ignore[list-item]
    assert m.get_stats().pending_writes == 0  # nothing planned for the entry before it
    assert len(s.build_step_metadata([good]).stores) == 1


# -- a cache policy raising as a request ends ---------------------------------------------------


@pytest.mark.parametrize("hook", ["touch", "on_request_finished"])
def test_a_policy_raising_as_a_request_ends_leaves_no_request_tracked(hook: str) -> None:
    """The scheduler marked the request finished, then called the policy; when that raised,
    a request with no job left stayed tracked for good (nothing else ends it), and one tracked
    request per such error piled up."""
    from kvtier.policies.lru import LRUPolicy

    class Raising(LRUPolicy):
        armed = False

        def touch(self, keys: Any, ctx: Any) -> None:
            if self.armed and hook == "touch":
                raise RuntimeError("policy bug in touch")
            super().touch(keys, ctx)

        def on_request_finished(self, ctx: Any) -> None:
            if self.armed and hook == "on_request_finished":
                raise RuntimeError("policy bug in on_request_finished")

    manager = CPUOffloadingManager(8, Raising)
    policy = manager.policy
    assert isinstance(policy, Raising)
    s = OffloadingScheduler(manager, tokens_per_block=TPB)
    # A stored prefix, so the ending request has reused chunks to touch.
    s.add_request("a", _hashes(2), 9)
    meta = s.build_step_metadata([StepProgress("a", [[0, 1, 2]], 8)])
    s.on_worker_results([TransferResult(j.job_id, True) for j in meta.stores])
    assert s.request_finished("a") is False
    s.add_request("b", _hashes(2), 9)
    n = s.get_num_new_matched_tokens("b", 0)
    assert n == 2 * TPB
    s.update_state_after_alloc("b", [[4, 5, 6]], n)
    loads = s.build_step_metadata()
    s.on_worker_results([TransferResult(j.job_id, True) for j in loads.loads])
    s.take_finished()
    policy.armed = True
    with pytest.raises(RuntimeError, match="policy bug"):
        s.request_finished("b")
    assert s.num_requests() == 0 and s.num_jobs_in_flight() == 0
    with pytest.raises(ValueError, match="'b'"):
        s.request_finished("b")  # ended: not tracked any more
