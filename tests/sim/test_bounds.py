"""OPT against a brute-force optimum, and OPT as a bound on every registered policy."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from helpers import brute_force_hits
from kvtier.policies import registered_policies
from kvtier.sim.bounds import belady, device_prefix_hits, opt_result
from kvtier.sim.replay import make_manager, replay_engine, replay_flat
from kvtier.sim.trace import Trace

MakeTrace = Callable[..., Trace]


@pytest.mark.parametrize("seed", range(40))
def test_opt_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    stream = [rng.randrange(rng.randint(2, 6)) for _ in range(rng.randint(1, 13))]
    capacity = rng.randint(1, 4)
    flags, stores, evictions = belady(stream, capacity)
    assert sum(flags) == brute_force_hits(stream, capacity), (stream, capacity)
    assert evictions <= stores


def test_belady_counts_and_bypass() -> None:
    # 'c' is never used again, so it is bypassed rather than evicting 'a' or 'b'.
    flags, stores, evictions = belady(["a", "b", "c", "a", "b"], 2)
    assert list(flags) == [0, 0, 0, 1, 1]
    assert (stores, evictions) == (2, 0)
    with pytest.raises(ValueError, match="capacity=0"):
        belady(["a"], 0)


@pytest.mark.parametrize("seed", range(6))
def test_opt_bounds_every_policy(seed: int, make_trace: MakeTrace) -> None:
    trace = make_trace(seed)
    for capacity in (1, 3, 8, 20):
        opt = opt_result(trace, capacity)
        for policy in registered_policies():
            run = replay_flat(trace, make_manager(policy, capacity))
            assert run.hits <= opt.hits, (policy, capacity)
        opt_e = opt_result(trace, capacity, mode="engine", device_blocks=5)
        for policy in registered_policies():
            run = replay_engine(trace, make_manager(policy, capacity), device_blocks=5)
            assert run.hits <= opt_e.hits, (policy, capacity)


def test_opt_reaches_infinite_cache_and_counts_consistently(make_trace: MakeTrace) -> None:
    trace = make_trace(7)
    opt = opt_result(trace, trace.num_unique_blocks)
    assert opt.hits == trace.num_blocks - trace.num_unique_blocks
    assert opt.loads == opt.cpu_hits == opt.hits
    assert opt.evictions == 0
    assert opt.stores + opt.stores_skipped + opt.hits == trace.num_blocks


def test_opt_engine_mode_skips_device_hits(make_trace: MakeTrace) -> None:
    trace = make_trace(3)
    dev = device_prefix_hits(trace, 6)
    opt = opt_result(trace, 4, mode="engine", device_blocks=6)
    assert opt.device_hits == sum(dev) > 0
    assert opt.cpu_lookups == trace.num_blocks - sum(dev)
    with pytest.raises(ValueError, match="on-evict"):
        opt_result(trace, 4, mode="engine", device_blocks=6, store_on="on-evict")
    with pytest.raises(ValueError, match="mode="):
        opt_result(trace, 4, mode="bogus")
