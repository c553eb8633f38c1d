"""Benchmark review, second pass: a column of ties for a policy never run, negative seeds that
repeat other seeds' traces, a summary that pooled every trace given, windows counted twice,
a temp folder left behind by every vLLM scheduler built, and a refusal that named no value."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from helpers import refused_argv


def _must_not_run(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the benchmark started its run before refusing its arguments")


def _trace(path: Path, first_id: int = 1) -> Path:
    rows = [
        {"timestamp": t, "input_length": 1024, "hash_ids": [first_id, first_id + t + 1]}
        for t in range(20)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _stress_output(
    policies: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> list[str]:
    """policy_stress.py's stdout for one cell, LRU at 40% and every other policy at 39.5%."""
    import policy_stress

    def replay(policy: str, trace: Any, capacity: int) -> float:
        return 40.0 if policy == "lru" else 39.5

    monkeypatch.setattr(sys, "argv", ["policy_stress.py", "--policies", policies])
    monkeypatch.setattr(policy_stress, "replay", replay)
    monkeypatch.setattr(policy_stress, "workloads", lambda: iter([("a", [[1, 2]], [4])]))
    policy_stress.main()
    return capsys.readouterr().out.splitlines()


def test_policy_stress_shows_the_kvaware_gap_only_with_kvaware(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Every row ended in a "kv-lru" cell of +0.00, a tie with LRU for a policy never replayed.
    header, row = _stress_output("lru,arc", monkeypatch, capsys)
    assert "kv-lru" not in header
    assert row.split() == ["a", "4", "40.00", "39.50"]
    header, row, summary = _stress_output("kvaware,lru", monkeypatch, capsys)
    assert header.split()[-1] == "kv-lru" and row.split() == ["a", "4", "39.50", "40.00", "-0.50"]
    assert summary == (
        "kvaware - lru: 1 of 1 cells below LRU; smallest -0.50; losses summing to -0.50; mean -0.50"
    )


@pytest.mark.parametrize("text", ["-3:2", "-1"])
def test_policy_fuzz_refuses_negative_seeds(text: str) -> None:
    # random.Random(-s) draws random.Random(s)'s trace: seed -3 repeated seed 3 under its name.
    import policy_fuzz

    assert policy_fuzz.draw(3) == policy_fuzz.draw(-3)  # why they must be refused
    with pytest.raises(argparse.ArgumentTypeError, match=f"'{text}' is invalid.*0 <= START"):
        policy_fuzz._seeds(text)
    assert policy_fuzz._seeds("0:2") == range(0, 2)


def test_policy_fuzz_refuses_a_negative_seed_before_running(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import policy_fuzz

    monkeypatch.setattr(policy_fuzz, "_run", _must_not_run)
    argv = ["policy_fuzz.py", "--seeds=-2:1", "--policies", "lru,arc", "--jobs", "1"]
    last = refused_argv(policy_fuzz.main, argv, monkeypatch, capsys).strip().splitlines()[-1]
    assert last.startswith("policy_fuzz.py: error: argument --seeds: '-2:1' is invalid")


def test_policy_windows_summarises_each_trace_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given two traces (as docs/kvaware-evaluation.md's command is), the summary pooled them:
    # "arc: 4 of 8 cells below LRU" for a policy below LRU in all of one trace's cells.
    import policy_windows

    a, b = _trace(tmp_path / "a.jsonl"), _trace(tmp_path / "b.jsonl", first_id=100)

    def hit_pct(trace: Any, policy: str, share: float) -> float:
        if policy == "lru":
            return 20.0
        return 19.0 if trace.name == "a.jsonl" else 23.0

    monkeypatch.setattr(policy_windows, "hit_pct", hit_pct)
    argv = [str(a), str(b), "--policies", "arc", "--sizes", "10", "--starts", "1"]
    monkeypatch.setattr(sys, "argv", ["policy_windows.py", *argv])
    policy_windows.main()
    summary = capsys.readouterr().out.strip().splitlines()[-2:]
    cells = len(policy_windows.SHARES)
    assert summary == [
        f"a.jsonl, arc: {cells} of {cells} cells below LRU, losses summing to {-cells:.2f} "
        "(worst -1.00); mean − LRU -1.00",
        f"b.jsonl, arc: 0 of {cells} cells below LRU, losses summing to 0.00 (worst +0.00); "
        "mean − LRU +3.00",
    ]


def test_policy_windows_refuses_a_size_given_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Accepted before: each of its windows was replayed twice and counted twice.
    import policy_windows

    monkeypatch.setattr(policy_windows, "hit_pct", _must_not_run)
    argv = ["policy_windows.py", str(_trace(tmp_path / "t.jsonl")), "--sizes", "5,10,5"]
    last = refused_argv(policy_windows.main, argv, monkeypatch, capsys).strip().splitlines()[-1]
    assert last == "policy_windows.py: error: --sizes: [5] given twice; expected each size once"


def test_vs_vllm_scheduler_leaves_no_temp_folder_and_still_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each engine (two or three per window and hash seed) left a kvtier-bench-llama-* folder:
    # 519 of them in /tmp after a day of runs.
    pytest.importorskip("vllm")
    import vs_vllm

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    engine = vs_vllm._scheduler_engine(
        "KVTierConnector",
        {"num_slots": 32, "cache_policy": "lru"},
        "kvtier.integrations.vllm",
        64,
    )
    assert not [p.name for p in tmp_path.glob("kvtier-bench-llama-*")]
    # The config folder is read while the engine is built, not after: it still serves requests.
    prompt = [*range(3 * vs_vllm.SCHED_BLOCK), 1]
    steps, _, _ = vs_vllm._run_scheduler(engine, [prompt, prompt])
    assert steps > 0 and not engine.has_requests()


@pytest.mark.parametrize(
    ("argv", "named"),
    [(["--jobs", "0"], "--jobs: '0'"), (["--blocks", "16", "0"], "--blocks: '0'")],
    ids=["jobs", "blocks"],
)
def test_cuda_submit_host_names_the_value_it_refuses(
    argv: list[str],
    named: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # It said "--jobs, --rounds and --blocks must be at least 1", whichever held the 0.
    import cuda_submit_host

    monkeypatch.setattr(subprocess, "run", _must_not_run)  # it builds the stand-in driver
    full = ["cuda_submit_host.py", *argv]
    last = refused_argv(cuda_submit_host.main, full, monkeypatch, capsys).strip().splitlines()[-1]
    assert (
        last == f"cuda_submit_host.py: error: argument {named} is invalid; expected an integer >= 1"
    )


def test_registration_speed_refuses_parts_beyond_memory_before_running(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # --parts 4,1000000000 ran the 4 parts, then failed in torch's allocator with a traceback
    # ("you tried to allocate 64000000000 bytes").
    import _cli
    import registration_speed

    monkeypatch.setattr(_cli, "physical_memory", lambda: 2**30)  # 1 GiB: 16,777,216 parts
    monkeypatch.setattr(registration_speed, "seconds", _must_not_run)
    argv = ["registration_speed.py", "--parts", "4,20000000"]
    last = refused_argv(registration_speed.main, argv, monkeypatch, capsys).strip().splitlines()[-1]
    assert last == (
        "registration_speed.py: error: --parts 20000000: the buffers need 1.2 GiB, more than "
        "this machine's 1.0 GiB; expected smaller values"
    )


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # Printed nothing and wrote "{}" to --json, with exit status 0.
        (
            ["--skip-manager", "--skip-scheduler"],
            "--skip-manager with --skip-scheduler leaves nothing to run; expected one",
        ),
        # A window given twice ran twice and weighed twice in the mean over windows.
        (
            ["--skip-manager", "--sched-offsets", "0,0,300"],
            "--sched-offsets: [0] given twice; expected each window once",
        ),
        # A seed given twice ran twice and weighed twice in each window's median.
        (
            ["--skip-manager", "--hash-seeds", "1,0,1"],
            "--hash-seeds: [1] given twice; expected each seed once",
        ),
    ],
    ids=["nothing", "windows", "seeds"],
)
def test_vs_vllm_refuses_a_run_of_nothing_or_of_repeats(
    argv: list[str],
    expected: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import vs_vllm

    monkeypatch.setattr(vs_vllm, "mooncake_workload", _must_not_run)
    out = tmp_path / "out.json"
    full = ["vs_vllm.py", *argv, "--trace", str(_trace(tmp_path / "t.jsonl")), "--json", str(out)]

    def main() -> None:
        vs_vllm.main()

    last = refused_argv(main, full, monkeypatch, capsys).strip().splitlines()[-1]
    assert last == f"vs_vllm.py: error: {expected}"
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "named"),
    [(["--device", "5%"], "--device 5%"), (["--store", "eager"], "--store eager")],
    ids=["device", "store"],
)
def test_policy_phases_refuses_engine_options_in_flat_mode(
    argv: list[str],
    named: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Ignored before: the flat run's table passed for one behind the device cache asked for.
    import policy_phases

    monkeypatch.setattr(policy_phases, "hits", _must_not_run)
    full = ["policy_phases.py", str(_trace(tmp_path / "t.jsonl")), "--mode", "flat", *argv]
    last = refused_argv(policy_phases.main, full, monkeypatch, capsys).strip().splitlines()[-1]
    assert (
        last == f"policy_phases.py: error: {named}: only with --mode engine; the mode here is flat"
    )


@pytest.mark.parametrize(
    ("script", "argv", "named"),
    [
        ("manager_ops", ["--trace", "MISSING"], "no such file"),
        ("manager_ops", ["--trace", "PROSE"], "not a Mooncake trace line"),
        ("vs_vllm", ["--trace", "MISSING"], "no such file"),
        ("vs_vllm", ["--policies", "lru,nope"], "unknown ['nope']"),
    ],
    ids=["manager_ops-missing", "manager_ops-prose", "vs_vllm-missing", "vs_vllm-policy"],
)
def test_a_refusal_leaves_no_json_folder_behind(
    script: str,
    argv: list[str],
    named: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # These two make --json's missing folders; they did so before checking the trace and the
    # policies, and a refusal left the empty folders behind.
    import importlib

    module = importlib.import_module(script)
    monkeypatch.setattr(
        module, "mooncake_workload" if script == "vs_vllm" else "run", _must_not_run
    )
    prose = tmp_path / "prose.jsonl"
    prose.write_text("# not a trace\n")
    paths = {"MISSING": str(tmp_path / "missing.jsonl"), "PROSE": str(prose)}
    out = tmp_path / "made" / "deeper" / "out.json"
    full = [f"{script}.py", *(paths.get(a, a) for a in argv), "--json", str(out)]

    def main() -> None:
        module.main()

    last = refused_argv(main, full, monkeypatch, capsys).strip().splitlines()[-1]
    assert last.startswith(f"{script}.py: error: ") and named in last
    assert not (tmp_path / "made").exists()


def test_policy_stress_sums_the_losses_from_unrounded_gaps(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import policy_stress

    # Gaps -0.004 (twice, each shown as -0.00) and +1.0: the losses sum to -0.01, the mean +0.33.
    def replay(policy: str, trace: Any, capacity: int) -> float:
        return 40.0 if policy == "lru" else 40.0 + (1.0 if capacity == 8 else -0.004)

    monkeypatch.setattr(sys, "argv", ["policy_stress.py", "--policies", "lru,kvaware"])
    monkeypatch.setattr(policy_stress, "replay", replay)
    monkeypatch.setattr(policy_stress, "workloads", lambda: iter([("a", [[1, 2]], [4, 6, 8])]))
    policy_stress.main()
    summary = capsys.readouterr().out.splitlines()[-1]
    assert summary == (
        "kvaware - lru: 2 of 3 cells below LRU; smallest -0.00; losses summing to -0.01; mean +0.33"
    )
