"""A prompt stored over several steps (chunked prefill) keeps its head above its tail in the
tier's recency order: the connector tells the policy (`prefix_extended`) after each later
store, so an LRU tier evicts the new tail first, as it does a prompt stored in one call."""

from __future__ import annotations

import pytest

from engine_sim import block_hashes
from helpers import key
from kvtier.base import ReqContext, TransferResult
from kvtier.connector import OffloadingScheduler, StepProgress
from kvtier.connector.metadata import StepMetadata
from kvtier.cpu import CPUOffloadingManager
from kvtier.policies import LRUPolicy, make_policy

A = block_hashes("a", 4)


def _done(s: OffloadingScheduler, meta: StepMetadata) -> None:
    s.on_worker_results([TransferResult(j.job_id, True) for j in (*meta.loads, *meta.stores)])


def _prompt_in_two_steps(policy: str, slots: int) -> OffloadingScheduler:
    """`a`'s four-chunk prompt computed two chunks a step, each step's store done at once."""
    s = OffloadingScheduler(CPUOffloadingManager(slots, cache_policy=policy), tokens_per_block=4)
    s.add_request("a", A, 17)
    assert s.get_num_new_matched_tokens("a", 0) == 0
    table = [[0, 1, 2, 3, 4]]
    _done(s, s.build_step_metadata([StepProgress("a", table, 8)]))
    _done(s, s.build_step_metadata([StepProgress("a", table, 16)]))
    assert not s.request_finished("a")
    return s


def test_the_tail_of_a_prompt_stored_in_two_steps_is_evicted_first() -> None:
    s = _prompt_in_two_steps("lru", 4)
    # b's two chunks need two of a's: the tail (chunks 2-3) must go, not the head.
    s.add_request("b", block_hashes("b", 2), 9)
    assert s.get_num_new_matched_tokens("b", 0) == 0
    _done(s, s.build_step_metadata([StepProgress("b", [[5, 6, 7]], 8)]))
    assert not s.request_finished("b")
    s.add_request("c", block_hashes("c", 1, A), 21)
    # Before, chunks 0-1 (stored first, so least recent) were evicted: no hit at all.
    assert s.get_num_new_matched_tokens("c", 0) == 8


def test_lru_ranks_the_prefix_head_last_and_counts_no_use() -> None:
    lru = LRUPolicy(8)
    ks = [key(i) for i in range(4)]
    lru.insert(ks[:2], None)
    lru.insert([key(9)], None)
    lru.insert(ks[2:], None)
    lru.prefix_extended([*ks, key(50)], None)  # key 50: not held, ignored
    assert lru.evict(5, ()) == [key(9), ks[3], ks[2], ks[1], ks[0]]


@pytest.mark.parametrize("name", ["arc", "s3fifo", "sieve"])  # kvaware: test_kvaware_chunked_1137
def test_policies_without_recency_order_ignore_it(name: str) -> None:
    policy = make_policy(name, 8)
    ks = [key(i) for i in range(3)]
    ctx = ReqContext("r", key_positions={k: 16 * (i + 1) for i, k in enumerate(ks)})
    policy.insert(ks, ctx)
    before = policy.table_sizes()
    policy.prefix_extended(ks, ctx)
    assert policy.table_sizes() == before


def test_the_manager_refuses_a_key_that_is_not_bytes_before_the_policy_sees_it() -> None:
    m = CPUOffloadingManager(4)
    with pytest.raises(TypeError, match="bytes"):
        m.prefix_extended([key(0), 7], ReqContext("r"))  # type: ignore[list-item]
