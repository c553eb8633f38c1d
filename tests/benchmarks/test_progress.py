"""Long benchmark runs say how far they are, on stderr (stdout keeps the results), and what a
small run prints agrees with what it writes to `--json`."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def _trace(path: Path, requests: int = 300, seed: int = 0) -> Path:
    """A Mooncake-format trace: a shared prefix, a popular block, a few one-off blocks."""
    rng, fresh, rows = random.Random(seed), 10_000, []
    for t in range(requests):
        ids = [1, 2, 100 + rng.randrange(40), *range(fresh, fresh + 3)]
        fresh += 3
        rows.append({"timestamp": t, "input_length": 512 * len(ids), "hash_ids": ids})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_policy_hit_ratios_counts_its_replays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import policy_hit_ratios
    from kvtier.policies import registered_policies

    monkeypatch.setattr(policy_hit_ratios, "TRACE", _trace(tmp_path / "t.jsonl"))
    monkeypatch.setattr(policy_hit_ratios, "_TRACES", {})
    out = tmp_path / "out.json"
    argv = ["policy_hit_ratios.py", "--no-synthetic", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    policy_hit_ratios.main()
    captured = capsys.readouterr()
    tasks = len(registered_policies()) * len(policy_hit_ratios.FRACTIONS)
    assert f"[{tasks}/{tasks} replays" in captured.err.splitlines()[-1]
    lru = json.loads(out.read_text())["trace"]["lru"]["hit_ratio"]
    assert "lru       " + "".join(f"{v:>9.2f}" for v in lru[:1]) in captured.out


def test_weak_locality_reports_each_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import weak_locality

    monkeypatch.setattr(weak_locality, "TRACE", _trace(tmp_path / "t.jsonl"))
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["weak_locality.py", "--json", str(out)])
    weak_locality.main()
    captured = capsys.readouterr()
    rows = json.loads(out.read_text())["hit_ratio"]
    assert list(rows) == ["lru", "lirs", "lru2", "kvaware"]
    assert all(len(values) == 4 for values in rows.values())  # the 4 default capacities
    assert captured.err.splitlines() == [f"{name}: done" for name in rows]
    for name, values in rows.items():
        assert f"{name:<10}" + "".join(f"{v:>10.2f}" for v in values) in captured.out


def test_manager_ops_reports_each_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import manager_ops

    out = tmp_path / "out.json"
    argv = ["--trace", str(_trace(tmp_path / "t.jsonl")), "--zipf-requests", "50"]
    assert (
        manager_ops.main([*argv, "--policies", "lru,arc", "--repeats", "1", "--json", str(out)])
        == 0
    )
    rows = json.loads(out.read_text())
    err = capsys.readouterr().err.splitlines()
    assert err == [f"{r['workload']} {r['policy']}: done" for r in rows]
    assert [(r["workload"], r["policy"]) for r in rows] == [
        ("zipf", "lru"), ("zipf", "arc"), ("t", "lru"), ("t", "arc")
    ]  # fmt: skip


@pytest.mark.slow
def test_vs_vllm_reports_each_scheduler_run(tmp_path: Path) -> None:
    """Two real scheduler children (vLLM's Scheduler with each connector, about 10 s each):
    one progress line per child, and kvtier's hit ratio is the same whatever PYTHONHASHSEED
    (vLLM's may not be: see `compare_schedulers`)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (scripts/setup.sh installs it)")
    import vs_vllm

    lines: list[str] = []
    trace = _trace(tmp_path / "t.jsonl")
    # 300 requests outgrow the 256-block device cache, so the host tiers serve some prefixes.
    result = vs_vllm.compare_schedulers(trace, [0], 300, "lru", 0.5, [0, 1], log=lines.append)
    assert lines == [
        "scheduler, lru, PYTHONHASHSEED 0: done (1 of 2)",
        "scheduler, lru, PYTHONHASHSEED 1: done (2 of 2)",
    ]
    assert [(r["hash_seed"], r["offset"], r["num_requests"]) for r in result["runs"]] == [
        (0, 0, 300),
        (1, 0, 300),
    ]
    (window,) = result["windows"]
    lines_of_trace = trace.read_text().splitlines()
    unique = len({h for line in lines_of_trace for h in json.loads(line)["hash_ids"]})
    assert window["num_slots"] == int(0.5 * unique)
    assert window["kvtier_hit_ratio_spread"] == 0.0
    assert 0.0 < result["kvtier_hit_ratio"] < 1.0 and 0.0 < result["vllm_hit_ratio"] < 1.0
    assert result["speedup"] > 0.0


def test_cuda_submit_reports_each_case(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    import torch  # the module cuda_submit asks whether CUDA is available

    import cuda_submit

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_submit, "bench_case", lambda *args: [])
    cuda_submit.main(["--cases", "64x1", "256x16"])
    err = capsys.readouterr().err.splitlines()
    assert err == ["64 KiB x 1: done (1 of 2)", "256 KiB x 16: done (2 of 2)"]


def test_transfer_bw_reports_each_page_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    import transfer_bw

    out = tmp_path / "out.json"
    transfer_bw.main(["--backend", "cpu", "--pages-kib", "64", "128", "--batches", "1",
                      "--repeats", "1", "--region-mib", "1", "--moved-mib", "1",
                      "--settle-ms", "0", "--json", str(out)])  # fmt: skip
    assert capsys.readouterr().err.splitlines() == [
        "64 KiB pages: done (1 of 2)",
        "128 KiB pages: done (2 of 2)",
    ]
    assert [r["page_bytes"] for r in json.loads(out.read_text())] == [65536] * 2 + [131072] * 2


def test_worker_side_reports_each_round(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    import worker_side

    out = tmp_path / "out.json"
    worker_side.main(["--device", "cpu", "--layers", "1", "--kv-heads", "1", "--head-dim", "16",
                      "--requests", "2", "--prompt-tokens", "256", "--repeats", "2",
                      "--json", str(out)])  # fmt: skip
    err = capsys.readouterr().err.splitlines()
    assert err == ["round 0 of 2: done (warm-up)", "round 1 of 2: done", "round 2 of 2: done"]
    rows = json.loads(out.read_text())
    assert [r["direction"] for r in rows] == ["store", "load"]


@pytest.mark.slow
def test_e2e_hf_reports_the_rounds_of_part_two() -> None:
    pytest.importorskip("transformers")
    import e2e_hf
    from kvtier.integrations.hf.models import make_demo_model

    model, _ = make_demo_model("llama", 0)
    lines: list[str] = []
    e2e_hf.bench_fresh(model, 32, 2, 3, 0, log=lines.append)
    assert lines == [f"nothing repeats: round {r} of 3 done" for r in (1, 2, 3)]
