"""Review of the chunked-prefill change to kvaware (1137): `prefix_extended` and the
deepest-block rule deferred to the request's end.

A replay stores a request's deepest key last and ends the request right after, so deferring
the rule must change nothing there. The reference for "nothing" is the same call order with
the request already finished when its keys are stored: such a store takes the rule at once,
as every store did before the change (checked against the old source by hand).
"""

from __future__ import annotations

import hashlib
import pickle
import random

import pytest

from kvtier.base import OffloadKey, ReqContext, make_offload_key
from kvtier.policies import KVAwarePolicy
from kvtier.policies.kvaware_sketch import MAX_COUNT
from kvtier.sim.replay import make_manager, replay_engine, replay_flat
from kvtier.sim.trace import Request


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def chained(seed: bytes) -> OffloadKey:
    return make_offload_key(hashlib.sha256(seed).digest()[:16], 0)


def state(p: KVAwarePolicy) -> tuple[object, ...]:
    """What decides a policy's future choices (its request bookkeeping left out)."""
    s: tuple[object, ...] = (
        list(p._win.items()),
        sorted(p._credit.items()),
        [(c, list(b)) for c, b in sorted(p._buckets.items())],
        p._floor,
        sorted(p._pinned.items()),
        p._mode,
        p._tail_first,
    )
    if p._models is not None:
        s += (tuple(state(m) for m in p._models), list(p._model_hits))
        if p._replica is not None:
            s += (state(p._replica), p._replica_hits, p._lru_hold)
    return s


def conversations(seed: int, n: int) -> list[Request]:
    """Requests on shared, growing prefixes (chained keys): new ones, follow-ups that extend
    a conversation, and shorter prompts on a known prefix."""
    rnd = random.Random(seed)
    convs: list[list[OffloadKey]] = []
    reqs = []
    for i in range(n):
        if convs and rnd.random() < 0.7:
            c = rnd.choice(convs)
            if rnd.random() < 0.3:
                ks = c[: rnd.randint(1, len(c))]
            else:
                ks = list(c)
                for _ in range(rnd.randint(0, 4)):
                    ks.append(chained(ks[-1] + b"x%d" % rnd.randrange(3)))
                c[:] = ks
        else:
            ks = [chained(b"r%d" % rnd.randrange(10**9))]
            for _ in range(rnd.randint(0, 6)):
                ks.append(chained(ks[-1]))
            convs.append(list(ks))
            if len(convs) > 40:
                convs.pop(rnd.randrange(len(convs)))
        ks = list(dict.fromkeys(ks))
        reqs.append(Request(f"q{i}", ks, len(ks) * 16, 16))
    return reqs


def replay_hits(reqs: list[Request], cap: int, *, finished_first: bool, engine: bool) -> int:
    mgr = make_manager("kvaware", cap)
    if finished_first:
        policy = mgr.policy
        start = mgr.on_new_request

        def on_new_request(ctx: ReqContext) -> None:
            policy.on_request_finished(ctx)  # every store then takes the rule at once
            start(ctx)

        mgr.on_new_request = on_new_request  # type: ignore[method-assign]
    if engine:
        return replay_engine(reqs, mgr, device_blocks=max(2, cap // 8)).hits
    return replay_flat(reqs, mgr).hits


# -- findings ------------------------------------------------------------------------------


@pytest.mark.parametrize(("seed", "cap", "engine"), [(1, 40, False), (2, 40, True)])
def test_replay_figures_are_unchanged_by_the_deferred_rule(
    seed: int, cap: int, engine: bool
) -> None:
    """Failed on the first version of the change: the old source gives 998 hits for
    (1, 40, flat) and 975 for (2, 40, engine), as the finished-first order does; that
    version gave 988 and 977. The replica of the policy (capacity < 512) replays the deepest
    key with the flags in force before the access's mode switch; `_settle_tail` read them at
    the request's end, after it. Each shadow's due rule is now recorded at the store."""
    reqs = conversations(seed, 1500)
    assert replay_hits(reqs, cap, finished_first=False, engine=engine) == replay_hits(
        reqs, cap, finished_first=True, engine=engine
    )


def test_a_mode_switch_on_the_deepest_keys_access_leaves_the_replica_as_before() -> None:
    """Failed on the first version: the directed form of the test above. The deepest key's own
    access switches the policy from LRU (rule off) to mode 1 (rule on). Before the change the
    replica had replayed that access in LRU: the key entered its window unmarked, at the newest
    end; that version's replica marked it and sent it to the front at the request's end."""
    ctx_keys = [key(0), key(1)]

    def run(finished_first: bool) -> KVAwarePolicy:
        policy = KVAwarePolicy(64)
        assert policy._replica is not None and policy._mode == 4
        policy._model_hits[1] = 1.0  # shadow 1 (filter, rule, counts) is ahead
        ctx = ReqContext("r", key_positions={k: 16 * (i + 1) for i, k in enumerate(ctx_keys)})
        if finished_first:
            policy.on_request_finished(ctx)
        policy.insert(ctx_keys, ctx)
        policy.on_request_finished(ctx)
        assert policy._mode == 1
        return policy

    new, old = run(False), run(True)
    assert old._replica is not None and new._replica is not None
    assert list(new._replica._win.items()) == list(old._replica._win.items())


def test_a_shadow_window_hit_on_the_deepest_key_is_not_demoted_as_before() -> None:
    """Failed on the first version: the second way the deferred rule changed a replay. A shadow
    that holds the deepest key in its window while the tier does not (the tier's mode evicted
    it; here a `remove`) took the store as a hit and only moved the key to its newest end,
    unmarked. `_settle_tail` marked it and sent it to the front of shadows 0, 1 and 5."""

    def run(finished_first: bool) -> KVAwarePolicy:
        policy = KVAwarePolicy(64)  # exact shadows: every key sampled
        x = ReqContext("x", key_positions={key(0): 16, key(1): 32, key(2): 48})
        policy.insert([key(0), key(1), key(2)], x)
        policy.on_request_finished(x)
        policy.remove([key(1)])
        y = ReqContext("y", key_positions={key(0): 16, key(1): 32})
        if finished_first:
            policy.on_request_finished(y)
        policy.insert([key(1)], y)
        policy.on_request_finished(y)
        return policy

    new, old = run(False), run(True)
    assert new._models is not None and old._models is not None
    for m_new, m_old in zip(new._models, old._models, strict=True):
        assert list(m_new._win.items()) == list(m_old._win.items())


def test_on_request_finished_that_raises_leaves_the_policy_unchanged() -> None:
    """Failed on the first version: `_settle_tail` popped the request's deferred key, then
    read its table, which raises (a position that is not a number): the policy was changed
    (the key would never take the rule) and the request not finished. Before the change
    `on_request_finished` read no table and did not raise here."""
    policy = KVAwarePolicy(64, mode="open")
    positions: dict[OffloadKey, int] = {key(0): 16, key(1): 32}
    ctx = ReqContext("r", key_positions=positions)
    policy.insert([key(0), key(1)], ctx)
    positions[key(2)] = None  # type: ignore[assignment]  # an unreadable position appended
    before = pickle.dumps(policy)
    try:
        policy.on_request_finished(ctx)
    except TypeError:
        assert pickle.dumps(policy) == before
    else:
        assert "r" in policy._finished


def test_a_late_store_keeps_the_rule_after_its_prefix_extended() -> None:
    """Failed on the first version: a store reported after its request ended takes the
    rule at once (a test of the change checks it), but the connector follows every such
    store with `prefix_extended` (`_extended_prefix` covers stores ending after their
    request), and `_extend` moved the just-demoted deepest key to the window's newest end:
    the next eviction took an older request's block instead."""

    def late_store(extend: bool) -> KVAwarePolicy:
        policy = KVAwarePolicy(64, window=0.1, mode="open")  # a window of 6 keys
        policy.insert([key(100 + i) for i in range(6)], None)  # older blocks, none deepest
        ctx = ReqContext("r", key_positions={key(0): 16, key(1): 32})
        policy.on_request_finished(ctx)
        policy.insert([key(1)], ctx)  # the second step of a chunked prompt, stored late
        if extend:
            policy.prefix_extended([key(0), key(1)], ctx)  # as the connector follows it
        return policy

    assert late_store(False).evict(1, set()) == [key(1)]  # the rule at once
    assert late_store(True).evict(1, set()) == [key(1)]


# -- guards ----------------------------------------------------------------------------------


def credits_in_range(p: KVAwarePolicy) -> None:
    for k, c in p._credit.items():
        assert p._floor <= c <= p._floor + MAX_COUNT, (k, c, p._floor)
        assert k in p._buckets[c] and k not in p._win
    assert sum(map(len, p._buckets.values())) == len(p._credit)
    assert all(p._buckets.values())
    for m in (*(p._models or ()), *([p._replica] if p._replica is not None else [])):
        credits_in_range(m)


@pytest.mark.parametrize("cap", [8, 64, 1024])
def test_guard_credits_stay_in_the_scanned_range_under_chunked_stores(cap: int) -> None:
    """Guard: `_extend` raises a credit to at least floor + count and `_settle_key` drops
    it to the floor; neither may leave [floor, floor + 15], which `_main_victim` scans,
    nor put a key in both the window and the main area, in the policy or its shadows."""
    rnd = random.Random(cap)
    policy = KVAwarePolicy(cap)
    live: dict[str, tuple[ReqContext, list[OffloadKey]]] = {}
    for step in range(4000):
        if len(live) < 4 or rnd.random() < 0.2:
            rid = f"r{step}"
            base = rnd.randrange(4 * cap)
            live[rid] = (ReqContext(rid, key_positions={}), [key(base)])
        rid = rnd.choice(list(live))
        ctx, ks = live[rid]
        new = [key(int.from_bytes(ks[-1][:8], "big") * 7 % (8 * cap) + j) for j in range(3)]
        for k in new:
            ctx.key_positions.setdefault(k, 16 * (len(ctx.key_positions) + 1))
        if len(policy) + len(new) > cap:
            policy.evict(len(policy) + len(new) - cap, set())
        policy.insert(new, ctx)
        ks += new
        policy.prefix_extended(ks, ctx)
        if rnd.random() < 0.3:
            policy.touch(ks[: rnd.randint(1, len(ks))], ctx)
        if rnd.random() < 0.25:
            policy.on_request_finished(ctx)
            del live[rid]
        credits_in_range(policy)
    sizes = policy.table_sizes()
    assert sizes["request_unsettled_tails"] <= 512


def test_guard_prefix_extended_with_unheld_duplicate_keys_and_no_ctx() -> None:
    """Guard: keys the policy does not hold are ignored; repeats and ctx None are fine; a
    prefix longer than the capacity is accepted."""
    policy = KVAwarePolicy(16)
    ks = [key(i) for i in range(8)]
    policy.insert(ks, None)
    before = len(policy)
    policy.prefix_extended([key(50), ks[1], ks[1], key(51), *[key(i) for i in range(40)]], None)
    assert len(policy) == before and all(k in policy for k in ks)
    credits_in_range(policy)


def test_guard_a_bad_ctx_to_prefix_extended_changes_nothing() -> None:
    policy = KVAwarePolicy(16)
    ks = [key(i) for i in range(8)]
    policy.insert(ks, None)
    before = pickle.dumps(policy)
    with pytest.raises(TypeError):
        policy.prefix_extended(ks, "r")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        policy.prefix_extended([*ks, "x"], None)  # type: ignore[list-item]
    assert pickle.dumps(policy) == before
