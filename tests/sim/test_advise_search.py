"""`advise` against a brute-force scan of every capacity, and its edge cases."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvtier.base import OffloadKey, make_offload_key
from kvtier.cli import main
from kvtier.sim.advise import advise
from kvtier.sim.runner import ReplayOptions, map_trace, run_one
from kvtier.sim.trace import Request, Trace


def _key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def _single_blocks(ids: list[int]) -> Trace:
    """One one-block request per id, in order."""
    return Trace(Request(f"q{n}", [_key(i)], 4, 4) for n, i in enumerate(ids))


def _random(seed: int) -> Trace:
    rng = random.Random(seed)
    pool = rng.randint(4, 30)
    reqs = [
        Request(f"q{n}", [_key(i) for i in rng.sample(range(pool), rng.randint(1, 4))], 16, 4)
        for n in range(rng.randint(5, 60))
    ]
    return Trace(reqs)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("policy", ["lru", "opt"])
@pytest.mark.parametrize("mode", ["flat", "engine"])
def test_advice_equals_a_scan_of_every_capacity(seed: int, policy: str, mode: str) -> None:
    trace = _random(seed)
    opts = ReplayOptions(mode=mode, device_blocks=2 if mode == "engine" else 0)
    unique = trace.num_unique_blocks
    infinite = run_one(trace, "infinite", unique, opts)
    target = 0.95 * infinite.block_hit_ratio
    # Exact: `hits >= 0.95 * infinite hits` in integers, free of float rounding.
    scan = [
        c
        for c in range(1, unique + 1)
        if 20 * run_one(trace, policy, c, opts).hits >= 19 * infinite.hits
    ]
    a = advise(trace, policy, target, opts, resolution=1)
    assert a.capacity_blocks == scan[0]
    assert a.capacity_frac == scan[0] / unique
    assert a.block_hit_ratio == run_one(trace, policy, scan[0], opts).block_hit_ratio
    # A coarser resolution answers no lower than the truth and within the resolution.
    coarse = advise(trace, policy, target, opts, resolution=3)
    assert coarse.capacity_blocks is not None
    assert scan[0] <= coarse.capacity_blocks < scan[0] + 3


def test_exactly_95_percent_reaches_the_target() -> None:
    # 53 accesses: 19 adjacent pairs (hits at 1 block), one pair a block apart (hits at 2
    # blocks), 12 one-off blocks. Infinite: 20 hits; 1 block: 19 = exactly 95% of them, which
    # 0.95 * 20/53 in floats puts above 19/53.
    ids: list[int] = []
    for i in range(19):
        ids += [i, i]
    ids += [100, 101, 100, *range(200, 212)]
    trace = _single_blocks(ids)
    assert trace.num_blocks == 53
    opts = ReplayOptions()
    infinite = run_one(trace, "infinite", 1, opts).block_hit_ratio
    assert run_one(trace, "lru", 1, opts).hits == 19
    a = advise(trace, "lru", 0.95 * infinite, opts, resolution=1)
    assert a.capacity_blocks == 1
    assert a.block_hit_ratio == 19 / 53


def test_a_trace_without_reuse_needs_one_block() -> None:
    # Any capacity reaches 95% of nothing; the smallest tier is one block, whatever the
    # resolution.
    trace = _single_blocks(list(range(1000)))
    opts = ReplayOptions()
    assert run_one(trace, "infinite", 1, opts).hits == 0
    for policy in ("lru", "opt", "s3fifo"):
        a = advise(trace, policy, 0.0, opts, resolution=5)
        assert (a.capacity_blocks, a.capacity_frac, a.block_hit_ratio) == (1, 1 / 1000, 0.0)
        assert a.replays <= 2


def test_a_policy_that_never_reaches_reads_never() -> None:
    # Every block is seen twice, in one request each time: admission on a second sighting
    # stores it on its second use, too late for any hit.
    trace = _single_blocks([0, 1, 2, 0, 1, 2])
    opts = ReplayOptions(store_threshold=2)
    a = advise(trace, "lru", 0.95 * 0.5, opts, resolution=1)
    assert (a.capacity_blocks, a.capacity_frac, a.block_hit_ratio, a.replays) == (
        None,
        None,
        0.0,
        1,
    )


def test_the_cli_counts_exactly_95_percent_as_reached(tmp_path: Path) -> None:
    # The trace of `test_exactly_95_percent_reaches_the_target`, as a Mooncake file: the
    # command computes the target itself (95% of the infinite cache's ratio, in floats).
    ids = [i for i in range(19) for _ in (0, 1)] + [100, 101, 100, *range(200, 212)]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"input_length": 16, "hash_ids": [i]}) + "\n" for i in ids))
    out = tmp_path / "a.json"
    assert (
        main(["simulate", str(path), "--advise", "--policies", "lru", "--json", str(out), "-q"])
        == 0
    )
    (row,) = json.loads(out.read_text())
    assert (row["capacity_blocks"], row["block_hit_ratio"]) == (1, 19 / 53)


def test_the_infinite_cache_is_not_sized() -> None:
    # `run_one` gives it a slot per block at any capacity: a search would answer 1 block.
    trace = _single_blocks([0, 1, 0, 1])
    with pytest.raises(ValueError, match="infinite"):
        advise(trace, "infinite", 0.4, ReplayOptions(), resolution=1)


def test_advise_over_jobs_equals_one_job() -> None:
    rng = random.Random(3)
    trace = _random(rng.randint(0, 100))
    opts = ReplayOptions()
    args = [(p, 0.3, opts, 1) for p in ("lru", "arc", "opt")]
    serial = [advise(trace, *a) for a in args]
    assert map_trace(trace, advise, args, jobs=2) == serial
