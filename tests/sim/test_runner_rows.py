"""The runner's `jobs` (same rows as one job), its progress, and every documented row field."""

from __future__ import annotations

import csv
import io
import json
import random
from collections.abc import Callable

import pytest

from kvtier.sim.advise import advise
from kvtier.sim.report import write_csv, write_json
from kvtier.sim.runner import ReplayOptions, map_trace, run_grid
from kvtier.sim.shapes import parse_model_shape
from kvtier.sim.trace import Trace

MakeTrace = Callable[..., Trace]

TIMING = ("seconds", "blocks_per_s")

# The fields docs/simulate.md documents for a row.
DOCUMENTED = (
    "policy",
    "block_hit_ratio",
    "prefix_hit_ratio",
    "cpu_hit_ratio",
    "loads",
    "stores",
    "evictions",
    "stores_skipped",
    "prefill_tokens_saved",
    "bytes_loaded",
    "bytes_stored",
    "capacity_bytes",
    "capacity_blocks",
    "capacity_frac",
    "blocks_per_s",
    "seconds",
)


def _runs(trace: Trace) -> list[tuple[str, int]]:
    u = trace.num_unique_blocks
    return [(p, c) for p in ("lru", "s3fifo", "opt") for c in (1, u // 4, 2 * u)] + [
        ("infinite", u)
    ]


@pytest.mark.parametrize(
    "opts",
    [
        ReplayOptions(),
        ReplayOptions(store_threshold=2, tracker_per_slot=2.0),
        ReplayOptions(mode="engine", device_blocks=3),
        ReplayOptions(mode="engine", device_blocks=3, hits_as="touch"),
    ],
)
def test_jobs_give_the_rows_and_progress_of_one_job(
    opts: ReplayOptions, make_trace: MakeTrace
) -> None:
    trace = make_trace(11, num_requests=120)
    runs = _runs(trace)
    shape = parse_model_shape("qwen-2.5-7b")
    rows = {}
    for jobs in (1, 2):
        ticks: list[int] = []
        results = run_grid(trace, runs, opts, jobs=jobs, progress=ticks.append)
        assert sum(ticks) == len(trace) * len(runs)
        assert all(t >= 0 for t in ticks)
        assert [(r.policy, r.capacity_blocks) for r in results] == runs
        rows[jobs] = [
            {k: v for k, v in r.to_row(shape).items() if k not in TIMING} for r in results
        ]
    assert rows[1] == rows[2]


def test_json_and_csv_rows_carry_every_documented_field(make_trace: MakeTrace) -> None:
    trace = make_trace(5, num_requests=40)
    runs = _runs(trace)
    shape = parse_model_shape("llama-3-8b")
    bb = shape.block_bytes(trace.block_tokens)
    results = run_grid(trace, runs, ReplayOptions(mode="engine", device_blocks=2))
    out = io.StringIO()
    write_json(results, out, shape)
    js = json.loads(out.getvalue())
    out = io.StringIO()
    write_csv(results, out, shape)
    cs = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert len(js) == len(cs) == len(results)
    for r, j, c in zip(results, js, cs, strict=True):
        assert set(DOCUMENTED) <= set(j) and set(j) == set(c)
        assert list(j)[:5] == [
            "policy",
            "capacity_blocks",
            "capacity_frac",
            "block_hit_ratio",
            "prefix_hit_ratio",
        ]
        assert j["block_hit_ratio"] == r.hits / r.blocks
        assert j["prefix_hit_ratio"] == r.prefix_tokens / r.tokens
        assert j["cpu_hit_ratio"] == (r.cpu_hits / r.cpu_lookups if r.cpu_lookups else 0.0)
        assert j["bytes_loaded"] == r.loads * bb and j["bytes_stored"] == r.stores * bb
        assert j["capacity_bytes"] == r.capacity_blocks * bb
        assert j["capacity_frac"] == r.capacity_blocks / trace.num_unique_blocks
        assert r.loads == r.cpu_hits
        for k, v in j.items():
            assert c[k] == ("" if v is None else str(v)), k


def test_advise_over_jobs_equals_one_job() -> None:
    rng = random.Random(3)
    from .test_advise_search import _random

    trace = _random(rng.randint(0, 100))
    opts = ReplayOptions()
    args = [(p, 0.3, opts, 1) for p in ("lru", "arc", "opt")]
    serial = [advise(trace, *a) for a in args]
    assert map_trace(trace, advise, args, jobs=2) == serial
