"""Least Hit Density policy: learning, sampling, determinism, bounds and bad arguments."""

from __future__ import annotations

import pytest

from kvtier.base import OffloadKey, ReqContext, make_offload_key
from kvtier.policies import CachePolicy, HitDensityPolicy, make_policy


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def ctx(req: str, keys: list[OffloadKey]) -> ReqContext:
    return ReqContext(req, key_positions={k: (j + 1) * 512 for j, k in enumerate(keys)})


def replay(policy: CachePolicy, requests: list[list[int]]) -> int:
    """Flat replay as the manager drives it; returns the number of hits."""
    hits = 0
    for r, req in enumerate(requests):
        keys = [key(b) for b in req]
        c = ctx(f"r{r}", keys)
        for k in keys:
            if k in policy:
                policy.touch([k], c)
                hits += 1
                continue
            if len(policy) >= policy.capacity:
                assert policy.evict(1, {k}) is not None
            policy.insert([k], c)
    return hits


def hot_and_scan(n: int = 6000) -> list[list[int]]:
    # 48 hot blocks, one every other request, reused every ~200 accesses; in between,
    # one-off 3-block scans.
    out: list[list[int]] = []
    for r in range(n):
        if r % 2 == 0:
            out.append([1_000_000 + (r // 2) % 48])
        else:
            out.append([10 * r + j for j in range(3)])
    return out


def conversations(n: int = 300) -> list[list[int]]:
    # Interleaved conversations: each turn repeats the previous turns' blocks and ends in a
    # partial block (a new id every turn) that no later request uses.
    out: list[list[int]] = []
    for r in range(n):
        c, turn = r % 30, r // 30
        out.append([1000 * c + j for j in range(2 * turn + 2)] + [10**7 + r])
    return out


def test_registered_under_its_name() -> None:
    assert isinstance(make_policy("hitdensity", 4), HitDensityPolicy)


def test_learns_to_keep_reused_blocks_through_scans() -> None:
    # The hot set fits (48 of 64 slots) but comes back after ~200 accesses: LRU loses it to
    # the scans, hit density learns that the reused class pays and the scans' does not.
    requests = hot_and_scan()
    lhd = replay(HitDensityPolicy(64, interval=128), requests)
    lru = replay(make_policy("lru", 64), requests)
    hot_accesses = len(requests) // 2
    assert lru < 0.1 * hot_accesses < 0.5 * hot_accesses < lhd


def test_runs_are_reproducible() -> None:
    requests = hot_and_scan(1500)
    a, b = HitDensityPolicy(16, interval=64), HitDensityPolicy(16, interval=64)
    assert replay(a, requests) == replay(b, requests)
    assert sorted(a.evict(10, set()) or []) == sorted(b.evict(10, set()) or [])


def test_clear_restarts_learning_from_scratch() -> None:
    requests = hot_and_scan(1500)
    policy = HitDensityPolicy(16, interval=64)
    first = replay(policy, requests)
    policy.clear()
    assert len(policy) == 0
    assert all(v == 0 for n, v in policy.table_sizes().items() if not n.startswith("sketch"))
    assert replay(policy, requests) == first


def test_knowing_the_deepest_block_pays() -> None:
    # The same conversations with and without the request context: the context marks each
    # request's deepest block, which is never reused, so the policy learns to drop it first.
    requests = conversations()
    with_ctx = replay(HitDensityPolicy(64, interval=64), requests)
    blind = HitDensityPolicy(64, interval=64)
    hits = 0
    for req in requests:
        for k in (key(b) for b in req):
            if k in blind:
                blind.touch([k], None)
                hits += 1
            else:
                if len(blind) >= blind.capacity:
                    blind.evict(1, {k})
                blind.insert([k], None)
    assert with_ctx > hits


def test_tracked_keys_stay_within_twice_capacity() -> None:
    policy = HitDensityPolicy(8, interval=16)
    replay(policy, [[i, i + 1, i + 2] for i in range(0, 3000, 2)])
    sizes = policy.table_sizes()
    assert sizes["tracked"] <= 16 and sizes["candidates"] <= 8


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sample": 0}, "sample=0"),
        ({"decay": 1.0}, "decay=1.0"),
        ({"interval": 0}, "interval=0"),
        ({"reach": 0.0}, "reach=0.0"),
        ({"quantile": 1.5}, "quantile=1.5"),
        ({"block_tokens": 0}, "block_tokens=0"),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HitDensityPolicy(8, **kwargs)  # type: ignore[arg-type]
