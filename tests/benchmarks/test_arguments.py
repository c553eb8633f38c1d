"""Every benchmark script refuses a bad argument in one line that names it, before its run.

The function that starts each script's run is replaced by one that fails the test, so a
script that only notices the bad value at the end of its run (an unwritable `--json`, say)
fails here at once rather than after minutes.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from helpers import refused_argv

NEEDS = {
    "cpu_submit": "torch",
    "cuda_submit": "torch",
    "cuda_submit_host": "torch",
    "transfer_bw": "torch",
    "worker_side": "torch",
    "e2e_hf": "transformers",
}
# (script, its arguments, the functions that start its run, what the refusal names).
# TRACE is a small trace, TRACE3 a 3-request one, NOTJSON a file of prose, NOHASH a JSON line
# without hash_ids, BAD a path no file can be written to, OUT a path to write to.
CASES: list[tuple[str, list[str], list[str], str]] = [
    ("policy_fuzz", ["--seeds", "0:1", "--json", "BAD"], ["worker_pool"], "--json"),
    ("policy_hit_ratios", ["--json", "BAD"], ["worker_pool"], "--json"),
    ("policy_stress", ["--json", "BAD"], ["workloads"], "--json"),
    ("weak_locality", ["--json", "BAD"], ["load_trace"], "--json"),
    ("policy_phases", ["TRACE", "--json", "BAD"], ["read_trace"], "--json"),
    ("policy_phases", ["/no/such.jsonl"], ["read_trace"], "'/no/such.jsonl': no such file"),
    ("policy_phases", ["TRACE", "--capacity", "abc"], ["hits"], "capacity 'abc' is invalid"),
    ("policy_phases", ["TRACE", "--device", "0"], ["hits"], "capacity '0' is less than one"),
    ("policy_windows", ["TRACE", "--json", "BAD"], ["read_trace"], "--json"),
    ("policy_windows", ["TRACE", "/no/such.jsonl"], ["read_trace"], "no such file"),
    ("sim_speed", ["--trace", "TRACE", "--json", "BAD"], ["read_trace"], "--json"),
    ("sim_speed", ["--trace", "/no/such.jsonl"], ["read_trace"], "no such file"),
    ("sim_speed", ["--trace", "TRACE", "--capacities", "1%,abc"], ["run_grid"], "'abc'"),
    ("sim_speed", ["--trace", "TRACE", "--policies", "lru,nope"], ["run_grid"], "['nope']"),
    ("sim_speed", ["--trace", "TRACE", "--jobs", "0"], ["run_grid"], "--jobs: '0'"),
    ("split_blocks", ["TRACE", "OUT", "--tokens", "24"], ["split_trace"], "--tokens 24"),
    ("split_blocks", ["/no/such.jsonl", "OUT"], ["split_trace"], "no such file"),
    ("split_blocks", ["TRACE", "BAD"], ["split_trace"], "cannot write there"),
    ("split_blocks", ["TRACE", "TRACE"], ["split_trace"], "is the input"),
    # A hard link: opening dst for writing emptied both.
    ("split_blocks", ["TRACE", "TRACELINK"], ["split_trace"], "is the input"),
    ("registration_speed", ["--parts", "8,0"], ["seconds"], "--parts: '8,0'"),
    ("registration_speed", ["--repeats", "0"], ["seconds"], "--repeats: '0'"),
    ("registration_speed", ["--json", "BAD"], ["seconds"], "--json"),
    ("manager_ops", ["--json", "BAD"], ["zipf_workload"], "--json"),
    ("manager_ops", ["--trace", "/no/such.jsonl"], ["zipf_workload"], "no such file"),
    ("manager_ops", ["--policies", "lru,nope"], ["zipf_workload"], "['nope']"),
    ("manager_ops", ["--zipf-requests", "-1"], ["zipf_workload"], "--zipf-requests: '-1'"),
    ("manager_ops", ["--repeats", "0"], ["zipf_workload"], "--repeats: '0'"),
    ("vs_vllm", ["--json", "BAD"], ["mooncake_workload", "compare_schedulers"], "--json"),
    ("vs_vllm", ["--trace", "/no/such.jsonl"], ["mooncake_workload"], "no such file"),
    ("vs_vllm", ["--policies", "nope"], ["mooncake_workload"], "['nope']"),
    ("vs_vllm", ["--sched-offsets", "0,a"], ["mooncake_workload"], "'0,a' is invalid"),
    ("vs_vllm", ["--hash-seeds", "a"], ["mooncake_workload"], "'a' is invalid"),
    ("vs_vllm", ["--repeats", "0"], ["mooncake_workload"], "--repeats: '0'"),
    ("vs_vllm", ["--sched-requests", "0"], ["mooncake_workload"], "--sched-requests: '0'"),
    ("vs_vllm", ["--capacity", "0"], ["mooncake_workload"], "--capacity 0.0 is invalid"),
    ("transfer_bw", ["--backend", "cuda"], ["bench_page"], "no CUDA device"),
    ("transfer_bw", ["--pages-kib", "64", "0"], ["bench_page"], "--pages-kib: '0'"),
    ("transfer_bw", ["--batches", "0"], ["bench_page"], "--batches: '0'"),
    ("transfer_bw", ["--repeats", "0"], ["bench_page"], "--repeats: '0'"),
    ("transfer_bw", ["--region-mib", "0"], ["bench_page"], "--region-mib: '0'"),
    ("transfer_bw", ["--moved-mib", "-1"], ["bench_page"], "--moved-mib: '-1'"),
    ("transfer_bw", ["--backend", "cpu", "--copy-threads", "0"], ["bench_page"], "'0'"),
    ("transfer_bw", ["--backend", "cpu", "--copy-cpus", "4096"], ["bench_page"], "--copy-cpus"),
    ("transfer_bw", ["--seed", "-1"], ["bench_page"], "--seed: '-1'"),
    ("transfer_bw", ["--backend", "cpu", "--json", "BAD"], ["bench_page"], "--json"),
    # time.sleep refused these after the first copies, with a traceback.
    ("transfer_bw", ["--backend", "cpu", "--settle-ms", "nan"], ["bench_page"], "--settle-ms nan"),
    ("transfer_bw", ["--backend", "cpu", "--settle-ms", "inf"], ["bench_page"], "--settle-ms inf"),
    # Buffers larger than the machine: torch's allocator failed with a traceback (or swapped).
    (
        "transfer_bw",
        ["--backend", "cpu", "--region-mib", "99999999"],
        ["bench_page"],
        "--region-mib 99999999 with --pages-kib 8 16 64 256 1024 2048 and --batches 1 16 128: "
        "the buffers need",
    ),
    (
        "transfer_bw",
        ["--backend", "cpu", "--pages-kib", "2048", "--batches", "9999999"],
        ["bench_page"],
        "more than this machine's",
    ),
    ("cpu_submit", ["--region-mib", "99999999"], ["bench_case"], "--region-mib 99999999: the"),
    ("worker_side", ["--requests", "999999"], ["Rig"], "--requests 999999: the buffers need"),
    ("cpu_submit", ["--json", "BAD"], ["bench_case"], "--json"),
    ("cpu_submit", ["--cases", "1024x16", "--region-mib", "8"], ["bench_case"], "--region-mib 8"),
    ("cpu_submit", ["--region-mib", "0"], ["bench_case"], "--region-mib: '0'"),
    ("cuda_submit", ["--json", "BAD"], ["bench_case"], "--json"),
    ("cuda_submit", ["--cases", "1024x16", "--region-mib", "8"], ["bench_case"], "holds fewer"),
    ("cuda_submit_host", ["--json", "BAD"], ["tempfile"], "--json"),
    ("worker_side", ["--device", "cuda"], ["Rig"], "no CUDA device"),
    ("worker_side", ["--json", "BAD"], ["Rig"], "--json"),
    ("worker_side", ["--requests", "0"], ["Rig"], "--requests: '0'"),
    ("worker_side", ["--repeats", "0"], ["Rig"], "--repeats: '0'"),
    ("worker_side", ["--layers", "0"], ["Rig"], "--layers: '0'"),
    ("worker_side", ["--prompt-tokens", "300"], ["Rig"], "--prompt-tokens 300 is invalid"),
    ("e2e_hf", ["--json", "BAD"], ["make_demo_model"], "--json"),
    ("e2e_hf", ["--prefixes", "1024,abc"], ["make_demo_model"], "--prefixes '1024,abc'"),
    ("e2e_hf", ["--repeats", "0"], ["make_demo_model"], "--repeats: '0'"),
    ("e2e_hf", ["--rounds", "0"], ["make_demo_model"], "--rounds: '0'"),
    ("e2e_hf", ["--tail", "0"], ["make_demo_model"], "--tail: '0'"),
    ("e2e_hf", ["--prefixes", "1024,40"], ["make_demo_model"], "multiple of the block size"),
    # A malformed trace or a window past its end: one line naming it, not a traceback.
    ("manager_ops", ["--trace", "NOTJSON"], ["run"], ":1: not a Mooncake trace line"),
    ("manager_ops", ["--trace", "NOHASH"], ["run"], "no 'hash_ids' field"),
    ("sim_speed", ["--trace", "NOTJSON"], ["run_grid"], ":1: not valid JSON"),
    ("sim_speed", ["--trace", "NOHASH"], ["run_grid"], "unknown trace format"),
    ("split_blocks", ["NOTJSON", "OUT"], [], ":1: not a Mooncake trace line"),
    ("split_blocks", ["NOHASH", "OUT"], [], "no 'hash_ids' field"),
    ("vs_vllm", ["--trace", "NOTJSON"], ["compare_managers", "compare_schedulers"], ":1: not"),
    ("vs_vllm", ["--trace", "EMPTY"], ["compare_managers", "compare_schedulers"], "no blocks"),
    ("manager_ops", ["--trace", "EMPTY"], ["run"], "the trace holds no blocks"),
    ("policy_phases", ["NOTJSON"], ["hits"], ":1: not valid JSON"),
    ("policy_phases", ["EMPTY"], ["hits"], "trace: "),
    ("policy_windows", ["TRACE", "NOTJSON"], ["hit_pct"], ":1: not valid JSON"),
    ("policy_windows", ["EMPTY"], ["hit_pct"], "trace: "),
    ("vs_vllm", ["--trace", "NOHASH", "--skip-manager"], ["compare_schedulers"], "hash_ids"),
    (
        "vs_vllm",
        ["--trace", "TRACE3", "--sched-offsets", "0,2", "--sched-requests", "2"],
        ["compare_managers", "compare_schedulers"],
        "--sched-offsets [2] with --sched-requests 2: the trace has 3 requests",
    ),
    # A value given twice ran twice: its rows printed and saved twice, each timed at other
    # moments (cuda_submit_host builds its stand-in driver with subprocess).
    (
        "transfer_bw",
        ["--backend", "cpu", "--pages-kib", "4", "4"],
        ["bench_page"],
        "--pages-kib: [4] given twice",
    ),
    (
        "transfer_bw",
        ["--backend", "cpu", "--batches", "1", "16", "1"],
        ["bench_page"],
        "--batches: [1] given twice",
    ),
    (
        "transfer_bw",
        ["--backend", "cpu", "--copy-cpus", "0", "0"],
        ["bench_page"],
        "--copy-cpus: [0] given twice",
    ),
    (
        "cpu_submit",
        ["--cases", "64x1", "64x16", "64x1"],
        ["bench_case"],
        "--cases: ['64x1'] given twice",
    ),
    (
        "cuda_submit",
        ["--cases", "256x1", "256x1"],
        ["bench_case"],
        "--cases: ['256x1'] given twice",
    ),
    (
        "cuda_submit",
        ["--paths", "torch", "torch"],
        ["bench_case"],
        "--paths: ['torch'] given twice",
    ),
    ("cuda_submit_host", ["--blocks", "16", "16"], ["subprocess"], "--blocks: [16] given twice"),
    ("registration_speed", ["--parts", "8,16,8"], ["seconds"], "--parts: [8] given twice"),
    ("e2e_hf", ["--prefixes", "1024,1024"], ["make_demo_model"], "--prefixes: [1024] given twice"),
]


def _module(name: str) -> ModuleType:
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    return importlib.import_module(name)


class _MustNotRun:
    """Stands in for what starts a run (a function, a class or a module): any use fails."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the benchmark started its run before refusing its arguments")

    def __getattr__(self, name: str) -> Any:
        self()


@pytest.fixture
def paths(tmp_path: Path) -> dict[str, str]:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2]}\n')
    (tmp_path / "a-file").write_text("")
    three = tmp_path / "t3.jsonl"
    three.write_text(
        "".join(
            f'{{"timestamp": {i}, "input_length": 1024, "hash_ids": [1, {i + 2}]}}\n'
            for i in range(3)
        )
    )
    (tmp_path / "prose.jsonl").write_text("# not a trace\n")
    (tmp_path / "nohash.jsonl").write_text('{"timestamp": 0, "input_length": 10}\n')
    (tmp_path / "empty.jsonl").write_text("")
    os.link(trace, tmp_path / "t-link.jsonl")
    # A folder that is a file: nothing can be written below it, not even by root.
    return {"TRACE": str(trace), "BAD": str(tmp_path / "a-file" / "out.json"),
            "OUT": str(tmp_path / "out.jsonl"), "TRACE3": str(three),
            "NOTJSON": str(tmp_path / "prose.jsonl"),
            "NOHASH": str(tmp_path / "nohash.jsonl"), "EMPTY": str(tmp_path / "empty.jsonl"),
            "TRACELINK": str(tmp_path / "t-link.jsonl")}  # fmt: skip


@pytest.mark.parametrize(
    ("name", "argv", "starts", "names"),
    CASES,
    ids=[f"{c[0]}:{' '.join(c[1])}" for c in CASES],
)
def test_a_bad_argument_is_refused_in_one_line_before_the_run(
    name: str,
    argv: list[str],
    starts: list[str],
    names: str,
    paths: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    module = _module(name)
    for attr in starts:
        monkeypatch.setattr(module, attr, _MustNotRun())
    if name == "cuda_submit":  # the checks after its own "needs a CUDA device"
        monkeypatch.setattr(module.torch.cuda, "is_available", lambda: True)
    elif hasattr(module, "torch"):  # as on a machine without a GPU
        monkeypatch.setattr(module.torch.cuda, "is_available", lambda: False)
    argv = [paths.get(a, a) for a in argv]
    err = refused_argv(module.main, [f"{name}.py", *argv], monkeypatch, capsys)
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{name}.py: error: ") and names in last, err
    if name == "split_blocks":  # no half-written trace left behind
        assert not Path(paths["OUT"]).exists()


def test_e2e_hf_refuses_a_cuda_index_past_the_visible_devices(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As on a machine with two GPUs (stood in: there is none here). Before, `cuda:3` passed
    the checks and the model's move failed deep in torch."""
    module = _module("e2e_hf")
    monkeypatch.setattr(module, "make_demo_model", _MustNotRun())
    monkeypatch.setattr(module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(module.torch.cuda, "device_count", lambda: 2)
    err = refused_argv(module.main, ["e2e_hf.py", "--device", "cuda:3"], monkeypatch, capsys)
    last = err.strip().splitlines()[-1]
    assert last == "e2e_hf.py: error: --device cuda:3: torch sees 2 CUDA device(s), 0..1", err


def test_the_json_check_leaves_no_file_and_keeps_an_existing_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from _cli import require_writable

    parser = argparse.ArgumentParser()
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    old.write_text("kept")
    require_writable(parser, new)
    require_writable(parser, old)
    assert not new.exists() and old.read_text() == "kept"
    require_writable(parser, tmp_path / "made" / "x.json", make_parents=True)
    assert (tmp_path / "made").is_dir() and not (tmp_path / "made" / "x.json").exists()


def test_a_stand_in_driver_that_does_not_build_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = _module("cuda_submit_host")
    monkeypatch.setenv("CC", "false")
    err = refused_argv(module.main, ["cuda_submit_host.py", "--jobs", "1"], monkeypatch, capsys)
    assert "Traceback" not in err
    assert "CC=false could not build the stand-in driver" in err.strip().splitlines()[-1]


@pytest.mark.parametrize("name", ["policy_fuzz", "policy_stress", "policy_phases", "split_blocks"])
def test_help_describes_the_script_in_whole_sentences(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The first line of a wrapped docstring ended mid-sentence ("...and chat with a").
    module = _module(name)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])
    with pytest.raises(SystemExit):
        module.main()
    words = " ".join(capsys.readouterr().out.split())
    assert " ".join((module.__doc__ or "").split("\n\n")[0].split()) in words
