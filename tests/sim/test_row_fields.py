"""Every field docs/simulate.md documents for a row, in the JSON and the CSV."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable
from typing import Any

import pytest

from kvtier.sim.report import rows, write_csv, write_json
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
    "hits_as",
    "max_tracker_size",
    "tracker_per_slot",
    "of_opt",
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


# The fields of a row before `max_tracker_size`, `tracker_per_slot` and `of_opt` were added:
# CSV readers that go by position keep finding them where they were.
_OLD_ORDER = [
    "policy",
    "capacity_blocks",
    "capacity_frac",
    "block_hit_ratio",
    "prefix_hit_ratio",
    "mode",
    "store_threshold",
    "requests",
    "blocks",
    "tokens",
    "block_tokens",
    "hits",
    "prefix_tokens",
    "prefill_tokens_saved",
    "cpu_lookups",
    "cpu_hits",
    "loads",
    "stores",
    "evictions",
    "stores_skipped",
    "seconds",
    "device_blocks",
    "device_hits",
    "store_on",
    "hits_as",
    "cpu_hit_ratio",
    "blocks_per_s",
    "model_shape",
    "bytes_loaded",
    "bytes_stored",
    "capacity_bytes",
]


def test_rows_carry_the_tables_of_opt(make_trace: MakeTrace) -> None:
    """The table's `of OPT` column was missing from --json and --csv."""
    trace = make_trace(7, num_requests=50)
    u = trace.num_unique_blocks
    runs = [("lru", 2), ("lru", u // 3), ("opt", 2), ("opt", u // 3), ("lru", 5), ("infinite", u)]
    results = run_grid(trace, runs, ReplayOptions())
    got = rows(results)
    assert list(got[0]) == [*_OLD_ORDER, "max_tracker_size", "tracker_per_slot", "of_opt"]
    opt = {r.capacity_blocks: r.block_hit_ratio for r in results if r.policy == "opt"}
    for r, row in zip(results, got, strict=True):
        if r.capacity_blocks in opt:
            assert row["of_opt"] == r.block_hit_ratio / opt[r.capacity_blocks]
        else:
            assert row["of_opt"] is None  # no OPT row at that capacity
    assert [row["of_opt"] for row in got if row["policy"] == "opt"] == [1.0, 1.0]
    without_opt = rows([r for r in results if r.policy != "opt"])
    assert all(row["of_opt"] is None for row in without_opt)


@pytest.mark.parametrize(("mode", "hits_as"), [("flat", "touch"), ("engine", "load")])
def test_opt_rows_report_how_hits_were_recorded(
    make_trace: MakeTrace, mode: str, hits_as: str
) -> None:
    """OPT rows said `hits_as: null` where every other row of the grid named the setting."""
    trace = make_trace(3, num_requests=30)
    runs = [("lru", 4), ("opt", 4)]
    for given in (None, "touch", "load"):
        opts = ReplayOptions(mode=mode, device_blocks=2 if mode == "engine" else 0, hits_as=given)
        assert [r.hits_as for r in run_grid(trace, runs, opts)] == [given or hits_as] * 2


def test_rows_carry_the_admission_tracker(make_trace: MakeTrace) -> None:
    """Rows from `--max-tracker-size 5x` and the default tracker were indistinguishable."""
    trace = make_trace(11, num_requests=60)
    runs = [("lru", 4), ("opt", 4), ("infinite", trace.num_unique_blocks)]

    def tracker(**kw: Any) -> list[tuple[object, object]]:
        got = rows(run_grid(trace, runs, ReplayOptions(**kw)))
        return [(r["max_tracker_size"], r["tracker_per_slot"]) for r in got]

    # The bounds admit everything, so they track nothing.
    assert tracker(store_threshold=2) == [(64_000, None), (None, None), (None, None)]
    assert tracker(store_threshold=2, tracker_per_slot=5.0) == [
        (20, 5.0),
        (None, None),
        (None, None),
    ]
    assert tracker(store_threshold=3, max_tracker_size=7) == [(7, None), (None, None), (None, None)]
    # Without reuse admission there is no tracker.
    assert tracker(store_threshold=0) == [(None, None)] * 3
