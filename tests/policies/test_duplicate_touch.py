"""A key repeated in one `touch` without a request context is one use ."""

from __future__ import annotations

import random

import pytest

from helpers import run_reports
from kvtier.base import OffloadKey, ReqContext, make_offload_key
from kvtier.policies import KVAwarePolicy, S3FIFOPolicy


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


@pytest.mark.parametrize("where", ["window", "main", "absent"])
def test_kvaware_touch_repeated_key_without_ctx_counts_once(where: str) -> None:
    policy = KVAwarePolicy(64, mode="filter")
    k = key(1)
    if where != "absent":
        policy.insert([k], None)  # one use
    if where == "main":
        # Fill past the window so that k moves to the main area.
        policy.insert([key(i) for i in range(2, 10)], None)
        policy.evict(1, {k})
        assert k in policy
    before = policy._sketch.estimate_key(k)
    policy.touch([k, k], None)
    assert policy._sketch.estimate_key(k) == before + 1
    policy.touch([k, key(99), k], None)
    assert policy._sketch.estimate_key(k) == before + 2


def test_kvaware_touch_repeated_key_matches_request_path() -> None:
    with_ctx = KVAwarePolicy(64, mode="open")
    without = KVAwarePolicy(64, mode="open")
    k = key(7)
    with_ctx.touch([k, k, k], ReqContext("r"))
    without.touch([k, k, k], None)
    assert with_ctx._sketch.estimate_key(k) == without._sketch.estimate_key(k) == 1


def test_kvaware_adaptive_shadows_see_repeated_key_once() -> None:
    # The shadows replay each counted use: a repeat must not be a second shadow access.
    a = KVAwarePolicy(64)
    b = KVAwarePolicy(64)
    k = key(3)
    a.touch([k, k], None)
    b.touch([k], None)
    assert a._model_hits == b._model_hits
    assert [len(m) for m in a._models or ()] == [len(m) for m in b._models or ()]


def test_s3fifo_touch_repeated_key_without_ctx_counts_once() -> None:
    policy = S3FIFOPolicy(10)
    k = key(1)
    policy.insert([k], None)
    policy.touch([k, k], None)
    assert policy._small[k] == 1


def _state(policy: KVAwarePolicy) -> tuple[object, ...]:
    return (
        list(policy._win.items()),
        dict(policy._credit),
        {c: list(b) for c, b in policy._buckets.items()},
        policy._floor,
        policy._mode,
    )


@pytest.mark.parametrize("ctx", [ReqContext("r0"), None], ids=["request", "no-request"])
def test_kvaware_repeat_after_a_mode_switch_changes_nothing(ctx: ReqContext | None) -> None:
    # Found by test_repeated_uses' property: touching [3, 0] counts 0 under plain LRU (credit
    # floor + 1), then 3's use switches the mode to counting; the repeat of 0 was placed again
    # under the new mode, at floor + its count: the repeat changed the eviction order.
    def run(repeat: bool) -> tuple[object, ...]:
        policy = KVAwarePolicy(6)
        policy.insert([key(3)], ReqContext("r1"))
        policy.insert([key(i) for i in (0, 1, 4, 6)], ReqContext("r1"))
        assert policy.evict(1, [key(2), key(5)]) == [key(3)]
        policy.insert([key(2), key(5)], ReqContext("r0"))
        mode = policy._mode
        batch = [key(3), key(0)]
        policy.touch(batch * 2 if repeat and ctx is None else batch, ctx)
        assert policy._mode != mode  # the scenario needs the switch
        if repeat and ctx is not None:
            policy.touch(batch, ctx)
        return _state(policy)

    assert run(repeat=True) == run(repeat=False)


@pytest.mark.parametrize("seed", range(0, 600, 100))
def test_kvaware_repeated_reports_never_change_evictions(seed: int) -> None:
    # A narrower fix (place a repeat again unless the mode had switched since its first
    # count) still failed here: a first count from an earlier call can predate the switch.
    for s in range(seed, seed + 100):
        rng = random.Random(s)
        ops = [
            (
                rng.choice(["store", "touch", "evict"]),
                [rng.randint(0, 9) for _ in range(rng.randint(1, 5))],
                rng.randint(0, 2),
            )
            for _ in range(rng.randint(1, 60))
        ]
        assert run_reports("kvaware", ops, True) == run_reports("kvaware", ops, False), s
