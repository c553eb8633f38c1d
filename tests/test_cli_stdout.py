"""`kvtier` when its standard output cannot be written: closed (`>&-`) or full (/dev/full).
Both used to exit 0 with nothing written, for --help, --version and `kvtier policies`."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cli import main

COMMANDS = [["--help"], ["--version"], ["policies"], ["demo", "--help"]]


def _run(argv: list[str], redirect: str, unbuffered: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    line = shlex.join([sys.executable, "-m", "kvtier", *argv]) + " " + redirect
    return subprocess.run(
        ["bash", "-c", line], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_a_closed_stdout_is_an_error_not_silence(argv: list[str]) -> None:
    """Python sets sys.stdout to None when fd 1 is closed, and print() then drops every line."""
    done = _run(argv, ">&-", unbuffered=False)
    assert done.returncode == 2
    assert "[Errno 9] standard output is closed" in done.stderr
    assert done.stderr.count("\n") == 1  # one line, no traceback at exit


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("unbuffered", [False, True])
@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["policies"]], ids=" ".join)
def test_output_into_a_full_device_is_an_error(argv: list[str], unbuffered: bool) -> None:
    """argparse ignores OSError while writing --help, and Python ignored the failed flush;
    `kvtier policies` said only `error: [Errno 28] No space left on device`."""
    done = _run(argv, ">/dev/full", unbuffered)
    assert done.returncode == 2
    command = "kvtier policies" if argv == ["policies"] else "kvtier"
    assert done.stderr == (
        f"{command}: error: cannot write to standard output: [Errno 28] No space left on device\n"
    )


def test_help_still_exits_through_system_exit(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: kvtier ")
