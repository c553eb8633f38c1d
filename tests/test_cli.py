"""The `kvtier` command: simulate (table, JSON, CSV, plot, advise) and policies."""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli import COMMANDS, build_parser, main


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    """A small Mooncake-format trace with shared, growing prefixes."""
    rng = random.Random(0)
    rows, history, next_id = [], [[0]], 1
    for t in range(120):
        ids = list(rng.choice(history))[: rng.randint(1, 6)]
        for _ in range(rng.randint(0, 4)):
            ids.append(next_id)
            next_id += 1
        history.append(ids)
        rows.append({"timestamp": t, "input_length": len(ids) * 512 - 7, "hash_ids": ids})
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _json_rows(capsys: pytest.CaptureFixture[str], *args: str) -> list[dict[str, Any]]:
    """`simulate --json` rows: parsed JSON, a value's type depending on its key."""
    assert main(["simulate", *args, "--json", "-", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    rows: list[dict[str, Any]] = json.loads(out)
    return rows


def test_simulate_json_rows(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = _json_rows(capsys, str(trace), "--policies", "lru,opt", "--capacities", "5%,40")
    lines = trace.read_text().splitlines()
    unique = len({h for line in lines for h in json.loads(line)["hash_ids"]})
    five_percent = round(unique * 5 / 100)  # 226 unique blocks: 11
    assert [(r["policy"], r["capacity_blocks"]) for r in rows][:4] == [
        ("lru", five_percent),
        ("lru", 40),
        ("opt", five_percent),
        ("opt", 40),
    ]
    assert rows[-1]["policy"] == "infinite" and rows[-1]["capacity_frac"] == 1.0
    assert rows[-1]["capacity_blocks"] == unique
    for r in rows:
        assert {"policy", "capacity_blocks", "capacity_frac", "block_hit_ratio"} <= set(r)
        assert {"prefix_hit_ratio", "loads", "stores", "evictions", "stores_skipped"} <= set(r)
    hit = {(r["policy"], r["capacity_blocks"]): r["block_hit_ratio"] for r in rows}
    assert hit[("opt", 40)] >= hit[("lru", 40)]
    assert rows[0]["bytes_loaded"] is None


def test_simulate_table_csv_plot_and_shape(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    csv_path, png = tmp_path / "out.csv", tmp_path / "mrc.png"
    status = main(
        [
            "simulate",
            str(trace),
            "--policies",
            "lru,sieve",
            "--capacities",
            "10%,2GiB",
            "--model-shape",
            "llama-3-8b",
            "--csv",
            str(csv_path),
            "--plot",
            str(png),
            "--mode",
            "engine",
            "--device-capacity",
            "3",
            "--store",
            "on-evict",
            "-q",
        ]
    )
    out = capsys.readouterr()
    assert status == 0
    assert "block hit %" in out.out and "GiB loaded" in out.out and "sieve" in out.out
    assert "opt" not in out.out  # not asked for
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == 5 and rows[1]["capacity_blocks"] == "32"  # 2 GiB / 64 MiB blocks
    assert rows[0]["mode"] == "engine" and rows[0]["store_on"] == "on-evict"
    assert int(rows[0]["bytes_stored"]) == int(rows[0]["stores"]) * 64 * 2**20
    assert png.read_bytes()[:4] == b"\x89PNG"  # matplotlib comes with the setup's [plot]


def test_simulate_infers_a_16_token_block_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Qwen-Bailian-style trace (16-token hash_ids) needs no --block-tokens, and byte
    figures use its block size."""
    rows = [
        {"chat_id": i, "timestamp": i * 0.5, "input_length": 16 * (i % 5) + 9,
         "hash_ids": list(range(i % 5 + 1))}
        for i in range(40)
    ]  # fmt: skip
    path = tmp_path / "qwen_blksz_16.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = _json_rows(
        capsys, str(path), "--policies", "lru", "--capacities", "2", "--model-shape", "llama-3-8b"
    )
    assert {r["block_tokens"] for r in out} == {16}
    assert main(["simulate", str(path), "--policies", "lru", "--capacities", "2", "-q"]) == 0
    assert "blocks of 16 tokens" in capsys.readouterr().out  # the table says what it inferred
    lru = out[0]
    assert lru["bytes_stored"] == lru["stores"] * 16 * 128 * 1024  # 128 KiB per token


def test_plot_without_matplotlib_names_the_extra(
    trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    status = main(
        ["simulate", str(trace), "--policies", "lru", "--plot", str(tmp_path / "x.png"), "-q"]
    )
    assert status == 2
    assert "pip install kvtier[plot]" in capsys.readouterr().err


def test_opt_is_skipped_for_store_on_evict(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--mode", "engine", "--store", "on-evict", "--policies", "lru,opt"]
    assert main(["simulate", str(trace), *args, "--json", "-", "--jobs", "1"]) == 0
    captured = capsys.readouterr()
    assert {r["policy"] for r in json.loads(captured.out)} == {"lru", "infinite"}
    assert "opt skipped" in captured.err


def test_advise(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(trace), "--advise", "--policies", "lru,opt", "-q"]) == 0
    assert "smallest capacity" in capsys.readouterr().out
    assert main(["simulate", str(trace), "--advise", "--policies", "lru", "--json", "-"]) == 0
    (advice,) = json.loads(capsys.readouterr().out)
    assert advice["policy"] == "lru" and advice["block_hit_ratio"] >= advice["target"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policies", "lfu9"], "policy 'lfu9' is unknown"),
        (["--capacities", "ten"], "--capacities: capacity 'ten' is invalid"),
        (
            ["--mode", "engine", "--device-capacity", "0.5"],
            "--device-capacity: capacity '0.5' is invalid",
        ),
        (["--capacities", "8GiB"], "give --model-shape"),
        (["--model-shape", "gpt-9"], "model shape 'gpt-9'"),
        (["--store-threshold", "-1"], "--store-threshold=-1"),
        (["--jobs", "0"], "--jobs=0"),
        (["--max-tracker-size", "0"], "--max-tracker-size='0'"),
        (["--max-tracker-size=0x"], "--max-tracker-size='0x'"),
        (["--store", "on-evict"], "--store applies only to --mode engine"),
        (["--device-capacity", "2%", "--store", "eager"], "--device-capacity and --store apply"),
        (["--capacities", "0"], "capacity '0' is less than one block"),
        (["--capacities", "0%"], "capacity '0%' is less than one block"),
        (
            ["--mode", "engine", "--device-capacity", "1KiB", "--model-shape", "llama-3-8b"],
            "capacity '1KiB' is less than one block",
        ),
        (["--max-tracker-size", "infx"], "--max-tracker-size='infx' is invalid"),
        (["--max-tracker-size", "1e400x"], "--max-tracker-size='1e400x' is invalid"),
        (["--max-tracker-size", "nanx"], "--max-tracker-size='nanx' is invalid"),
        (["--max-tracker-size", "5x"], "--max-tracker-size='5x' has no effect with --store"),
        (
            ["--store-threshold", "1", "--max-tracker-size", "100"],
            "has no effect with --store-threshold=1; expected --store-threshold 2 or more",
        ),
        (
            ["--model-shape", "llama-3-8b", "--capacities", "0.5B"],
            "capacity '0.5B' is not a whole number of bytes",
        ),
        (["--advise", "--plot", "x.png"], "--plot applies only without --advise"),
        (["--advise", "--capacities", "5%"], "--capacities applies only without --advise"),
        (
            ["--advise", "--capacities", "5%", "--plot", "x.png"],
            "--capacities and --plot apply only without --advise",
        ),
    ],
)
def test_simulate_errors(
    trace: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", str(trace), *args, "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier simulate: error: ") and message in err


def test_bad_trace_line_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"input_length": 3, "hash_ids": [1]}\n{"input_length": 3}\n')
    assert main(["simulate", str(path), "-q"]) == 2
    assert "t.jsonl:2: field 'hash_ids'" in capsys.readouterr().err
    assert main(["simulate", str(tmp_path / "none.jsonl"), "-q"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["simulate", str(tmp_path), "-q"]) == 2
    err = capsys.readouterr().err
    assert f"trace {str(tmp_path)!r} is a directory; expected a trace file" in err


def test_policies_lists_cache_and_admission_policies(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.admission import registered_admission_policies
    from kvtier.policies import registered_policies

    assert main(["policies"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = {line.split()[0] for line in lines if line.startswith("  ")}
    assert set(registered_policies()) <= names
    assert set(registered_admission_policies()) <= names
    assert {"opt", "infinite"} <= names


def test_parser_has_one_subparser_per_command() -> None:
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args([])
    assert [cmd.name for cmd in COMMANDS] == ["simulate", "demo", "policies"]
    for cmd in COMMANDS:
        args = parser.parse_args([cmd.name, *(["t.jsonl"] if cmd.name == "simulate" else [])])
        assert args.command == cmd.name and args._run is cmd.run


def test_python_m_kvtier_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvtier", "policies"], capture_output=True, text=True, check=True
    )
    assert "lru" in done.stdout


def test_tracker_size_per_slot(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--policies", "lru", "--capacities", "4", "--store-threshold", "2"]
    tiny = _json_rows(capsys, str(trace), *base, "--max-tracker-size", "1x")
    huge = _json_rows(capsys, str(trace), *base, "--max-tracker-size", "1000")
    # A one-key-per-slot tracker forgets first sightings sooner, so it admits less.
    assert tiny[0]["stores"] < huge[0]["stores"]


@pytest.mark.parametrize("command", [[], *([c.name] for c in COMMANDS)])
def test_help_renders(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    assert info.value.code == 0
    assert "usage: kvtier" in capsys.readouterr().out


@pytest.mark.parametrize("command", [[], *([c.name] for c in COMMANDS)])
def test_help_is_plain_ascii(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A '×' in the help crashed `--help` with UnicodeEncodeError where stdout is ASCII."""
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert out.isascii(), [c for c in out if not c.isascii()]


@pytest.mark.parametrize("command", [[], ["simulate"]])
def test_help_on_an_ascii_stdout(command: list[str]) -> None:
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    done = subprocess.run(
        [sys.executable, "-m", "kvtier", *command, "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: kvtier") and done.stderr == ""


@pytest.mark.parametrize("device", ["0", "0%"])
def test_engine_with_an_empty_device_equals_flat(
    trace: Path, device: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = [str(trace), "--policies", "lru,s3fifo,opt", "--capacities", "5%,12", "--hits", "touch"]
    flat = _json_rows(capsys, *base)
    engine = _json_rows(capsys, *base, "--mode", "engine", "--device-capacity", device)
    fields = ("policy", "capacity_blocks", "block_hit_ratio", "prefix_hit_ratio", "stores")
    assert [[r[f] for f in fields] for r in engine] == [[r[f] for f in fields] for r in flat]
    assert {r["device_blocks"] for r in engine} == {0}


def test_capacities_beyond_the_trace_report_what_was_asked(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    huge = ["100000000000000000000", "1000000000000"]
    rows = _json_rows(capsys, str(trace), "--policies", "lru,opt", "--capacities", ",".join(huge))
    infinite = rows[-1]
    assert [r["capacity_blocks"] for r in rows[:-1]] == [10**20, 10**12] * 2
    for r in rows[:-1]:
        assert r["block_hit_ratio"] == infinite["block_hit_ratio"] and r["evictions"] == 0
        assert r["capacity_frac"] == r["capacity_blocks"] / infinite["capacity_blocks"]


def test_advise_skips_the_capacities_and_writes_csv(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        {"input_length": 512 * (i % 3 + 1), "hash_ids": list(range(i % 3 + 1))} for i in range(9)
    ]
    path = tmp_path / "tiny.jsonl"  # 3 unique blocks: 1% of them is less than one
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "advice.csv"
    assert main(["simulate", str(path), "--advise", "--policies", "lru", "--csv", str(out)]) == 0
    assert "smallest capacity" in capsys.readouterr().out
    (advice,) = csv.DictReader(out.open())
    assert advice["policy"] == "lru" and int(advice["capacity_blocks"]) >= 1
    assert main(["simulate", str(path), "--advise", "--policies", "lru", "--csv", "-"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("policy,target,capacity_blocks")


@pytest.mark.parametrize(
    ("flag", "name", "message"),
    [
        ("--plot", "{tmp}/mrc", "--plot='{tmp}/mrc' is invalid; expected a file name ending in"),
        ("--plot", "{tmp}/mrc.txt", "expected a file name ending in one of: "),
        ("--plot", "{tmp}", "--plot='{tmp}' is invalid; it is a directory"),
        ("--json", "{tmp}", "--json='{tmp}' is invalid; it is a directory"),
        ("--plot", "{tmp}/no/x.png", "--plot='{tmp}/no/x.png' is invalid; '{tmp}/no' does not"),
        ("--json", "{tmp}/no/x.json", "--json='{tmp}/no/x.json' is invalid; '{tmp}/no' does not"),
        ("--csv", "{tmp}/no/x.csv", "--csv='{tmp}/no/x.csv' is invalid; '{tmp}/no' does not"),
        ("--csv", "{trace}/x.csv", "--csv='{trace}/x.csv' is invalid; '{trace}' is not a dir"),
    ],
)
def test_bad_outputs_are_rejected_before_any_replay(
    trace: Path,
    tmp_path: Path,
    flag: str,
    name: str,
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("matplotlib")
    from kvtier.sim import command

    def no_replay(*args: object, **kwargs: object) -> None:
        raise AssertionError("the trace was read before the outputs were checked")

    monkeypatch.setattr(command, "read_trace", no_replay)
    fill = {"tmp": str(tmp_path), "trace": str(trace)}
    assert main(["simulate", str(trace), flag, name.format(**fill), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier simulate: error: ") and message.format(**fill) in err


def test_plot_writes_exactly_the_path_given(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    svg = tmp_path / "curve.SVG"
    assert main(["simulate", str(trace), "--policies", "lru", "--plot", str(svg), "-q"]) == 0
    assert "block hit %" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir() if p.name != trace.name] == ["curve.SVG"]
    assert b"<svg" in svg.read_bytes()[:1000]


def test_a_failing_replay_is_one_line(
    trace: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.policies.base import _REGISTRY
    from kvtier.policies.lru import LRUPolicy

    class Boom(LRUPolicy):
        def insert(self, keys: object, ctx: object) -> None:
            raise KeyError("kaboom")

    monkeypatch.setitem(_REGISTRY, "boom", Boom)
    for jobs in ("1", "2"):
        args = ["simulate", str(trace), "--policies", "lru,boom", "--capacities", "5", "-q"]
        assert main([*args, "--jobs", jobs]) == 1
        err = capsys.readouterr().err
        assert err == "kvtier simulate: error: policy 'boom' at capacity 5 blocks failed: " + (
            "KeyError: 'kaboom'\n"
        )


@pytest.mark.parametrize("argv", [[], ["bogus"]])
def test_no_or_an_unknown_command_prints_usage(argv: list[str]) -> None:
    for entry in (
        ["-m", "kvtier"],
        ["-c", "from kvtier.cli import main; raise SystemExit(main())"],
    ):
        done = subprocess.run([sys.executable, *entry, *argv], capture_output=True, text=True)
        assert done.returncode == 2 and done.stderr.startswith("usage: kvtier ")
