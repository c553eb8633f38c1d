"""Benchmark review, third pass: Ctrl-C killed every script without a process pool by SIGINT,
with a traceback from wherever its loop was. (Values given twice, which ran twice: the cases
in test_arguments.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


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
