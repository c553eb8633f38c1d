"""Behaviour of the prefix-aware policy and its frequency sketch, and a Mooncake slice replay."""

from __future__ import annotations

import json
import random
from itertools import islice
from pathlib import Path

import pytest

from helpers import outputs_under_hash_seeds
from kvtier.base import OffloadKey, ReqContext, make_offload_key
from kvtier.policies import CachePolicy, KVAwarePolicy, make_policy, registered_policies
from kvtier.policies.kvaware import FrequencySketch, key_hash

TRACE = (
    Path(__file__).resolve().parents[2]
    / "data/traces/mooncake_conversation/conversation_trace.jsonl"
)


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def request(req: str, ids: list[int]) -> tuple[list[OffloadKey], ReqContext]:
    keys = [key(i) for i in ids]
    return keys, ReqContext(req, key_positions={k: (j + 1) * 16 for j, k in enumerate(keys)})


def access(policy: CachePolicy, k: OffloadKey, ctx: ReqContext | None = None) -> bool:
    """One flat-mode access; True on a hit."""
    if k in policy:
        policy.touch([k], ctx)
        return True
    if len(policy) >= policy.capacity:
        assert policy.evict(1, set()) is not None
    policy.insert([k], ctx)
    return False


# -- the sketch ---------------------------------------------------------------------------


def test_sketch_counts_saturate_and_halve_with_age() -> None:
    sketch = FrequencySketch(width=64, period=1000)
    h = key_hash(key(1))
    for i in range(1, 20):
        assert sketch.add(h) == min(i, 15)
    assert sketch.estimate(h) == sketch.estimate_key(key(1)) == 15
    assert sketch.estimate(key_hash(key(2))) <= 1  # only a collision could count it
    aged = FrequencySketch(width=64, period=8)
    counts = [aged.add(h) for _ in range(8)]
    assert counts[-1] == aged.estimate(h) == 4  # 8 counted, then halved, and add says so
    aged.clear()
    assert aged.estimate(h) == 0 and len(aged) == 4 * 64


@pytest.mark.parametrize(("width", "period"), [(0, 8), (8, 0)])
def test_sketch_rejects_an_empty_shape(width: int, period: int) -> None:
    with pytest.raises(ValueError, match=f"width={width}, period={period}"):
        FrequencySketch(width, period)


def test_key_hash_is_the_same_in_every_process() -> None:
    code = (
        "from kvtier.base import make_offload_key; from kvtier.policies.kvaware import key_hash;"
        "print(key_hash(make_offload_key((7).to_bytes(8, 'big'), 0)))"
    )
    outs = outputs_under_hash_seeds(code, ("1", "2"))
    assert outs == {f"{key_hash(key(7))}\n"}


# -- prefix rules -------------------------------------------------------------------------


def test_request_tail_is_evicted_before_its_head() -> None:
    policy = KVAwarePolicy(8, mode="open")
    keys, ctx = request("r", [1, 2, 3])
    policy.insert(keys, ctx)
    assert policy.evict(1, set()) == [key(3)]
    assert policy.evict(1, set()) == [key(2)]  # then the tail of what is left


def test_deepest_block_follows_a_request_that_grows() -> None:
    # The connector adds each step's chunks to the same ReqContext.key_positions.
    policy = KVAwarePolicy(64, mode="open")
    ctx = ReqContext("r", key_positions={key(0): 16})
    policy.insert([key(0)], ctx)
    ctx.key_positions[key(1)] = 32
    policy.insert([key(1)], ctx)
    assert policy._tail_of(ctx) == key(1)
    ctx.key_positions[key(2)] = 8  # not deeper: the tail stays
    assert policy._tail_of(ctx) == key(1)
    # The same answer whatever other requests came in between.
    twin = KVAwarePolicy(64, mode="open")
    other = ReqContext("o", key_positions={key(9): 16})
    for i, c in ((0, ctx), (9, other), (1, ctx)):
        twin.insert([key(i)], c)
    assert twin._tail_of(ctx) == key(1)


def test_the_deepest_key_of_interleaved_growing_requests_matches_a_full_scan() -> None:
    """Each request's deepest key is kept per request, and only appended keys are read: an
    engine step calls for many requests in turn, and every switch between them read a whole
    table again (O(request length) per call). Ties keep the earlier key, as max() does."""
    rng = random.Random(7)
    policy = KVAwarePolicy(64, mode="open")
    tables: dict[str, dict[OffloadKey, int]] = {f"r{i}": {} for i in range(5)}
    for step in range(2_000):
        req = rng.choice(list(tables))
        table = tables[req]
        for _ in range(rng.randint(0, 3)):
            table[key(1_000 * int(req[1:]) + len(table))] = 16 * rng.randint(1, 12)
        if not table:
            continue
        got = policy._tail_of(ReqContext(req, key_positions=table))
        assert got == max(table, key=table.__getitem__), (step, req)
    assert policy.table_sizes()["request_tails"] == 5
    for req in tables:
        policy.on_request_finished(ReqContext(req))
    assert policy.table_sizes()["request_tails"] == 0


def test_a_new_table_of_the_same_request_is_read_afresh() -> None:
    # A caller may build a ReqContext (and its table) per call of one request.
    def victims(first_req: str) -> list[OffloadKey] | None:
        policy = KVAwarePolicy(8, mode="filter")
        policy.insert(*request(first_req, [10, 11, 12, 13]))
        policy.insert(*request("r", [22, 23, 24, 25]))
        return policy.evict(4, set())

    assert victims("r") == victims("q")
    policy = KVAwarePolicy(64, mode="open")
    assert policy._tail_of(ReqContext("r", key_positions={key(2): 32})) == key(2)
    # Larger, but not the old table grown by appending.
    grown = ReqContext("r", key_positions={key(4): 64, key(2): 32})
    assert policy._tail_of(grown) == key(4)
    same_size = ReqContext("r", key_positions={key(5): 16, key(6): 8})
    assert policy._tail_of(same_size) == key(5)


def test_protected_keys_set_aside_in_evict_leave_the_order_unchanged() -> None:
    # evict() sets protected keys at the front of a bucket aside instead of rescanning them
    # for every victim; the victims and the order left behind must be the plain scan's.
    rng = random.Random(5)
    fast, slow = KVAwarePolicy(48, mode="filter"), KVAwarePolicy(48, mode="filter")
    slow._main_victim = lambda protected, aside=None: KVAwarePolicy._main_victim(  # type: ignore[method-assign]
        slow, protected
    )
    for step in range(20_000):
        k = key(rng.randrange(200))
        c = ReqContext(str(step // 6), key_positions={k: rng.randint(1, 8) * 16})
        if k in fast:
            fast.touch([k], c)
            slow.touch([k], c)
            continue
        if len(fast) >= 48:
            held = [h for h in map(key, range(200)) if h in fast]
            protected = set(rng.sample(held, rng.randrange(len(held) // 2)))
            n = rng.randint(1, 4)
            assert fast.evict(n, protected) == slow.evict(n, protected)
        fast.insert([k], c)
        slow.insert([k], c)
    assert fast.evict(len(fast), set()) == slow.evict(len(slow), set())


def test_head_of_a_call_outlives_its_tail() -> None:
    policy = KVAwarePolicy(8, mode="open")
    policy.insert([key(i) for i in range(4)], None)  # no context: no deepest-block rule
    policy.touch([key(i) for i in range(4)], None)
    assert policy.evict(4, set()) == [key(3), key(2), key(1), key(0)]


def test_frequently_used_block_outlives_newer_ones() -> None:
    policy = KVAwarePolicy(4, mode="open")
    for r in range(3):
        keys, ctx = request(f"r{r}", [0, 100 + r])  # block 0: a shared system prompt
        policy.insert(keys, ctx)
        policy.touch(keys, ctx)
    victims = policy.evict(3, set())
    assert victims is not None and key(0) not in victims


def test_filter_rejects_a_one_off_block_and_keeps_a_frequent_one() -> None:
    policy = KVAwarePolicy(4, mode="filter")
    hot = [key(i) for i in range(3)]
    for _ in range(3):
        for k in hot:
            access(policy, k)
    for i in range(100, 140):  # a scan of one-off blocks
        access(policy, key(i))
    assert all(k in policy for k in hot)
    open_policy = KVAwarePolicy(4, mode="open")
    for _ in range(3):
        for k in hot:
            access(open_policy, k)
    for i in range(100, 140):
        access(open_policy, key(i))
    assert not any(k in open_policy for k in hot)


def test_returning_block_passes_the_filter_on_its_remembered_count() -> None:
    policy = KVAwarePolicy(4, mode="filter")
    for i in range(4):
        access(policy, key(i))
    access(policy, key(50))  # seen once, evicted
    for i in range(100, 110):
        access(policy, key(i))
    assert key(50) not in policy
    for _ in range(3):  # comes back: its count, remembered past eviction, wins a place
        access(policy, key(50))
    for i in range(200, 203):
        access(policy, key(i))
    assert key(50) in policy


def test_uses_served_by_the_device_count_towards_the_filter() -> None:
    # Behind an engine's prefix cache a hot block is touched while the tier does not hold it
    # (the device served it). When the device finally evicts it and the tier stores it, those
    # uses must count, or it duels as a newcomer and loses to the one-off blocks' counts.
    policy = KVAwarePolicy(4, mode="filter")
    for i in range(4):
        access(policy, key(i))
    hot = key(50)
    for r in range(3):
        policy.touch([hot], ReqContext(f"r{r}"))
    assert hot not in policy and len(policy) == 4
    access(policy, hot)
    for i in range(200, 203):
        access(policy, key(i))
    assert hot in policy
    assert policy._sketch.estimate_key(hot) == 4


def test_pinned_touch_is_counted_once_at_unpin() -> None:
    policy = KVAwarePolicy(8)
    (k,), ctx = request("r1", [1])
    policy.insert([k], ctx)
    policy.pin([k])
    policy.touch([k], ReqContext("r2"))  # neither resident in a list nor absent: no count
    assert policy._sketch.estimate_key(k) == 1
    policy.unpin([k], ReqContext("r2"))
    assert policy._sketch.estimate_key(k) == 2


def test_shadows_switch_the_filter_by_workload() -> None:
    # A hot set re-used between long scans of one-off blocks: filtering wins.
    scan = KVAwarePolicy(64)
    n = 0
    for _ in range(60):
        for i in range(40):
            access(scan, key(i))
        for _ in range(200):
            access(scan, key(10_000 + n))
            n += 1
    assert scan.filtering
    # A loop that just fits: every block is re-used soon, filtering only delays hits.
    loop = KVAwarePolicy(64)
    for _ in range(200):
        for i in range(60):
            access(loop, key(i))
    assert not loop.filtering


def test_adaptive_policy_evicts_like_lru_until_a_shadow_wins() -> None:
    # Block 0-9 are used often, then 54 new blocks arrive. Nothing was evicted yet, so every
    # shadow has the same hits and none has earned a switch: the policy is still plain LRU and
    # evicts the least recent blocks, the frequent ones (a frequency mode would keep them).
    lru, policy = make_policy("lru", 64), KVAwarePolicy(64)
    for p in (lru, policy):
        for _ in range(5):
            for i in range(10):
                if key(i) in p:
                    p.touch([key(i)], None)
                else:
                    p.insert([key(i)], None)
        for i in range(10, 64):
            p.insert([key(i)], None)
    assert not policy.filtering
    assert policy.evict(10, set()) == lru.evict(10, set()) == [key(i) for i in range(10)]


def _reuse_once_hits(policy: CachePolicy, n: int) -> int:
    """Every block is used twice, 20 accesses apart: LRU hits every second use, while a
    filter keeps out each block before its reuse."""
    hits = 0
    for i in range(n):
        hits += access(policy, key(i))
        if i >= 20:
            hits += access(policy, key(i - 20))
    return hits


def test_a_lying_shadow_cannot_hold_a_small_tier_away_from_lru() -> None:
    # The filter shadow claims a hit on every access (as phantom hits behind a device cache
    # can), so it always leads and the policy keeps switching to the filter. The replica of
    # the policy shows what that costs against the LRU shadow, and the guard returns to LRU.
    lru = _reuse_once_hits(make_policy("lru", 64), 6000)
    policy = KVAwarePolicy(64)
    assert policy.table_sizes()["replica"] == 0  # exact shadows: the guard is on
    policy._models[3]._replay = lambda *_: 1  # type: ignore[index, method-assign]
    assert _reuse_once_hits(policy, 6000) > 0.8 * lru
    # Sampled shadows cannot replicate the tier, so large tiers have no guard.
    assert "replica" not in KVAwarePolicy(4096).table_sizes()


# -- bookkeeping --------------------------------------------------------------------------


def test_pinned_keys_return_to_where_they_were() -> None:
    policy = KVAwarePolicy(8, mode="open")
    keys = [key(i) for i in range(8)]
    for k in keys:
        access(policy, k)
    policy.evict(1, set())  # moves the window surplus to main
    sizes = policy.table_sizes()
    assert sizes["window"] == 0 and sizes["credits"] == 7
    policy.pin(keys[1:3])
    assert policy.table_sizes()["pinned"] == 2 and len(policy) == 5
    policy.unpin(keys[1:3], None)
    assert policy.table_sizes()["credits"] == 7 and policy.table_sizes()["pinned"] == 0


def test_floor_does_not_strand_protected_keys() -> None:
    policy = KVAwarePolicy(4, mode="open")
    keys, _ = request("r", [1, 2, 3])
    policy.insert(keys, None)
    policy.touch(keys[1:], None)
    assert policy.evict(2, {key(1)}) == [key(3), key(2)]
    assert policy.evict(1, set()) == [key(1)]


def test_shadows_are_sampled_and_bounded_at_large_capacity() -> None:
    capacity = 4096
    policy = KVAwarePolicy(capacity, model_size=256)
    for i in range(3 * capacity):
        access(policy, key(i % (2 * capacity)))
    sizes = policy.table_sizes()
    shadows = [v for n, v in sizes.items() if n.startswith("shadow")]
    assert len(shadows) == 6 and all(0 < v <= capacity // 8 for v in shadows)
    assert sum(shadows) <= 6 * 2 * 256  # a constant, whatever the capacity
    assert sizes["window"] + sizes["credits"] == capacity
    assert sizes["buckets"] <= 16
    assert sizes["sketch_counters"] == 4 * 32 * capacity
    policy.clear()
    assert len(policy) == 0 and sizes["sketch_counters"] == policy.table_sizes()["sketch_counters"]


def test_a_key_counts_once_per_request_however_often_it_is_reported() -> None:
    # An engine reports one use several times: a device hit when the request arrives and
    # again when it ends, a load's unpin and the same end-of-request touch.
    policy = KVAwarePolicy(8)
    (k,), ctx = request("r1", [1])
    policy.insert([k], ctx)
    policy.touch([k], ctx)
    policy.pin([k])
    policy.unpin([k], ctx)
    policy.touch([k], ctx)
    assert policy._sketch.estimate_key(k) == 1
    for n, req in enumerate(("r2", "r3"), start=2):
        policy.touch([k], ReqContext(req))
        policy.touch([k], ReqContext(req))
        assert policy._sketch.estimate_key(k) == n
    # Without a request there is nothing to deduplicate against: every report counts.
    policy.touch([k], None)
    assert policy._sketch.estimate_key(k) == 4


def test_finished_requests_forget_their_counted_keys() -> None:
    policy = KVAwarePolicy(8)
    keys, ctx = request("r1", [1, 2, 3])
    policy.insert(keys, ctx)
    assert policy.table_sizes()["request_keys_live"] == 3
    policy.on_request_finished(ctx)
    assert policy.table_sizes()["request_keys_live"] == 0
    # Requests never finished are forgotten oldest first beyond a fixed number.
    for r in range(2000):
        policy.touch(keys, ReqContext(f"x{r}"))
        assert len(policy._counted) <= 512
    assert policy.table_sizes()["request_keys_live"] == 3 * 512


def test_one_request_id_for_every_call_cannot_grow_the_tables() -> None:
    policy = KVAwarePolicy(8)
    ctx = ReqContext("always-the-same")
    for i in range(5000):
        access(policy, key(i), ctx)
        assert policy.table_sizes()["request_keys_live"] <= 1024
    assert policy.table_sizes()["request_keys_live"] == len(policy._counted_keys)
    # After the reset its keys count again: a key seen long ago is not stuck at one.
    k = key(0)
    before = policy._sketch.estimate_key(k)
    policy.touch([k], ctx) if k in policy else policy.insert([k], ctx)
    assert policy._sketch.estimate_key(k) == min(before + 1, 15)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"window": 0.0}, "window=0.0"),
        ({"window": 1.0}, "window=1.0"),
        ({"sketch_width": 0}, "sketch_width=0"),
        ({"model_size": 0}, "model_size=0"),
        ({"mode": "lfu"}, "mode='lfu'"),
    ],
)
def test_bad_parameters_are_rejected(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KVAwarePolicy(4, **kwargs)  # type: ignore[arg-type]


# -- a slice of the real trace ------------------------------------------------------------


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
    assert ratios["kvaware"] >= max(ratios.values())
