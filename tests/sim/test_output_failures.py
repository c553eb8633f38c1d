"""`kvtier simulate` when an output cannot be written: the other outputs are still written,
and the error names the one that failed. Also output paths refused before any replay: a
trailing separator and a dangling symlink into a missing directory."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers import kvtier_with_reader_gone
from kvtier.cli import main

needs_dev_full = pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")


@pytest.fixture
def trace(tmp_path: Path, trace_file: Callable[[Path, list[dict[str, object]]], Path]) -> Path:
    return trace_file(
        tmp_path / "trace.jsonl", [{"input_length": 1000, "hash_ids": [0, i]} for i in range(1, 40)]
    )


def _kvtier(args: list[str], redirect: str) -> subprocess.CompletedProcess[str]:
    line = shlex.join([sys.executable, "-m", "kvtier", *args]) + " " + redirect
    return subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=120)


def _files(tmp_path: Path) -> list[str]:
    return ["--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv")]


def _assert_written(tmp_path: Path, advise: bool) -> None:
    rows = json.loads((tmp_path / "r.json").read_text())
    assert rows and rows[0]["policy"] == "lru"
    header = (tmp_path / "r.csv").read_text().splitlines()[0]
    assert header.startswith("policy,target," if advise else "policy,capacity_blocks,")


@pytest.mark.parametrize("advise", [False, True], ids=["grid", "advise"])
def test_a_reader_that_goes_away_still_gets_the_files_written(
    trace: Path, tmp_path: Path, advise: bool
) -> None:
    """`kvtier simulate T --json r.json | true`: rich ended the process on the broken pipe,
    after every replay and before any file."""
    extra = ["--advise"] if advise else []
    argv = ["simulate", str(trace), "--policies", "lru", "-q", "--jobs", "1", *extra]
    assert kvtier_with_reader_gone([*argv, *_files(tmp_path)]) == (141, "")
    _assert_written(tmp_path, advise)


@needs_dev_full
@pytest.mark.parametrize("advise", [False, True], ids=["grid", "advise"])
def test_a_full_stdout_still_gets_the_files_written_and_is_named(
    trace: Path, tmp_path: Path, advise: bool
) -> None:
    extra = ["--advise"] if advise else []
    argv = ["simulate", str(trace), "--policies", "lru", "-q", "--jobs", "1", *extra]
    done = _kvtier([*argv, *_files(tmp_path)], ">/dev/full")
    assert done.returncode == 2
    assert done.stderr == (
        "kvtier simulate: error: cannot write to standard output: "
        "[Errno 28] No space left on device\n"
    )
    _assert_written(tmp_path, advise)


def test_a_closed_stdout_still_gets_the_files_written(trace: Path, tmp_path: Path) -> None:
    argv = ["simulate", str(trace), "--policies", "lru", "-q", "--jobs", "1"]
    done = _kvtier([*argv, *_files(tmp_path)], ">&-")
    assert done.returncode == 2
    assert "cannot write to standard output: [Errno 9] standard output is closed" in done.stderr
    assert done.stderr.count("\n") == 1
    _assert_written(tmp_path, advise=False)


@needs_dev_full
@pytest.mark.parametrize("flag", ["--json", "--csv"])
@pytest.mark.parametrize("advise", [False, True], ids=["grid", "advise"])
def test_a_file_that_cannot_be_written_is_named(
    trace: Path, flag: str, advise: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said only `error: [Errno 28] No space left on device`."""
    extra = ["--advise"] if advise else []
    argv = ["simulate", str(trace), "--policies", "lru", "-q", "--jobs", "1", *extra]
    assert main([*argv, flag, "/dev/full"]) == 2
    assert capsys.readouterr().err == (
        f"kvtier simulate: error: cannot write to {flag} file '/dev/full': "
        "[Errno 28] No space left on device\n"
    )


@needs_dev_full
@pytest.mark.parametrize("advise", [False, True], ids=["grid", "advise"])
def test_a_full_stdout_for_json_rows_is_named_after_the_csv_is_written(
    trace: Path, tmp_path: Path, advise: bool
) -> None:
    extra = ["--advise"] if advise else []
    argv = ["simulate", str(trace), "--policies", "lru", "-q", "--jobs", "1", *extra]
    done = _kvtier([*argv, "--json", "-", "--csv", str(tmp_path / "r.csv")], ">/dev/full")
    assert done.returncode == 2
    assert done.stderr == (
        "kvtier simulate: error: cannot write to standard output: "
        "[Errno 28] No space left on device\n"
    )
    assert (tmp_path / "r.csv").read_text().startswith("policy,")


def _refused_before_any_replay(
    trace: Path,
    args: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> str:
    from kvtier.sim import command

    def no_replay(*args: object, **kwargs: object) -> None:
        raise AssertionError("the trace was read before the outputs were checked")

    monkeypatch.setattr(command, "read_trace", no_replay)
    assert main(["simulate", str(trace), "-q", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier simulate: error: ") and err.count("\n") == 1
    return err


@pytest.mark.parametrize("flag", ["--json", "--csv"])
@pytest.mark.parametrize("exists", [False, True])
def test_a_trailing_separator_is_refused_before_any_replay(
    trace: Path,
    tmp_path: Path,
    flag: str,
    exists: bool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--json results_dir/` failed with `[Errno 21] Is a directory` after every replay."""
    folder = tmp_path / "results_dir"
    if exists:
        folder.mkdir()
    name = str(folder) + os.sep
    err = _refused_before_any_replay(trace, [flag, name], monkeypatch, capsys)
    assert f"{flag}={name!r} is invalid; " in err
    assert "expected a file path" in err


@pytest.mark.parametrize("flag", ["--json", "--csv", "--plot"])
def test_a_dangling_symlink_into_a_missing_directory_is_refused_before_any_replay(
    trace: Path,
    tmp_path: Path,
    flag: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if flag == "--plot":
        pytest.importorskip("matplotlib")
    link = tmp_path / "out.png"
    link.symlink_to(tmp_path / "missing" / "out.png")
    err = _refused_before_any_replay(trace, [flag, str(link)], monkeypatch, capsys)
    assert f"{flag}={str(link)!r} is invalid; " in err
    assert f"{str(tmp_path / 'missing')!r} does not exist" in err


def test_a_dangling_symlink_into_an_existing_directory_is_written(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """open() creates the link's target: nothing to refuse."""
    link = tmp_path / "out.json"
    link.symlink_to(tmp_path / "target.json")
    assert main(["simulate", str(trace), "-q", "--jobs", "1", "--json", str(link)]) == 0
    assert json.loads((tmp_path / "target.json").read_text())[0]["policy"]
