"""`OffloadingScheduler.store_chunks`: which chunk of its request each key of a store job is,
for KV events that describe the chunk's blocks and tokens."""

from __future__ import annotations

import pytest

from engine_sim import block_hashes, stored_manager
from kvtier.base import TransferResult, make_offload_key
from kvtier.connector import OffloadingScheduler, StepProgress


def test_store_chunks_name_each_chunk_of_the_job_in_every_group() -> None:
    hashes = block_hashes("a", 6)
    # Chunk 1 (blocks 2-3) is held already: the job writes chunks 0 and 2 only.
    m = stored_manager(32, [hashes[3]], groups=(0, 1))
    s = OffloadingScheduler(m, tokens_per_block=4, blocks_per_chunk=2, groups=(0, 1))
    s.add_request("a", hashes, 25)
    assert s.get_num_new_matched_tokens("a", 0) == 0
    s.update_state_after_alloc("a", (), 0)
    step = s.build_step_metadata([StepProgress("a", [list(range(6)), list(range(6, 12))], 24)])
    by_group = {job.group: s.store_chunks(job.job_id) for job in step.stores}
    assert by_group == {
        g: [(make_offload_key(hashes[1], g), 0), (make_offload_key(hashes[5], g), 2)]
        for g in (0, 1)
    }
    for job in step.stores:
        s.on_worker_results([TransferResult(job.job_id, True)])
        with pytest.raises(ValueError, match=f"job {job.job_id} is not a store job in flight"):
            s.store_chunks(job.job_id)


def test_a_load_job_has_no_store_chunks() -> None:
    hashes = block_hashes("b", 2)
    m = stored_manager(8, hashes)
    s = OffloadingScheduler(m, tokens_per_block=4)
    s.add_request("b", hashes, 9)
    assert s.get_num_new_matched_tokens("b", 0) == 8
    s.update_state_after_alloc("b", [[0, 1, 2]], 8)
    (load,) = s.build_step_metadata().loads
    with pytest.raises(ValueError, match=f"job {load.job_id} is not a store job in flight"):
        s.store_chunks(load.job_id)
