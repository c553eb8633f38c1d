"""Benchmark scripts refuse a malformed trace, a window past its end and a prefix no block
holds whole in one line that names them, before the run (not with a traceback after it)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from helpers import refused_argv

NEEDS = {"vs_vllm": "vllm", "e2e_hf": "transformers"}
# (script, its arguments, the functions that start its run, what the refusal names).
# TRACE is a 3-request Mooncake trace, NOTJSON a file of prose, NOHASH a JSON line without
# hash_ids, OUT a path to write to.
CASES: list[tuple[str, list[str], list[str], str]] = [
    ("manager_ops", ["--trace", "NOTJSON"], ["run"], ":1: not a Mooncake trace line"),
    ("manager_ops", ["--trace", "NOHASH"], ["run"], "no 'hash_ids' field"),
    ("sim_speed", ["--trace", "NOTJSON"], ["run_grid"], ":1: not valid JSON"),
    ("sim_speed", ["--trace", "NOHASH"], ["run_grid"], "unknown trace format"),
    ("split_blocks", ["NOTJSON", "OUT"], [], ":1: not a Mooncake trace line"),
    ("split_blocks", ["NOHASH", "OUT"], [], "no 'hash_ids' field"),
    ("vs_vllm", ["--trace", "NOTJSON"], ["compare_managers", "compare_schedulers"], ":1: not"),
    ("vs_vllm", ["--trace", "NOHASH", "--skip-manager"], ["compare_schedulers"], "hash_ids"),
    (
        "vs_vllm",
        ["--trace", "TRACE", "--sched-offsets", "0,2", "--sched-requests", "2"],
        ["compare_managers", "compare_schedulers"],
        "--sched-offsets [2] with --sched-requests 2: the trace has 3 requests",
    ),
    ("e2e_hf", ["--prefixes", "1024,40"], ["make_demo_model"], "multiple of the block size"),
]


def _module(name: str) -> ModuleType:
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    return importlib.import_module(name)


class _MustNotRun:
    """Stands in for what starts a run: any use fails."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the benchmark started its run before refusing its arguments")


@pytest.fixture
def paths(tmp_path: Path) -> dict[str, str]:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            f'{{"timestamp": {i}, "input_length": 1024, "hash_ids": [1, {i + 2}]}}\n'
            for i in range(3)
        )
    )
    (tmp_path / "prose.jsonl").write_text("# not a trace\n")
    (tmp_path / "nohash.jsonl").write_text('{"timestamp": 0, "input_length": 10}\n')
    names = {"TRACE": "t.jsonl", "NOTJSON": "prose.jsonl", "NOHASH": "nohash.jsonl"}
    return {k: str(tmp_path / v) for k, v in {**names, "OUT": "out.jsonl"}.items()}


@pytest.mark.parametrize(
    ("name", "argv", "starts", "names"),
    CASES,
    ids=[f"{c[0]}:{' '.join(c[1])}" for c in CASES],
)
def test_a_bad_trace_or_window_is_refused_in_one_line(
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
    if hasattr(module, "torch"):  # as on a machine without a GPU
        monkeypatch.setattr(module.torch.cuda, "is_available", lambda: False)
    argv = [paths.get(a, a) for a in argv]
    err = refused_argv(module.main, [f"{name}.py", *argv], monkeypatch, capsys)
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{name}.py: error: ") and names in last, err
    if name == "split_blocks":  # no half-written trace left behind
        assert not Path(paths["OUT"]).exists()
