"""benchmarks/policy_windows.py: policies against LRU on short windows of a trace."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import policy_windows
from helpers import refused_argv
from kvtier.base import OffloadKey
from kvtier.sim.trace import Request


def _requests(n: int) -> list[Request]:
    keys = [OffloadKey(b"k")]
    return [Request(str(i), keys, input_length=512, block_tokens=512) for i in range(n)]


@pytest.mark.parametrize(
    ("n", "size", "starts", "expected"),
    [
        (10, 4, 4, [0, 2, 4, 6]),
        (10, 4, 1, [0]),
        (10, 10, 4, [0]),
        (5, 4, 4, [0, 1]),
        (3, 4, 4, []),
    ],
)
def test_windows_are_evenly_spaced_and_inside_the_trace(
    n: int, size: int, starts: int, expected: list[int]
) -> None:
    assert policy_windows.windows(_requests(n), size, starts) == expected


def _trace(path: Path) -> None:
    """A hot set of 30 blocks behind a shared prompt, among one-off blocks."""
    rng = random.Random(3)
    rows, fresh = [], 1000
    for t in range(400):
        ids = [1, 2, 100 + rng.randrange(30), fresh]
        fresh += 1
        rows.append({"timestamp": t, "input_length": 512 * len(ids), "hash_ids": ids})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_each_window_is_replayed_alone_and_lru_matches_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, out = tmp_path / "t.jsonl", tmp_path / "out.json"
    _trace(trace)
    policies = "lru,arc,kvaware-filter"
    argv = ["policy_windows.py", str(trace), "--policies", policies, "--sizes", "100,400"]
    monkeypatch.setattr(sys, "argv", [*argv, "--starts", "3", "--json", str(out)])
    policy_windows.main()
    rows = json.loads(out.read_text())
    # 3 windows of 100 requests and one of 400 (the whole trace), three policies each.
    windows = [(0, 100), (150, 100), (300, 100), (0, 400)]
    assert [(r["start"], r["requests"]) for r in rows[::3]] == windows
    for row in rows:
        assert row["minus_lru"] == pytest.approx(
            [p - q for p, q in zip(row["pct"], row["lru_pct"], strict=True)]
        )
    assert all(d == 0.0 for r in rows if r["policy"] == "lru" for d in r["minus_lru"])
    # A window is replayed from an empty cache: the first window's LRU figures differ from
    # the whole trace's.
    assert rows[0]["lru_pct"] != rows[-1]["lru_pct"]
    report = capsys.readouterr().out
    assert "lru: 0 of 16 cells below LRU" in report
    assert "arc:" in report
    # kvaware held in its filter keeps the hot set that one-off blocks push out of LRU.
    held = [r for r in rows if r["policy"] == "kvaware-filter"]
    assert all(d >= 0.0 for r in held for d in r["minus_lru"])
    assert sum(r["minus_lru"][3] for r in held) > 4 * 2.0


def test_an_unknown_policy_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    _trace(trace)
    argv = ["policy_windows.py", str(trace), "--policies", "lru,nope"]
    err = refused_argv(policy_windows.main, argv, monkeypatch, capsys)
    assert "unknown policies ['nope']" in err
