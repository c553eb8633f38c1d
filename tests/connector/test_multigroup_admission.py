"""A hybrid model's chunks offered to a reuse tracker smaller than the offer. A chunk hits only
if every KV-cache group holds it, so the tracker must keep whole chunks: it kept the offer's
first keys, and offered group by group those were all of group 0's and none of group 1's. The
next request then stored group 0's chunks alone, slots spent on chunks that never load."""

from __future__ import annotations

from helpers import key
from kvtier.base import TransferResult
from kvtier.connector.scheduler import OffloadingScheduler, StepProgress
from kvtier.cpu import CPUOffloadingManager

TOKENS_PER_BLOCK, CHUNKS = 4, 6


def test_a_tracker_smaller_than_the_offer_keeps_whole_chunks() -> None:
    # 2 groups x 6 chunks = 12 keys an offer, against a tracker of 8.
    manager = CPUOffloadingManager(64, "lru", store_threshold=2, max_tracker_size=8)
    s = OffloadingScheduler(manager, tokens_per_block=TOKENS_PER_BLOCK, groups=(0, 1))
    hashes = [i.to_bytes(8, "big") for i in range(1, CHUNKS + 1)]
    blocks = [list(range(CHUNKS)), list(range(CHUNKS))]
    for req in ("a", "b"):
        s.add_request(req, hashes, CHUNKS * TOKENS_PER_BLOCK)
        s.get_num_new_matched_tokens(req, 0)
        s.update_state_after_alloc(req, blocks, 0)
        meta = s.build_step_metadata([StepProgress(req, blocks, CHUNKS * TOKENS_PER_BLOCK)])
        s.on_worker_results([TransferResult(j.job_id, True, 0, 0.0) for j in meta.stores])
        s.request_finished(req)
    held = {g: [key(i, g) in manager._slot_of for i in range(1, CHUNKS + 1)] for g in (0, 1)}
    assert held[0] == held[1], "a chunk stored for one group only"
    assert held[0] == [True] * 4 + [False] * 2  # the 8 tracked keys: chunks 1-4, both groups
    s.add_request("c", hashes, CHUNKS * TOKENS_PER_BLOCK)
    assert s.get_num_new_matched_tokens("c", 0) == 4 * TOKENS_PER_BLOCK
