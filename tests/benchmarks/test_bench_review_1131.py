"""Benchmark review, third pass: Ctrl-C in the policy labs' process pools, a custom trace's
rows labelled as Mooncake's, and a window lab that did not count small losses to LRU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import manager_ops
import policy_windows

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _trace(path: Path) -> Path:
    rows = [
        {"timestamp": t, "input_length": 1024, "hash_ids": [1, 2 + t % 5, 100 + t]}
        for t in range(30)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_ctrl_c_in_policy_fuzz_stops_its_workers_and_says_so_in_one_line() -> None:
    # The terminal's SIGINT reaches the whole process group: before, every worker raised
    # KeyboardInterrupt into its task, the parent waited out the running seeds and ended on a
    # traceback (and status -2).
    proc = subprocess.Popen(
        [
            sys.executable,
            str(BENCH / "policy_fuzz.py"),
            "--seeds",
            "0:400",
            "--policies",
            "lru,sieve",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # the first progress line: the pool's workers are busy
        assert line.startswith("[5/400 seeds]"), line
        os.killpg(proc.pid, signal.SIGINT)
        start = time.monotonic()
        rest = proc.stderr.read()
        rc = proc.wait(timeout=60)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert rc == 130, rest
    assert rest.strip().splitlines()[-1] == "interrupted"
    assert "Traceback" not in rest
    assert took < 10  # the running seeds are terminated, not waited out
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # no worker left behind


def test_manager_ops_names_a_trace_after_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every --trace's rows were labelled "mooncake", so a run on another trace read as the
    # Mooncake figures.
    out = tmp_path / "rows.json"
    trace = _trace(tmp_path / "my_chats.jsonl")
    monkeypatch.setattr(manager_ops, "progress", lambda *a: None)
    argv = ["--policies", "lru", "--zipf-requests", "50", "--repeats", "1", "--trace"]
    assert manager_ops.main([*argv, str(trace), "--json", str(out)]) == 0
    assert {r["workload"] for r in json.loads(out.read_text())} == {"zipf", "my_chats"}
    # A trace file named like the synthetic workload keeps rows of both.
    zipf = _trace(tmp_path / "zipf.jsonl")
    assert manager_ops.main([*argv, str(zipf), "--json", str(out)]) == 0
    assert {r["workload"] for r in json.loads(out.read_text())} == {"zipf", "trace:zipf"}


def test_policy_windows_counts_a_loss_that_rounds_to_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A gap of -0.003 was not "below LRU" here while policy_fuzz.py and policy_stress.py
    # count every gap under zero.
    def hit_pct(trace: object, policy: str, share: float) -> float:
        return 30.0 if policy == "lru" else 29.997

    monkeypatch.setattr(policy_windows, "hit_pct", hit_pct)
    trace = _trace(tmp_path / "t.jsonl")
    argv = ["policy_windows.py", str(trace), "--policies", "arc", "--sizes", "10"]
    monkeypatch.setattr(sys, "argv", [*argv, "--starts", "1"])
    policy_windows.main()
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    cells = len(policy_windows.SHARES)
    assert summary.startswith(f"t.jsonl, arc: {cells} of {cells} cells below LRU"), summary


def test_sim_speed_replays_a_capacity_given_twice_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # "5,5" (or a share and its block count) replayed the capacity twice: "seconds (2 runs)"
    # and a median over duplicated rows, where `kvtier simulate` replays it once.
    import sim_speed

    out = tmp_path / "out.json"
    argv = ["sim_speed.py", "--trace", str(_trace(tmp_path / "t.jsonl")), "--policies", "lru"]
    monkeypatch.setattr(
        sys, "argv", [*argv, "--capacities", "5,5,20", "--jobs", "1", "--json", str(out)]
    )
    assert sim_speed.main() == 0
    assert "seconds (2 runs)" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["capacities_blocks"] == [5, 20]
    assert len(result["per_policy"][0]["block_hit_ratios"]) == 2
