"""benchmarks/policy_phases.py: hit ratios over a trace's head and tail."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import policy_phases
from helpers import refused_argv
from kvtier.base import OffloadKey
from kvtier.sim.trace import Request


def _request(i: int, n: int) -> Request:
    keys = [OffloadKey(bytes([i, j])) for j in range(n)]
    return Request(req_id=str(i), keys=keys, input_length=512 * n, block_tokens=512)


def test_the_head_is_the_shortest_prefix_holding_the_share() -> None:
    reqs = [_request(0, 3), _request(1, 3), _request(2, 4)]
    assert [r.req_id for r in policy_phases.head(reqs, 0.5)] == ["0", "1"]
    assert [r.req_id for r in policy_phases.head(reqs, 0.3)] == ["0"]
    assert [r.req_id for r in policy_phases.head(reqs, 0.61)] == ["0", "1", "2"]


def _phase_change(path: Path) -> None:
    """Head: 80 hot blocks among one-off ones (a count filter keeps the hot ones, LRU loses
    them). Tail: every block is used twice, 10 requests apart, and the hot ones never again
    (LRU keeps the pairs; a filter full of stale counts turns them away)."""
    rng = random.Random(5)
    rows, fresh = [], 1000
    for _ in range(1000):
        rows.append([rng.randrange(80), fresh, fresh + 1, fresh + 2])
        fresh += 3
    tail = list(range(fresh, fresh + 1000))
    for j, block in enumerate(tail):
        rows.append([block] + ([tail[j - 10]] if j >= 10 else []))
    path.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": 512 * len(ids), "hash_ids": ids}) + "\n"
            for t, ids in enumerate(rows)
        )
    )


def test_a_filter_that_wins_the_head_and_loses_the_tail_shows_in_both_columns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace, out = tmp_path / "phases.jsonl", tmp_path / "out.json"
    _phase_change(trace)
    argv = ["policy_phases.py", str(trace), "--mode", "flat", "--capacity", "100"]
    monkeypatch.setattr(sys, "argv", [*argv, "--split", "0.66", "--json", str(out)])
    policy_phases.main()
    rows = {row["policy"]: row for row in json.loads(out.read_text())}
    assert set(rows) == set(policy_phases.POLICIES)
    lru, held = rows["lru"], rows["kvaware held in the filter"]
    assert held["head_hit_ratio"] > lru["head_hit_ratio"] + 0.05
    assert held["tail_hit_ratio"] < lru["tail_hit_ratio"] - 0.2
    # The whole run's hits are the head's and the tail's.
    for row in rows.values():
        assert 0.0 <= row["tail_hit_ratio"] <= 1.0
        assert min(row["head_hit_ratio"], row["tail_hit_ratio"]) <= row["whole_hit_ratio"]
        assert row["whole_hit_ratio"] <= max(row["head_hit_ratio"], row["tail_hit_ratio"])


def test_a_split_outside_zero_and_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "phases.jsonl"
    _phase_change(trace)
    argv = ["policy_phases.py", str(trace), "--split", "1.5"]
    err = refused_argv(policy_phases.main, argv, monkeypatch, capsys)
    assert "--split 1.5 is invalid" in err


def test_a_trace_whose_head_is_the_whole_trace_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "one.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2]}) + "\n")
    argv = ["policy_phases.py", str(trace), "--mode", "flat"]
    err = refused_argv(policy_phases.main, argv, monkeypatch, capsys)
    assert "no tail is left" in err.strip().splitlines()[-1]
