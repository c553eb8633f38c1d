"""Benchmark review, third pass: the transfer, submit, registration and end-to-end scripts took
a size, case, path, CPU or prefix given twice and ran it twice, printing (and saving) its rows
twice, each copy timed at other moments."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from helpers import refused_argv


def _must_not_run(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the benchmark started its run before refusing its arguments")


# (script, arguments, what the refusal names, the function that would start the run)
CASES = [
    (
        "transfer_bw",
        ["--backend", "cpu", "--pages-kib", "4", "4"],
        "--pages-kib: [4]",
        "bench_page",
    ),
    (
        "transfer_bw",
        ["--backend", "cpu", "--batches", "1", "16", "1"],
        "--batches: [1]",
        "bench_page",
    ),
    (
        "transfer_bw",
        ["--backend", "cpu", "--copy-cpus", "0", "0"],
        "--copy-cpus: [0]",
        "bench_page",
    ),
    ("cpu_submit", ["--cases", "64x1", "64x16", "64x1"], "--cases: ['64x1']", "bench_case"),
    ("cuda_submit", ["--cases", "256x1", "256x1"], "--cases: ['256x1']", "bench_case"),
    ("cuda_submit", ["--paths", "torch", "torch"], "--paths: ['torch']", "bench_case"),
    ("cuda_submit_host", ["--blocks", "16", "16"], "--blocks: [16]", None),
    ("registration_speed", ["--parts", "8,16,8"], "--parts: [8]", "seconds"),
    ("e2e_hf", ["--prefixes", "1024,1024"], "--prefixes: [1024]", "make_demo_model"),
]


@pytest.mark.parametrize(
    ("script", "argv", "named", "starts"),
    CASES,
    ids=[f"{c[0]}{c[1][-2]}" for c in CASES],
)
def test_a_value_given_twice_is_refused_before_the_run(
    script: str,
    argv: list[str],
    named: str,
    starts: str | None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    module = __import__(script)
    if starts is not None:
        monkeypatch.setattr(module, starts, _must_not_run)
    monkeypatch.setattr(subprocess, "run", _must_not_run)  # cuda_submit_host builds a driver
    main = module.main
    err = refused_argv(main, [f"{script}.py", *argv], monkeypatch, capsys)
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{script}.py: error: {named} given twice; expected each "), last


BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

# Runs a script as `python benchmarks/NAME.py` does, with the first clock read of its run
# raising KeyboardInterrupt, as a Ctrl-C in a timed loop would (the modules a script imports
# are imported first, so only the script's own reads raise).
_INTERRUPT_AT_FIRST_TIMING = """
import runpy, sys, time
import numpy, rich.console, torch, kvtier.transfer, kvtier.sim.runner, kvtier.connector
sys.path.insert(0, sys.argv[1])

def interrupt() -> float:
    raise KeyboardInterrupt

time.perf_counter = interrupt
script = sys.argv[2]
sys.argv = [script, *sys.argv[3:]]
runpy.run_path(script, run_name="__main__")
"""


@pytest.mark.parametrize(
    ("script", "argv"),
    [
        ("sim_speed", ["--policies", "lru", "--jobs", "1"]),
        ("manager_ops", ["--policies", "lru", "--repeats", "1"]),
        ("registration_speed", ["--parts", "8", "--repeats", "1"]),
        (
            "transfer_bw",
            ["--backend", "cpu", "--pages-kib", "4", "--batches", "1", "--region-mib", "1"],
        ),
        (
            "worker_side",
            ["--device", "cpu", "--layers", "1", "--kv-heads", "1", "--head-dim", "8"],
        ),
    ],
)
def test_ctrl_c_ends_a_script_in_one_line_with_status_130(script: str, argv: list[str]) -> None:
    # It printed KeyboardInterrupt's traceback from wherever the loop was, and the shell saw
    # the process killed by SIGINT rather than an exit status.
    done = subprocess.run(
        [sys.executable, "-c", _INTERRUPT_AT_FIRST_TIMING, str(BENCHMARKS),
         str(BENCHMARKS / f"{script}.py"), *argv],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == "interrupted"
