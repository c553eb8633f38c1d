"""`kvtier simulate --policies` takes every spec the policy registry resolves: names and
`package.module:Class`."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.cli import main

_MODULE = '''
"""Policies of a user's own, outside kvtier."""

from kvtier.policies.lru import LRUPolicy


class Fifo(LRUPolicy):
    """First in, first out: a use does not move a key."""

    def touch(self, keys, ctx):
        pass


class NotAPolicy:
    pass
'''


@pytest.fixture
def policy_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory holding the module `mypolicies`, on this process's import path."""
    folder = tmp_path / "pkg"
    folder.mkdir()
    (folder / "mypolicies.py").write_text(_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "mypolicies", raising=False)
    return folder


@pytest.fixture
def trace(tmp_path: Path, trace_file: Callable[[Path, list[dict[str, object]]], Path]) -> Path:
    """A hot system prompt (block 0) before one fresh block: LRU keeps it, FIFO drops it."""
    rows: list[dict[str, object]] = []
    for t in range(40):
        ids = [0, 100 + t]
        rows.append({"timestamp": t, "input_length": len(ids) * 512, "hash_ids": ids})
    return trace_file(tmp_path / "trace.jsonl", rows)


def _rows(out: str) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = json.loads(out)
    for row in rows:
        del row["seconds"], row["blocks_per_s"]
    return rows


def test_a_module_class_policy_runs_through_the_cli(
    policy_dir: Path, trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["simulate", str(trace), "--policies", "lru, mypolicies:Fifo", "--capacities", "2"]
    assert main([*args, "--json", "-", "--jobs", "1"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert [r["policy"] for r in rows] == ["lru", "mypolicies:Fifo", "infinite"]
    assert rows[0]["block_hit_ratio"] != rows[1]["block_hit_ratio"]  # FIFO really ran
    if "fork" in multiprocessing.get_all_start_methods():
        assert main([*args, "--json", "-", "--jobs", "2"]) == 0
        assert _rows(capsys.readouterr().out) == rows


def test_python_m_kvtier_with_a_module_class_policy(policy_dir: Path, trace: Path) -> None:
    """The documented command: a module on PYTHONPATH, forked workers, table and JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(policy_dir), *sys.path])}
    args = ["--policies", "mypolicies:Fifo,opt", "--capacities", "4,8", "--jobs", "2", "-q"]
    done = subprocess.run(
        [sys.executable, "-m", "kvtier", "simulate", str(trace), *args, "--json", "-"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [(r["policy"], r["capacity_blocks"]) for r in rows] == [
        ("mypolicies:Fifo", 4),
        ("mypolicies:Fifo", 8),
        ("opt", 4),
        ("opt", 8),
        ("infinite", rows[-1]["capacity_blocks"]),
    ]
    table = subprocess.run(
        [sys.executable, "-m", "kvtier", "simulate", str(trace), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert table.returncode == 0, table.stderr
    assert "mypolicies:Fifo" in table.stdout


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_advise_takes_a_module_class_policy(
    policy_dir: Path, trace: Path, capsys: pytest.CaptureFixture[str], jobs: str
) -> None:
    args = ["simulate", str(trace), "--advise", "--policies", "lru,mypolicies:Fifo", "--jobs", jobs]
    assert main([*args, "--json", "-"]) == 0
    answers = json.loads(capsys.readouterr().out)
    assert [a["policy"] for a in answers] == ["lru", "mypolicies:Fifo"]
    assert all(a["block_hit_ratio"] >= a["target"] for a in answers)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("lfu9", "policy 'lfu9' is unknown; expected some of: "),
        ("no_such_module_xyz:Fifo", "cache policy 'no_such_module_xyz:Fifo' cannot be imported: "),
        ("mypolicies:Lifo", "cache policy 'mypolicies:Lifo' cannot be imported: "),
        (
            "mypolicies:NotAPolicy",
            "cache policy 'mypolicies:NotAPolicy' is not a kvtier.policies.CachePolicy class",
        ),
        (":Fifo", "cache policy ':Fifo' cannot be imported: "),
    ],
)
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_bad_spec_is_refused_before_the_trace_is_read(
    policy_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    spec: str,
    message: str,
    jobs: str,
) -> None:
    # The trace does not exist: the error proves the spec was checked first, in this process.
    missing = str(tmp_path / "none.jsonl")
    for extra in ([], ["--advise"]):
        assert main(["simulate", missing, "--policies", f"lru,{spec}", "--jobs", jobs, *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvtier simulate: error: " + message)
        assert err.count("\n") == 1
    assert not multiprocessing.active_children()


@pytest.mark.parametrize(
    ("source", "line", "error"),
    [
        (
            "from kvtier.policies.lru import LRUPolicy\nclass Fifo(LRUPolicy)\n    pass\n",
            2,
            "SyntaxError: expected ':'",
        ),
        (
            "from kvtier.policies.lru import LRUPolicy\nclass Fifo(LRUPolcy):\n    pass\n",
            2,
            "NameError: name 'LRUPolcy' is not defined",
        ),
        ("\n\nraise RuntimeError('no GPU here\\nat all')\n", 3, "RuntimeError: no GPU here at all"),
        ("SIZE = int('4k')\n", 1, "ValueError: invalid literal for int() with base 10: '4k'"),
    ],
    ids=["SyntaxError", "NameError", "RuntimeError", "ValueError"],
)
def test_a_module_that_fails_at_import_is_one_error_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    source: str,
    line: int,
    error: str,
) -> None:
    """Anything but an ImportError from the module printed a traceback and exited 1."""
    folder = tmp_path / "broken"
    folder.mkdir()
    module = folder / "brokenpolicies.py"
    module.write_text(source)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "brokenpolicies", raising=False)
    missing = str(tmp_path / "none.jsonl")  # the spec is checked before the trace is read
    argv = ["simulate", missing, "--policies", "lru,brokenpolicies:Fifo", "--jobs", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "kvtier simulate: error: cache policy 'brokenpolicies:Fifo' cannot be imported: " + error
    )
    assert f"({module}:{line})" in err
    assert err.count("\n") == 1
