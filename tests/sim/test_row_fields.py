"""Every field docs/simulate.md documents for a row, in the JSON and the CSV."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable

from kvtier.sim.report import write_csv, write_json
from kvtier.sim.runner import ReplayOptions, run_grid
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
