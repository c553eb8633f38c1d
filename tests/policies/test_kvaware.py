"""Behaviour of the prefix-aware policy, and a replay of a slice of the Mooncake trace."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest

from kvtier.base import OffloadKey, ReqContext, make_offload_key
from kvtier.policies import KVAwarePolicy, make_policy, registered_policies

TRACE = (
    Path(__file__).resolve().parents[2]
    / "data/traces/mooncake_conversation/conversation_trace.jsonl"
)


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def request(req: str, ids: list[int]) -> tuple[list[OffloadKey], ReqContext]:
    keys = [key(i) for i in ids]
    return keys, ReqContext(req, key_positions={k: (j + 1) * 16 for j, k in enumerate(keys)})


def test_request_tail_is_evicted_before_its_head() -> None:
    policy = KVAwarePolicy(8)
    keys, ctx = request("r", [1, 2, 3])
    policy.insert(keys, ctx)
    assert policy.evict(1, set()) == [key(3)]


def test_frequently_used_block_outlives_newer_ones() -> None:
    policy = KVAwarePolicy(4)
    for r in range(3):
        keys, ctx = request(f"r{r}", [0, 100 + r])  # block 0: a shared system prompt
        policy.insert(keys, ctx)
        policy.touch(keys, ctx)
    victims = policy.evict(3, set())
    assert victims is not None and key(0) not in victims


def test_use_count_survives_eviction_within_history_bound() -> None:
    policy = KVAwarePolicy(2, history_factor=2)
    keys, ctx = request("a", [1, 2])
    policy.insert(keys, ctx)
    policy.touch(keys[:1], ctx)
    assert sorted(policy.evict(2, set()) or []) == sorted(keys)
    keys_b, ctx_b = request("b", [1, 7])  # key 1 returns with its count: outlives key 7
    policy.insert(keys_b, ctx_b)
    policy.touch([key(7)], ReqContext("c"))
    assert policy.evict(1, set()) == [key(7)]
    assert policy.table_sizes()["history"] <= 4


def test_floor_does_not_strand_protected_keys() -> None:
    policy = KVAwarePolicy(4)
    keys, _ = request("r", [1, 2, 3])
    policy.insert(keys, None)
    policy.touch(keys[1:], None)
    assert policy.evict(2, {key(1)}) == [key(2), key(3)]
    assert policy.evict(1, set()) == [key(1)]


def test_bad_parameters_are_rejected() -> None:
    with pytest.raises(ValueError, match="history_factor=0"):
        KVAwarePolicy(4, history_factor=0)
    with pytest.raises(ValueError, match="max_count=0"):
        KVAwarePolicy(4, max_count=0)


def _flat_hit_ratio(name: str, requests: list[list[int]], capacity: int) -> float:
    policy = make_policy(name, capacity)
    resident: set[OffloadKey] = set()
    hits = total = 0
    for i, ids in enumerate(requests):
        keys, ctx = request(str(i), ids)
        for k in keys:
            total += 1
            if k in resident:
                hits += 1
                policy.touch([k], ctx)
                continue
            if len(resident) >= capacity:
                victims = policy.evict(1, set())
                assert victims is not None
                resident.discard(victims[0])
            policy.insert([k], ctx)
            resident.add(k)
        policy.on_request_finished(ctx)
    return hits / total


def test_mooncake_slice_replays_for_every_policy() -> None:
    with TRACE.open() as f:
        requests = [json.loads(line)["hash_ids"] for line in islice(f, 1500)]
    unique = len({b for r in requests for b in r})
    ratios = {n: _flat_hit_ratio(n, requests, unique // 20) for n in registered_policies()}
    infinite = _flat_hit_ratio("lru", requests, unique)
    assert all(0.0 < r <= infinite for r in ratios.values())
    assert ratios["kvaware"] >= ratios["lru"]
