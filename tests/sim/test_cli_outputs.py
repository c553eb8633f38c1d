"""`kvtier simulate`: two outputs sent to one place, the same capacity twice, --advise with
nothing to size, and a reader of stdout that goes away (`| head`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import kvtier_with_reader_gone
from kvtier.cli import main


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    rows = [{"input_length": 1000, "hash_ids": [0, i]} for i in range(1, 40)]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        (["--json", "-", "--csv", "-"], "--json and --csv both write to stdout"),
        (["--json", "{tmp}/r.out", "--csv", "{tmp}/r.out"], "--json and --csv both write to"),
        (["--json", "{tmp}/r", "--csv", "{tmp}/./x/../r"], "--json and --csv both write to"),
        (["--json", "{tmp}/c.png", "--plot", "{tmp}/c.png"], "--json and --plot both write to"),
        (["--csv", "{tmp}/r.svg", "--plot", "{tmp}/r.svg"], "--csv and --plot both write to"),
    ],
)
def test_two_outputs_to_one_place_are_refused_before_any_replay(
    trace: Path,
    tmp_path: Path,
    outputs: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """JSON followed by CSV on stdout is neither; a second file written over the first loses
    it. Both ran to the end and exited 0."""
    from kvtier.sim import command

    if "--plot" in outputs:
        pytest.importorskip("matplotlib")
    (tmp_path / "x").mkdir()

    def no_replay(*args: object, **kwargs: object) -> None:
        raise AssertionError("the trace was read before the outputs were checked")

    monkeypatch.setattr(command, "read_trace", no_replay)
    args = [a.format(tmp=tmp_path) for a in outputs]
    for extra in ([], ["--advise"]):
        if "--plot" in outputs and extra:
            continue  # --plot is refused with --advise anyway
        assert main(["simulate", str(trace), *args, *extra, "-q", "--jobs", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvtier simulate: error: ") and message in err
    assert not (tmp_path / "r.out").exists()


def test_distinct_outputs_are_all_written(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = ["--json", str(tmp_path / "r.json"), "--csv", "-"]
    assert main(["simulate", str(trace), "--policies", "lru", "-q", "--jobs", "1", *out]) == 0
    assert capsys.readouterr().out.startswith("policy,capacity_blocks,")
    assert json.loads((tmp_path / "r.json").read_text())[0]["policy"] == "lru"


def test_one_capacity_given_twice_is_one_row(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """5% of the trace's 40 unique blocks is 2 blocks: `5%,2,5%` replayed and printed it
    three times."""
    args = ["simulate", str(trace), "--policies", "lru", "--capacities", "5%,2,5%,4", "-q"]
    assert main([*args, "--jobs", "1", "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["policy"], r["capacity_blocks"]) for r in rows] == [
        ("lru", 2),
        ("lru", 4),
        ("infinite", 40),
    ]


def test_advise_with_only_the_infinite_cache_is_refused(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It printed an empty table and exited 0."""
    assert main(["simulate", str(trace), "--advise", "--policies", "infinite", "-q"]) == 2
    err = capsys.readouterr().err
    assert "--advise needs a policy to size; --policies='infinite' names only" in err


@pytest.mark.parametrize(
    "args",
    [["simulate", "{trace}", "--csv", "-"], ["simulate", "{trace}", "--json", "-"], ["policies"]],
)
def test_a_reader_that_goes_away_ends_the_command_quietly(trace: Path, args: list[str]) -> None:
    """`kvtier simulate T --csv - | head -1` printed 'error: [Errno 32] Broken pipe' and
    exited 2, the status of a bad argument. Now it ends as the table does (rich's own
    handling): no message, status 1."""
    argv = [a.format(trace=trace) for a in args]
    for extra in ([], ["--jobs", "1"]) if argv[0] == "simulate" else ([],):
        assert kvtier_with_reader_gone([*argv, *extra]) == (141, "")


def test_the_plot_is_titled_with_the_whole_trace_name(
    tmp_path: Path, trace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The title was cut at the first ':' of the table's title, so `run:1.jsonl` became `run`."""
    import kvtier.sim.command as command

    named = tmp_path / "run:1.jsonl"
    named.write_text(trace.read_text())
    titles: list[str] = []
    monkeypatch.setattr(command, "plot_miss_ratio", lambda rows, path, title: titles.append(title))
    args = ["simulate", str(named), "--policies", "lru", "-q", "--plot", str(tmp_path / "c.png")]
    assert main([*args, "--jobs", "1"]) == 0
    assert titles == ["run:1.jsonl (flat)"]
