"""The flat replay reproduces published Mooncake hit ratios (the rest: docs/bench/sim.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.sim.readers import read_trace
from kvtier.sim.runner import ReplayOptions, run_one
from kvtier.sim.shapes import parse_capacity
from kvtier.sim.trace import Trace

TRACE = Path(__file__).parents[2] / "data/traces/mooncake_conversation/conversation_trace.jsonl"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not TRACE.exists(), reason="Mooncake trace not in the checkout"),
]


@pytest.fixture(scope="module")
def trace() -> Trace:
    return read_trace(TRACE)


@pytest.mark.parametrize(
    ("policy", "share", "published", "tolerance"),
    [
        ("opt", "1%", 24.6, 0.2),
        ("opt", "5%", 36.6, 0.2),
        ("lru", "1%", 5.2, 0.2),
        ("s3fifo", "1%", 7.5, 0.5),
    ],
)
def test_flat_block_hit_ratio(
    trace: Trace, policy: str, share: str, published: float, tolerance: float
) -> None:
    capacity, _ = parse_capacity(share, unique_blocks=trace.num_unique_blocks)
    run = run_one(trace, policy, capacity, ReplayOptions())
    assert abs(100 * run.block_hit_ratio - published) <= tolerance
