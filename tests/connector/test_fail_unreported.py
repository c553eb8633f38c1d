"""`OffloadingScheduler.fail_unreported`: reports that will never come (a worker gone, or results
lost to an interrupt between the worker half's `get_finished` and `on_worker_results`) are
counted as failures, so their pins, slots and requests are released instead of held forever.
The randomized check is the end of tests/connector/test_scheduler_model.py's fuzz."""

from __future__ import annotations

import pytest
import torch

from engine_sim import BLOCK_SHAPE, block_hashes, sent_load
from kvtier.base import LookupResult, ReqContext, TransferResult, make_offload_key
from kvtier.connector import OffloadingScheduler, OffloadingWorker, StepProgress
from kvtier.cpu import CPUOffloadingManager
from kvtier.transfer import CPUTransferWorker, HostPool, KVCacheRegistration, KVTensor

TPB = BLOCK_SHAPE[1]


def test_results_lost_to_an_interrupt_are_recovered_with_the_real_worker() -> None:
    kv = torch.randn((16, *BLOCK_SHAPE))
    reg = KVCacheRegistration([KVTensor(kv, "flashinfer")])
    pool = HostPool(reg, 1, num_slots=8)
    m = CPUOffloadingManager(pool.num_slots)
    s = OffloadingScheduler(m, tokens_per_block=TPB)
    transfer = CPUTransferWorker(reg, pool)
    w = OffloadingWorker(transfer)
    try:
        hashes = block_hashes("a", 3) + block_hashes("b", 3)
        s.add_request("a", hashes[:3], 3 * TPB + 1)
        s.add_request("b", hashes[3:], 3 * TPB + 1)
        for rid in ("a", "b"):
            assert s.get_num_new_matched_tokens(rid, 0) == 0
        s.update_state_after_alloc("a", [[0, 1, 2, 3]], 0)
        s.update_state_after_alloc("b", [[4, 5, 6, 7]], 0)
        ids: list[int] = []
        for rid, blocks in (("a", [0, 1, 2, 3]), ("b", [4, 5, 6, 7])):
            meta = s.build_step_metadata([StepProgress(rid, [blocks], 3 * TPB)])
            w.start_step(meta)
            w.finish_step(meta)
            ids += [j.job_id for j in meta.stores]
            if rid == "a":
                w.transfer.wait(ids)
                lost = w.get_finished()  # ... and Ctrl-C came before on_worker_results
                assert [r.job_id for r in lost] == ids
        assert s.request_finished("a") and s.request_finished("b")
        # The recovery: let the transfer worker finish, apply what it still has, fail the rest.
        w.transfer.wait(s.job_ids_in_flight())
        s.on_worker_results(w.get_finished())
        assert s.fail_unreported() == ids[:1]
        assert s.take_finished().sending == {"a", "b"}
        st = m.get_stats()
        assert (st.pending_writes, st.pinned, st.failed_stores, st.stores) == (0, 0, 3, 3)
        assert s.num_requests() == 0 and s.num_jobs_in_flight() == 0
        # The lost store's chunks are not served; the reported one's are.
        ctx = ReqContext("c")
        assert m.lookup(make_offload_key(hashes[0], 0), ctx) is LookupResult.MISS
        assert m.lookup(make_offload_key(hashes[3], 0), ctx) is LookupResult.HIT
        # A late copy of a report failed here is refused, not applied twice.
        with pytest.raises(ValueError, match="not in flight"):
            s.on_worker_results(lost)
    finally:
        transfer.shutdown()


def test_one_worker_of_two_gone_fails_the_job_it_owed_and_spares_unsent_jobs() -> None:
    m, s, load_id = sent_load(2)
    s.on_worker_results([TransferResult(load_id, True)], worker=1)
    assert s.fail_unreported(1) == []  # worker 1 owes nothing that was sent
    assert m.get_stats().pinned == 2
    assert s.fail_unreported(0) == [load_id]
    done = s.take_finished()
    assert (done.recving, done.failed_loads, done.failed_load_blocks) == ({"b"}, {"b"}, {4})
    assert m.get_stats().pinned == 1  # c's load, planned and unsent, keeps its pin
    assert s.fail_unreported(0) == [] and s.fail_unreported() == []
    (c_load,) = s.build_step_metadata().loads
    for i in range(2):
        s.on_worker_results([TransferResult(c_load.job_id, True)], worker=i)
    done = s.take_finished()
    assert (done.recving, done.failed_loads) == ({"c"}, set())
    assert m.get_stats().pinned == 0


def test_naming_a_worker_needs_named_reports_and_a_valid_index() -> None:
    m, s, load_id = sent_load(2)
    s.on_worker_results([TransferResult(load_id, True)])  # no worker named
    with pytest.raises(ValueError, match=f"job {load_id} has reports that named no worker"):
        s.fail_unreported(0)
    assert m.get_stats().pinned == 2 and s.num_jobs_in_flight() == 2  # nothing applied
    for bad in (2, -1, True, "0", 0.0):
        with pytest.raises(ValueError, match=r"worker=.* is invalid; expected a worker index"):
            s.fail_unreported(bad)  # type: ignore[arg-type]
    assert s.fail_unreported() == [load_id]  # every worker's missing report: one here
    assert s.take_finished().failed_loads == {"b"}
