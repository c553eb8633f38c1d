"""Flat and engine replays through the real manager."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvtier.sim.replay import (
    DevicePrefixCache,
    ProgressFn,
    make_manager,
    replay_engine,
    replay_flat,
)
from kvtier.sim.result import RunResult
from kvtier.sim.runner import ReplayOptions, run_grid, run_one
from kvtier.sim.shapes import MODEL_PRESETS
from kvtier.sim.trace import Request, Trace

from .conftest import key

MakeTrace = Callable[..., Trace]

_COUNTERS = ("hits", "prefix_tokens", "cpu_hits", "loads", "stores", "evictions", "stores_skipped")


def _counters(r: RunResult) -> tuple[int, ...]:
    return tuple(getattr(r, name) for name in _COUNTERS)


@pytest.mark.parametrize("hits_as", ["touch", "load"])
@pytest.mark.parametrize("store_on", ["eager", "on-evict"])
@pytest.mark.parametrize("threshold", [0, 2])
def test_modes_agree_with_an_empty_device(
    policy_name: str, hits_as: str, store_on: str, threshold: int, make_trace: MakeTrace
) -> None:
    trace = make_trace(11, num_requests=80)
    for capacity in (1, 4, 15):
        flat = replay_flat(
            trace, make_manager(policy_name, capacity, store_threshold=threshold), hits_as=hits_as
        )
        engine = replay_engine(
            trace,
            make_manager(policy_name, capacity, store_threshold=threshold),
            device_blocks=0,
            store_on=store_on,
            hits_as=hits_as,
        )
        assert _counters(flat) == _counters(engine)
        assert engine.device_hits == 0
        assert flat.prefill_tokens_saved == engine.prefill_tokens_saved == flat.prefix_tokens


def _trace(*requests: list[int], block_tokens: int = 4) -> Trace:
    return Trace(
        Request(f"r{n}", [key(i) for i in ids], len(ids) * block_tokens, block_tokens)
        for n, ids in enumerate(requests)
    )


def test_flat_counts_hits_prefix_and_stores() -> None:
    # Capacity 2, LRU: r1 hits 0 and 1 and stores 2 over 0; r2's 3 and 0 both miss.
    trace = _trace([0, 1], [0, 1, 2], [3, 0])
    r = replay_flat(trace, make_manager("lru", 2))
    assert r.hits == 2  # r1: 0 and 1
    assert r.prefix_tokens == 8  # r1's two leading blocks of 4 tokens
    assert r.stores == 5 and r.evictions == 3 and r.loads == 2
    assert r.block_hit_ratio == pytest.approx(2 / 7)
    assert r.prefix_hit_ratio == pytest.approx(8 / 28)


def test_hit_after_a_miss_counts_for_blocks_not_prefix() -> None:
    trace = Trace(
        [
            Request("a", [key(0), key(1)], 8, 4),
            Request("b", [key(2), key(1)], 8, 4),  # not chained, to force a hit after a miss
        ]
    )
    r = replay_flat(trace, make_manager("lru", 8))
    assert r.hits == 1 and r.prefix_tokens == 0


def test_partial_last_block_is_token_weighted() -> None:
    trace = Trace([Request("a", [key(0), key(1)], 5, 4), Request("b", [key(0), key(1)], 5, 4)])
    r = replay_flat(trace, make_manager("lru", 8))
    assert r.prefix_tokens == 5 and r.tokens == 10


def test_engine_device_hits_touch_the_cpu_tier_and_skip_lookups() -> None:
    trace = _trace([0, 1, 2], [0, 1, 2, 3])
    r = replay_engine(trace, make_manager("lru", 8), device_blocks=8)
    assert r.device_hits == 3 and r.cpu_lookups == 4 and r.cpu_hits == 0
    assert r.hits == 3 and r.prefill_tokens_saved == 0 and r.prefix_tokens == 12
    assert r.stores == 4  # eager: every computed block


def test_engine_store_on_evict_stores_only_evicted_blocks() -> None:
    trace = _trace([0, 1, 2], [3], [0, 1, 2])
    eager = replay_engine(trace, make_manager("lru", 8), device_blocks=2)
    lazy = replay_engine(trace, make_manager("lru", 8), device_blocks=2, store_on="on-evict")
    assert eager.stores == 4
    # The device (2 blocks) evicts 0, 1, then 2 on r2; r3 finds 0 and 1 in the CPU tier.
    assert lazy.stores == 2 + 1 + 1  # 0, 1 evicted by r1/r2; 2 by r2; 3 by r3
    assert lazy.cpu_hits == 3 and eager.cpu_hits == 3
    assert lazy.prefill_tokens_saved == 12


def test_device_prefix_cache() -> None:
    dev = DevicePrefixCache(2)
    assert dev.add(key(0)) is None and dev.add(key(1)) is None
    assert dev.prefix_hits([key(0), key(1), key(2)]) == 2
    assert dev.add(key(2)) == key(0)
    assert dev.prefix_hits([key(0), key(1)]) == 0
    assert DevicePrefixCache(0).add(key(5)) == key(5)
    with pytest.raises(ValueError, match="device capacity"):
        DevicePrefixCache(-1)


def test_store_threshold_skips_first_sightings() -> None:
    trace = _trace([0, 1], [0, 1], [0, 1])
    r = replay_flat(trace, make_manager("lru", 8, store_threshold=2))
    assert r.stores_skipped == 2 and r.stores == 2 and r.hits == 2


def test_bad_arguments_are_rejected(make_trace: MakeTrace) -> None:
    trace = make_trace(1)
    with pytest.raises(ValueError, match="hits_as"):
        replay_flat(trace, make_manager("lru", 4), hits_as="peek")
    with pytest.raises(ValueError, match="store_on"):
        replay_engine(trace, make_manager("lru", 4), device_blocks=1, store_on="later")
    with pytest.raises(ValueError, match="mode"):
        ReplayOptions(mode="fast")


def test_grid_in_processes_equals_serial(make_trace: MakeTrace) -> None:
    trace = make_trace(5)
    runs = [("lru", 3), ("opt", 3), ("infinite", trace.num_unique_blocks)]
    opts = ReplayOptions(mode="engine", device_blocks=4)
    seen: list[int] = []
    serial = run_grid(trace, runs, opts, jobs=1, progress=seen.append)
    parallel = run_grid(trace, runs, opts, jobs=2)
    assert [_counters(r) for r in serial] == [_counters(r) for r in parallel]
    assert sum(seen) == len(trace) * len(runs)
    assert [r.policy for r in serial] == ["lru", "opt", "infinite"]


def test_infinite_bound_ignores_admission(make_trace: MakeTrace) -> None:
    trace = make_trace(9)
    inf = run_one(trace, "infinite", 1, ReplayOptions(store_threshold=3))
    assert inf.hits == trace.num_blocks - trace.num_unique_blocks
    assert inf.evictions == 0 and inf.store_threshold == 0


def test_row_has_bytes_with_a_model_shape(make_trace: MakeTrace) -> None:
    r = run_one(make_trace(2), "lru", 5, ReplayOptions())
    shape = MODEL_PRESETS["llama-3-8b"]
    row = r.to_row(shape)
    assert list(row)[:5] == [
        "policy",
        "capacity_blocks",
        "capacity_frac",
        "block_hit_ratio",
        "prefix_hit_ratio",
    ]
    assert row["bytes_loaded"] == r.loads * 2 * 32 * 8 * 128 * 2 * r.block_tokens
    assert r.to_row()["bytes_stored"] is None


@pytest.mark.parametrize("mode", ["flat", "engine"])
def test_a_request_stream_replays_like_a_trace(mode: str, make_trace: MakeTrace) -> None:
    trace = make_trace(12)
    seen: list[int] = []

    def run(source: Trace | Iterator[Request], progress: ProgressFn | None = None) -> RunResult:
        mgr = make_manager("lru", 6)
        if mode == "flat":
            return replay_flat(source, mgr, progress=progress)
        return replay_engine(source, mgr, device_blocks=3, progress=progress)

    whole = run(trace)
    streamed = run(iter(trace.requests), seen.append)
    assert _counters(whole) == _counters(streamed)
    assert (streamed.requests, streamed.blocks, streamed.tokens) == (
        len(trace),
        trace.num_blocks,
        trace.num_tokens,
    )
    assert streamed.capacity_frac == whole.capacity_frac == 6 / trace.num_unique_blocks
    assert sum(seen) == len(trace)


@pytest.mark.parametrize("threshold", [0, 2])
@pytest.mark.parametrize("mode", ["flat", "engine"])
def test_a_tier_beyond_the_unique_blocks_behaves_as_one_of_that_size(
    policy_name: str, mode: str, threshold: int, make_trace: MakeTrace
) -> None:
    """Why `run_one` may size the manager at the unique-block count: a larger tier never
    evicts, so every counter is the same."""
    trace = make_trace(13, num_requests=80)
    unique = trace.num_unique_blocks

    def replay(capacity: int) -> RunResult:
        mgr = make_manager(policy_name, capacity, store_threshold=threshold)
        if mode == "flat":
            return replay_flat(trace, mgr)
        return replay_engine(trace, mgr, device_blocks=3, store_on="on-evict")

    exact = replay(unique)
    assert _counters(replay(3 * unique)) == _counters(exact) and exact.evictions == 0
    # Flat mode has no device, so it takes no device setting (ReplayOptions refuses one).
    device, store_on = (3, "on-evict") if mode == "engine" else (0, "eager")
    opts = ReplayOptions(
        mode=mode, store_threshold=threshold, device_blocks=device, store_on=store_on
    )
    huge = run_one(trace, policy_name, 10**20, opts)  # would allocate 10**20 slots unsized
    assert _counters(huge) == _counters(exact)
    assert (huge.capacity_blocks, huge.capacity_frac) == (10**20, 10**20 / unique)


def test_a_per_slot_tracker_is_kept_for_capacities_beyond_the_unique_blocks(
    make_trace: MakeTrace,
) -> None:
    trace = make_trace(13, num_requests=80)
    unique = trace.num_unique_blocks
    for capacity, per_slot in ((unique // 3, 0.5), (unique // 3, 5.0), (2 * unique, 0.25)):
        tracker = max(1, round(per_slot * capacity))
        expected = replay_flat(
            trace, make_manager("lru", capacity, store_threshold=2, max_tracker_size=tracker)
        )
        opts = ReplayOptions(store_threshold=2, tracker_per_slot=per_slot)
        assert _counters(run_one(trace, "lru", capacity, opts)) == _counters(expected)
    opts = ReplayOptions(store_threshold=2, tracker_per_slot=1e300)
    assert run_one(trace, "lru", 10**300, opts).capacity_blocks == 10**300
