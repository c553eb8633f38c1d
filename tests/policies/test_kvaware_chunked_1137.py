"""kvaware behind an engine that stores a prompt over several steps (chunked prefill): each
step's store is its own `insert`, whose last chunk is the request's deepest so far. The
connector's `prefix_extended` then ranks the prefix as one store would have, and the
deepest-block rule waits for the request's end, so that no step's last chunk is sent out
first and the prompt cut there (a lookup stops at the first miss)."""

from __future__ import annotations

import pytest

from kvtier.base import OffloadKey, ReqContext, make_offload_key
from kvtier.policies import KVAwarePolicy


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def store_in_steps(policy: KVAwarePolicy, ctx: ReqContext, steps: list[list[int]]) -> None:
    """Each step: its chunks' positions added to the request's table, inserted, and the
    prefix up to them announced, as the connector does."""
    done: list[OffloadKey] = []
    for ids in steps:
        keys = [key(i) for i in ids]
        for k in keys:
            ctx.key_positions[k] = (len(ctx.key_positions) + 1) * 16
        policy.insert(keys, ctx)
        done += keys
        policy.prefix_extended(done, ctx)


@pytest.mark.parametrize("mode", ["adaptive", "open"])
def test_a_prompt_stored_in_steps_leaves_from_its_tail(mode: str) -> None:
    """Fails on the old source: kvaware ignored `prefix_extended`, so the adaptive policy
    (plain LRU until a shadow wins) evicted the first step's chunks first ([1, 0, 3, 2]),
    and with the deepest-block rule on the first step's last chunk went first ([3, 1, 0, 2]):
    either way the prompt was cut at its head."""
    policy = KVAwarePolicy(8, mode=mode)
    store_in_steps(policy, ReqContext("r", key_positions={}), [[0, 1], [2, 3]])
    assert policy.evict(4, set()) == [key(3), key(2), key(1), key(0)]


def test_the_deepest_block_rule_waits_for_the_request_end() -> None:
    """Fails on the old source: a live request's deepest chunk so far was sent out before an
    older request's block, though the request's next step may extend it."""
    policy = KVAwarePolicy(64, mode="open")
    old = ReqContext("x", key_positions={key(100): 16})
    policy.insert([key(100)], old)
    policy.on_request_finished(old)
    ctx = ReqContext("r", key_positions={key(0): 16, key(1): 32})
    policy.insert([key(0), key(1)], ctx)
    assert policy.evict(1, set()) == [key(100)]
    policy.on_request_finished(ctx)  # its deepest block is known now, and goes first
    assert policy.evict(1, set()) == [key(1)]


def test_only_the_last_steps_deepest_chunk_is_demoted_at_the_end() -> None:
    policy = KVAwarePolicy(64, mode="open")
    old = ReqContext("x", key_positions={key(100): 16})
    policy.insert([key(100)], old)
    policy.on_request_finished(old)
    ctx = ReqContext("r", key_positions={})
    store_in_steps(policy, ctx, [[0, 1], [2, 3]])
    policy.on_request_finished(ctx)
    # The request's tail goes first; the first step's last chunk is a middle one now.
    assert policy.evict(2, set()) == [key(3), key(100)]


def test_a_late_store_of_a_finished_request_takes_the_rule_at_once() -> None:
    """A store reported after its request ended (an engine that ends requests first) has no
    end left to wait for."""
    policy = KVAwarePolicy(64, mode="open")
    old = ReqContext("x", key_positions={key(100): 16})
    policy.insert([key(100)], old)
    policy.on_request_finished(old)
    ctx = ReqContext("r", key_positions={key(0): 16, key(1): 32})
    policy.on_request_finished(ctx)
    policy.insert([key(0), key(1)], ctx)
    assert policy.evict(1, set()) == [key(1)]


def test_deferred_tails_are_bounded_and_cleared() -> None:
    policy = KVAwarePolicy(64, mode="open")
    for r in range(600):
        ctx = ReqContext(f"r{r}", key_positions={key(r): 16})
        if len(policy) >= policy.capacity:
            policy.evict(1, set())
        policy.insert([key(r)], ctx)
    assert policy.table_sizes()["request_unsettled_tails"] == 512
    policy.clear()
    assert policy.table_sizes()["request_unsettled_tails"] == 0


def test_prefix_extended_refuses_a_bad_context_before_anything_moves() -> None:
    policy = KVAwarePolicy(8)
    ctx = ReqContext("r", key_positions={})
    store_in_steps(policy, ctx, [[0, 1], [2, 3]])
    before = policy.evict(4, set())
    policy = KVAwarePolicy(8)
    ctx = ReqContext("r", key_positions={})
    store_in_steps(policy, ctx, [[0, 1], [2, 3]])
    with pytest.raises(TypeError, match="expected a ReqContext"):
        policy.prefix_extended([key(1), key(0)], "r")  # type: ignore[arg-type]
    assert policy.evict(4, set()) == before


def test_the_shadows_cache_a_growing_prefix_within_bounds() -> None:
    """The sampled keys of a request's prefix are kept between its calls, at most twice a
    shadow's capacity per request, and dropped at its end."""
    policy = KVAwarePolicy(4096)  # shadows of 256 slots: one key in 16 sampled
    ctx = ReqContext("r", key_positions={})
    store_in_steps(policy, ctx, [list(range(a, a + 256)) for a in range(0, 2048, 256)])
    sizes = policy.table_sizes()
    assert 0 < sizes["request_prefix_samples"] <= 2 * 256
    more = [key(i) for i in range(2048, 10240)]
    for k in more:
        ctx.key_positions[k] = (len(ctx.key_positions) + 1) * 16
    policy.insert(more, ctx)
    policy.prefix_extended([key(i) for i in range(10240)], ctx)
    assert policy.table_sizes()["request_prefix_samples"] == 0  # too long to keep
    policy.on_request_finished(ctx)
    assert policy.table_sizes()["request_prefix_samples"] == 0
