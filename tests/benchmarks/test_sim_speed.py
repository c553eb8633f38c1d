"""benchmarks/sim_speed.py: replay speed of the trace simulator."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import sim_speed


def test_the_table_counts_the_capacities_given_and_matches_the_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, out = tmp_path / "t.jsonl", tmp_path / "out.json"
    rows = [{"timestamp": t, "input_length": 1536, "hash_ids": [1, 2, 3 + t % 50]}
            for t in range(200)]  # fmt: skip
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["sim_speed.py", "--trace", str(trace), "--policies", "lru,opt"]
    monkeypatch.setattr(
        sys, "argv", [*argv, "--capacities", "5,20", "--jobs", "1", "--json", str(out)]
    )
    assert sim_speed.main() == 0
    captured = capsys.readouterr()
    assert "seconds (2 runs)" in captured.out
    result = json.loads(out.read_text())
    assert result["capacities_blocks"] == [5, 20]
    assert [row["policy"] for row in result["per_policy"]] == ["lru", "opt"]
    for row in result["per_policy"]:
        assert len(row["block_hit_ratios"]) == 2
        assert f"{row['policy']:<8} {row['median_blocks_per_s']:>16,.0f}" in captured.out
    # The two grids before each starts, and each policy of the first as it ends.
    err = captured.err.splitlines()
    assert len(err) == 4
    assert [line.strip() for line in err[1:3]] == ["lru: done (1 of 2)", "opt: done (2 of 2)"]
