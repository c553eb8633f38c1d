"""`advise`: the smallest capacity reaching a target hit ratio."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvtier.sim.advise import advise
from kvtier.sim.runner import ReplayOptions, run_one
from kvtier.sim.trace import Trace

MakeTrace = Callable[..., Trace]


@pytest.mark.parametrize("policy", ["lru", "opt"])
def test_advice_is_the_smallest_capacity(policy: str, make_trace: MakeTrace) -> None:
    trace = make_trace(4, num_requests=80)
    opts = ReplayOptions()
    infinite = run_one(trace, "infinite", 1, opts).block_hit_ratio
    target = 0.95 * infinite
    a = advise(trace, policy, target, opts, resolution=1)
    assert a.capacity_blocks is not None and a.block_hit_ratio is not None
    assert a.block_hit_ratio >= target
    assert run_one(trace, policy, a.capacity_blocks, opts).block_hit_ratio >= target
    if a.capacity_blocks > 1:
        assert run_one(trace, policy, a.capacity_blocks - 1, opts).block_hit_ratio < target


def test_advice_when_admission_caps_the_ratio(make_trace: MakeTrace) -> None:
    trace = make_trace(4, num_requests=80)
    opts = ReplayOptions(store_threshold=2)
    infinite = run_one(trace, "infinite", 1, opts).block_hit_ratio
    a = advise(trace, "lru", 0.999 * infinite, opts, resolution=1)
    assert a.capacity_blocks is None and a.capacity_frac is None
    assert a.block_hit_ratio is not None and a.block_hit_ratio < infinite
    with pytest.raises(ValueError, match="resolution=0"):
        advise(trace, "lru", 0.5, opts, resolution=0)
