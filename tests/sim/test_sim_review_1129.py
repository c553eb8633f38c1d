"""Review fixes: a trace's file name shown as it is in the table's title and the plot's, every
policy named in the plot's legend, outputs that are one file under two names refused, and an
existing output that the user may write accepted in a directory the user may not write."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import kvtier
import kvtier.sim.report as report
from kvtier.cli import main
from kvtier.sim.runner import ReplayOptions, run_grid
from kvtier.sim.trace import Trace

_LINES = (
    b'{"input_length": 10, "hash_ids": [1, 2]}\n'
    b'{"input_length": 12, "hash_ids": [1, 3]}\n'
    b'{"input_length": 9, "hash_ids": [1, 2]}\n'
)
_ARGS = ["--policies", "lru,opt", "--capacities", "1", "-q", "--jobs", "1"]

MakeTrace = Callable[..., Trace]


def _record_figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The figures `plot_miss_ratio` draws from now on, to read back what they show."""
    figure_cls = report._figure_cls()
    figures: list[Any] = []

    def recording_figure(*args: Any, **kwargs: Any) -> Any:
        fig = figure_cls(*args, **kwargs)
        figures.append(fig)
        return fig

    monkeypatch.setattr(report, "_figure_cls", lambda: recording_figure)
    return figures


@pytest.mark.parametrize("name", ["conv[v2].jsonl", "c[bold]x.jsonl", "c[#ff0000]x.jsonl"])
def test_the_table_title_names_a_trace_with_brackets_whole(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rich read `[v2]` as a style tag and dropped it: `conv[v2].jsonl` was titled `conv.jsonl`."""
    path = tmp_path / name
    path.write_bytes(_LINES)
    assert main(["simulate", str(path), *_ARGS]) == 0
    out = capsys.readouterr().out
    assert f"{name}: 3 requests, 6 blocks" in out, out


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        (b"a$^$.jsonl", "a$^$.jsonl (flat)"),
        (b"x$\\frac$.jsonl", "x$\\frac$.jsonl (flat)"),
        (b"run$1$.jsonl", "run$1$.jsonl (flat)"),
        (b"caf\xe9.jsonl", "caf?.jsonl (flat)"),  # Latin-1, not UTF-8: as the table shows it
    ],
)
def test_the_plot_is_saved_whatever_the_trace_is_named(
    tmp_path: Path,
    name: bytes,
    shown: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """After every replay the save failed with matplotlib's parser or font error (exit 2):
    the name was read as mathtext, or its surrogate escapes reached the font renderer."""
    pytest.importorskip("matplotlib")
    figures = _record_figures(monkeypatch)
    path = Path(os.fsdecode(os.path.join(os.fsencode(tmp_path), name)))
    path.write_bytes(_LINES)
    plot = tmp_path / "curve.png"
    assert main(["simulate", str(path), *_ARGS, "--plot", str(plot)]) == 0, capsys.readouterr()
    assert plot.read_bytes().startswith(b"\x89PNG")
    (ax,) = figures[0].axes
    assert ax.get_title() == shown
    assert not ax.title.get_parse_math()  # `run$1$` drawn as written, not as `run` and math


@pytest.mark.parametrize("plot", [False, True])
def test_two_outputs_hard_linked_to_one_file_are_refused_before_any_replay(
    tmp_path: Path, plot: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--json a.json --csv b.csv` with b.csv a hard link to a.json exited 0, and a.json held
    the CSV: the check compared resolved paths, which differ for hard links."""
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(_LINES)
    first = tmp_path / "a.json"
    first.write_text("kept\n")
    second = tmp_path / ("b.png" if plot else "b.csv")
    os.link(first, second)
    flag = "--plot" if plot else "--csv"
    argv = ["simulate", str(trace), *_ARGS, "--json", str(first), flag, str(second)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--json and {flag} both write to '{second}' (the same file as '{first}')" in err
    assert first.read_text() == "kept\n"


_NOBODY = 65534


def _unprivileged(env: dict[str, str]) -> list[str]:
    """A command prefix that runs as a user who is not root (for whom every path is writable)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("runs as root without setpriv to drop to another user")
    prefix = [setpriv, f"--reuid={_NOBODY}", f"--regid={_NOBODY}", "--clear-groups"]
    # A checkout under a private directory (`mktemp -d` is 0700) is out of that user's reach.
    probe = [*prefix, sys.executable, "-c", "import kvtier.sim.command"]
    if subprocess.run(probe, capture_output=True, env=env, cwd="/", check=False).returncode:
        pytest.skip("the unprivileged user cannot run this checkout's Python and source")
    return prefix


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory the unprivileged user may read and search but not write, holding a trace
    and a results file that this user may write."""
    base = Path(tempfile.mkdtemp())
    shared = base / "shared"
    shared.mkdir()
    (shared / "t.jsonl").write_bytes(_LINES)
    (shared / "r.csv").write_text("old\n")
    (shared / "home").mkdir()
    if os.geteuid() == 0:
        for path in (shared / "r.csv", shared / "home"):
            os.chown(path, _NOBODY, _NOBODY)
        for path in (base, shared):
            path.chmod(0o755)
    else:
        shared.chmod(0o555)
    try:
        yield shared
    finally:
        shared.chmod(0o755)
        shutil.rmtree(base)


@pytest.mark.parametrize("output", ["/dev/null", "r.csv"])
def test_an_existing_writable_output_in_a_directory_not_ours_is_written(
    shared_dir: Path, output: str
) -> None:
    """`--csv /dev/null` (or a results file one may write, in a directory one may not) was
    refused as 'not writable' for every user but root: the check asked for a directory that
    can be written even where no file is created."""
    out = str(shared_dir / output) if output == "r.csv" else output
    src = Path(kvtier.__file__).parents[1]
    home = str(shared_dir / "home")
    env = {**os.environ, "PYTHONPATH": str(src), "HOME": home, "MPLCONFIGDIR": home}
    cmd = [*_unprivileged(env), sys.executable, "-m", "kvtier", "simulate"]
    cmd += [str(shared_dir / "t.jsonl"), *_ARGS, "--csv", out]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=home, check=False)
    assert done.returncode == 0, done.stderr
    if output == "r.csv":
        assert (shared_dir / "r.csv").read_text().startswith("policy,capacity_blocks,")


def test_every_policy_is_named_in_the_plots_legend(
    tmp_path: Path, make_trace: MakeTrace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """matplotlib leaves a label that starts with `_` out of an automatic legend: the line of a
    policy spec such as `_mine:Fifo` (a module of one's own) was drawn with no name."""
    figure = pytest.importorskip("matplotlib.figure")
    ax = figure.Figure().subplots()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not ax.legend(ax.plot([0], [0]), ["_x"]).get_texts():
            pytest.skip("this matplotlib leaves out a label that starts with '_', even given")
    figures = _record_figures(monkeypatch)
    trace = make_trace(3)
    runs = [("lru", 2), ("lru", 5), ("opt", 2), ("infinite", trace.num_unique_blocks)]
    results = run_grid(trace, runs, ReplayOptions())
    results[0].policy = results[1].policy = "_mine:Fifo"  # as rows name a spec: as given
    report.plot_miss_ratio(results, tmp_path / "c.svg", title="t")
    (ax,) = figures[0].axes
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["_mine:Fifo", "opt", "infinite"]
