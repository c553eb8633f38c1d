"""Findings of an adversarial review of the cache policies (contract, bounds, determinism).

An engine's transfers may complete after its request ended (`OffloadingManager.
on_request_finished`: "its transfers may still complete afterwards"; the connector finishes a
request at `request_finished` and completes its store jobs when their reports are in). kvaware
took such a late report for a new live request: it kept the finished request's counted keys
and its whole `key_positions` table again, and nothing dropped them, so finished requests
filled the 512 request entries and pushed out the counted keys of requests still running,
whose repeated reports then counted twice.
"""

from __future__ import annotations

import pytest

from helpers import outputs_under_hash_seeds
from kvtier.base import OffloadKey, ReqContext, make_offload_key
from kvtier.cpu import CPUOffloadingManager
from kvtier.policies import KVAwarePolicy, registered_policies


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def _finish_before_the_store_lands(m: CPUOffloadingManager, req_id: str, first: int) -> None:
    """One request in the connector's order: its store is prepared, the request ends, and
    the store completes afterwards."""
    keys = [key(first + j) for j in range(4)]
    ctx = ReqContext(req_id, key_positions={k: 16 * (j + 1) for j, k in enumerate(keys)})
    out = m.prepare_store(keys, ctx)
    assert out is not None
    m.on_request_finished(ctx)
    m.complete_store(out.keys_to_store, ctx)


def test_kvaware_a_store_completed_after_its_request_ended_leaves_no_live_request() -> None:
    m = CPUOffloadingManager(64, "kvaware")
    for i in range(10):
        _finish_before_the_store_lands(m, f"req-{i}", 4 * i)
    policy = m.policy
    assert isinstance(policy, KVAwarePolicy)
    sizes = policy.table_sizes()
    # The finished requests' tables (their key_positions) are not held again.
    assert sizes["request_tails"] == 0, sizes
    assert not policy._counted, list(policy._counted)  # no finished request counts as live
    assert sizes["request_finished"] == 10
    policy.clear()
    assert all(v == 0 for n, v in policy.table_sizes().items() if n != "sketch_counters")


def test_kvaware_late_reports_do_not_push_out_a_live_requests_counted_keys() -> None:
    """A request still running reports a use at its arrival and again at its end; 600
    requests that finished before their stores landed, in between, made the second report
    count again."""
    m = CPUOffloadingManager(4096, "kvaware")  # a sketch period far beyond this test
    policy = m.policy
    assert isinstance(policy, KVAwarePolicy)
    live = ReqContext("live")
    hit = key(10**6)
    m.touch([hit], live)  # a device hit, reported when the request arrives
    for i in range(600):
        _finish_before_the_store_lands(m, f"req-{i}", 4 * i)
    m.touch([hit], live)  # the same use, reported again when it ends
    assert policy._sketch.estimate_key(hit) == 1
    assert len(policy._counted) + len(policy._counted_late) <= 512


def test_kvaware_a_finished_requests_late_reports_count_once_each() -> None:
    """The late reports themselves are counted once per request, as before."""
    policy = KVAwarePolicy(64)
    ctx = ReqContext("r", key_positions={key(1): 16, key(2): 32})
    policy.insert([key(1)], ctx)
    policy.on_request_finished(ctx)
    policy.insert([key(2)], ctx)  # its last store lands late
    policy.touch([key(2)], ctx)  # and is reported again
    policy.touch([key(2)], ReqContext("other"))
    policy.touch([key(2)], ctx)
    assert policy._sketch.estimate_key(key(2)) == 2  # "r" once, "other" once


def test_kvaware_a_request_reusing_a_finished_id_is_counted_anew_and_once() -> None:
    policy = KVAwarePolicy(64)
    policy.insert([key(0)], ReqContext("writer"))
    for _ in range(2):
        ctx = ReqContext("chat-7")
        policy.touch([key(0)], ctx)
        policy.touch([key(9)], ReqContext("between"))  # reports interleave
        policy.touch([key(0)], ctx)
        policy.on_request_finished(ctx)
    assert policy._sketch.estimate_key(key(0)) == 3  # the writer and each request once


def test_kvaware_remembers_finished_requests_within_twice_its_capacity() -> None:
    for capacity in (1, 2, 64):
        policy = KVAwarePolicy(capacity)
        for i in range(10_000):
            policy.on_request_finished(ReqContext(f"r{i}"))  # unknown requests included
        assert policy.table_sizes()["request_finished"] == min(2 * capacity, 4096)
    policy = KVAwarePolicy(100_000)
    for i in range(10_000):
        policy.on_request_finished(ReqContext(f"r{i}"))
    assert policy.table_sizes()["request_finished"] == 4096


@pytest.mark.parametrize("mode", ["adaptive", "filter", "open"])
def test_kvaware_reports_its_sketch_in_every_mode(mode: str) -> None:
    """The fixed modes have the same sketch, which `table_sizes` left out: a bound check over
    the reported tables could not see 128 bytes a slot."""
    sizes = KVAwarePolicy(64, mode=mode).table_sizes()
    assert sizes["sketch_counters"] == 4 * 32 * 64


_REPLAY = """
import hashlib
import random
from kvtier.base import ReqContext, make_offload_key
from kvtier.cpu import CPUOffloadingManager

out = []
for name in {names!r}:
    for cap in (3, 40, 600):
        rng = random.Random(cap)
        m = CPUOffloadingManager(cap, name)
        loads = []
        for step in range(3000):
            rid = f"r{{rng.randrange(30)}}"
            ks = [make_offload_key(rng.randrange(3 * cap).to_bytes(8, "big"), 0)
                  for _ in range(rng.randint(1, 4))]
            ctx = ReqContext(rid, key_positions={{k: 16 * (i + 1) for i, k in enumerate(ks)}})
            hits = [k for k in ks if m.lookup(k, ctx).name == "HIT"]
            m.touch(hits, ctx)
            if hits and rng.random() < 0.5:
                m.prepare_load(hits, ctx)
                loads.append((hits, ctx))
            while len(loads) > 2:
                m.complete_load(*loads.pop(0))
            res = m.prepare_store(ks, ctx)
            if res is not None:
                out.append(res.evicted_keys)
                m.complete_store(res.keys_to_store, ctx, success=rng.random() < 0.9)
            if rng.random() < 0.2:
                m.on_request_finished(ctx)
print(hashlib.sha256(repr(out).encode()).hexdigest())
"""


def test_every_policy_evicts_the_same_keys_whatever_the_hash_seed() -> None:
    """Replays must be reproducible: no policy's choice may depend on PYTHONHASHSEED (str and
    bytes hashes are salted per process)."""
    code = _REPLAY.format(names=sorted(registered_policies()))
    outs = outputs_under_hash_seeds(code, ("0", "1", "4242"))
    assert len(outs) == 1, outs
