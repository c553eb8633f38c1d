"""Review fixes: bad bytes and bad block sizes named as such, plain-int capacities, a plot that
leaves the caller's matplotlib state alone."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvtier.cli import main
from kvtier.sim.bounds import belady, opt_result
from kvtier.sim.readers import read_mooncake, read_trace
from kvtier.sim.report import plot_format, plot_miss_ratio, write_json
from kvtier.sim.runner import ReplayOptions, run_grid, run_one
from kvtier.sim.trace import Trace, TraceFormatError

MakeTrace = Callable[..., Trace]

_LINE = b'{"input_length": 10, "hash_ids": [1]}\n'


def test_a_line_that_is_not_utf8_names_its_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(_LINE + b'{"input_length": 10, "hash_ids": [1], "note": "caf\xe9"}\n')
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:2: not valid UTF-8 \(byte 0xe9"):
        read_trace(path)


def test_the_command_reports_a_non_utf8_line_by_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(_LINE * 3 + b'{"input_length": 10, "hash_ids": [1], "x": "\xff"}\n')
    assert main(["simulate", str(path), "-q", "--jobs", "1"]) == 2
    assert "t.jsonl:4: not valid UTF-8" in capsys.readouterr().err


@pytest.mark.parametrize("block_tokens", [0, -5, 2.5, True, "512"])
def test_read_mooncake_names_a_bad_block_size_not_the_trace(
    tmp_path: Path, block_tokens: object
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(_LINE)
    # At the call, and about the argument: line 1 was blamed for not fitting blocks of 0 tokens
    # ("expected 1..0"), or a str failed on `<`.
    with pytest.raises(ValueError, match=r"^block_tokens=.* is invalid; expected an integer"):
        read_mooncake(path, block_tokens=block_tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize("capacity", [2.5, True, "3"])
def test_opt_refuses_a_capacity_that_is_not_a_block_count(
    capacity: object, make_trace: MakeTrace
) -> None:
    # 2.5 replayed as 3 blocks and was reported as 2.5, as other policies refuse it.
    trace = make_trace(3, num_requests=100)
    with pytest.raises(ValueError, match=r"capacity=.* is invalid; expected an integer >= 1"):
        opt_result(trace, capacity)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"capacity=.* is invalid"):
        belady([b"a", b"a"], capacity)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"capacity=.* is invalid"):
        run_one(trace, "opt", capacity, ReplayOptions())  # type: ignore[arg-type]


def test_numpy_capacities_give_rows_json_can_write(make_trace: MakeTrace) -> None:
    trace = make_trace(3, num_requests=100)
    big = np.int64(10 * trace.num_unique_blocks)  # beyond the trace: the row reports it
    runs = [("opt", np.int64(3)), ("lru", big), ("infinite", np.int64(1))]
    results = run_grid(trace, runs, ReplayOptions())  # type: ignore[arg-type]
    assert [type(r.capacity_blocks) for r in results] == [int, int, int]
    assert [r.capacity_blocks for r in results] == [3, int(big), trace.num_unique_blocks]
    out = io.StringIO()
    write_json(results, out, None)
    assert [row["capacity_blocks"] for row in json.loads(out.getvalue())] == [
        3,
        int(big),
        trace.num_unique_blocks,
    ]
    plain = run_one(trace, "opt", 3, ReplayOptions())
    assert (results[0].hits, results[0].stores) == (plain.hits, plain.stores)


def test_plotting_leaves_the_callers_backend_and_figures_alone(
    tmp_path: Path, make_trace: MakeTrace
) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    plt = pytest.importorskip("matplotlib.pyplot")
    trace = make_trace(1)
    results = run_grid(trace, [("lru", 3), ("infinite", trace.num_unique_blocks)], ReplayOptions())
    before = matplotlib.get_backend()
    figures = plt.get_fignums()
    matplotlib.use("pdf")  # a caller's choice, as a notebook's inline backend
    try:
        assert plot_format(tmp_path / "a.png") == "png"
        plot_miss_ratio(results, tmp_path / "a.svg")
        for _ in range(2):
            with pytest.raises(OSError):
                plot_miss_ratio(results, tmp_path / "missing" / "a.png")
        # Was switched to Agg, and each failed save left a pyplot figure open.
        assert matplotlib.get_backend() == "pdf"
        assert plt.get_fignums() == figures
    finally:
        matplotlib.use(before)
    assert (tmp_path / "a.svg").read_bytes().lstrip().startswith(b"<?xml")


@pytest.mark.parametrize("flag", ["--json", "--csv", "--plot"])
def test_an_output_name_too_long_to_look_up_names_its_flag(
    tmp_path: Path, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(_LINE * 2)
    name = str(tmp_path / ("a" * 300 + ".png"))  # beyond NAME_MAX: ENAMETOOLONG
    assert main(["simulate", str(path), "-q", "--jobs", "1", flag, name]) == 2
    err = capsys.readouterr().err
    assert f"error: {flag}='{name}' is invalid; File name too long" in err


@pytest.mark.skipif(not Path("/dev/stdout").exists(), reason="needs /dev/stdout")
def test_json_to_dev_stdout_is_stdout_without_the_table(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(_LINE * 3)
    cmd = [sys.executable, "-m", "kvtier", "simulate", str(path), "-q", "--jobs", "1"]
    cmd += ["--policies", "lru", "--capacities", "1"]
    done = subprocess.run([*cmd, "--json", "/dev/stdout"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    # The table came first on the same pipe: not JSON.
    assert [row["policy"] for row in json.loads(done.stdout)] == ["lru", "infinite"]
    both = subprocess.run([*cmd, "--json", "/dev/stdout", "--csv", "-"], capture_output=True)
    assert both.returncode == 2
    assert b"--json and --csv both write to stdout" in both.stderr
    assert both.stdout == b""
