"""A benchmark asked to write its results over the trace it reads refuses in one line,
before its run, and the trace is kept (before, the results replaced it)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from helpers import refused_argv

TRACE_LINE = b'{"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2]}\n'


class _MustNotRun:
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the benchmark started its run before refusing its arguments")

    def __getattr__(self, name: str) -> Any:
        self()


# (script, arguments with TRACE for the trace, what starts its run)
CASES = [
    ("policy_phases", ["TRACE", "--json", "TRACE"], ["read_trace"]),
    ("policy_windows", ["TRACE", "--json", "TRACE"], ["read_trace"]),
    ("sim_speed", ["--trace", "TRACE", "--json", "TRACE"], ["read_trace"]),
    ("manager_ops", ["--trace", "TRACE", "--json", "TRACE"], ["zipf_workload"]),
    ("vs_vllm", ["--trace", "TRACE", "--json", "TRACE"], ["mooncake_workload"]),
]


@pytest.mark.parametrize(("name", "argv", "starts"), CASES, ids=[c[0] for c in CASES])
def test_json_over_the_trace_is_refused_and_the_trace_kept(
    name: str,
    argv: list[str],
    starts: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(TRACE_LINE)
    module = importlib.import_module(name)
    for attr in starts:
        monkeypatch.setattr(module, attr, _MustNotRun())
    argv = [str(trace) if a == "TRACE" else a for a in argv]
    err = refused_argv(module.main, [f"{name}.py", *argv], monkeypatch, capsys)
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err
    assert last.startswith(f"{name}.py: error: --json ") and "is the input" in last, err
    assert trace.read_bytes() == TRACE_LINE


def test_json_over_the_bundled_trace_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scripts that always read the repository's Mooncake trace refuse to overwrite it."""
    import argparse

    from _cli import require_writable

    trace = tmp_path / "t.jsonl"
    trace.write_bytes(TRACE_LINE)
    link = tmp_path / "link.jsonl"
    link.symlink_to(trace)
    parser = argparse.ArgumentParser(prog="x")
    with pytest.raises(SystemExit):
        require_writable(parser, link, inputs=[trace])
    require_writable(parser, tmp_path / "out.json", inputs=[trace])  # another file is fine
    assert trace.read_bytes() == TRACE_LINE
