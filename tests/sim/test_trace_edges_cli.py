"""Trace files that start with a UTF-8 byte-order mark, and model shapes with non-ASCII
digits: read, or refused in one line that names the value and what was expected."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.sim.readers import detect_format, infer_block_tokens, read_trace
from kvtier.sim.shapes import parse_model_shape

BOM = b"\xef\xbb\xbf"
LINES = [
    b'{"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2]}\n',
    b'{"timestamp": 1, "input_length": 1000, "hash_ids": [1, 3]}\n',
]


@pytest.mark.parametrize("fmt", ["auto", "mooncake"])
def test_a_trace_that_starts_with_a_bom_reads_as_without_one(tmp_path: Path, fmt: str) -> None:
    plain, marked = tmp_path / "plain.jsonl", tmp_path / "bom.jsonl"
    plain.write_bytes(b"".join(LINES))
    marked.write_bytes(BOM + b"".join(LINES))
    assert detect_format(marked) == "mooncake"
    assert infer_block_tokens(marked) == infer_block_tokens(plain) == 512
    a, b = read_trace(plain, fmt=fmt), read_trace(marked, fmt=fmt)
    assert [r.keys for r in a.requests] == [r.keys for r in b.requests]
    assert [r.input_length for r in b.requests] == [1024, 1000]


def test_a_token_trace_with_a_bom_reads(tmp_path: Path) -> None:
    path = tmp_path / "tok.jsonl"
    path.write_bytes(BOM + b'{"token_ids": [' + b", ".join(b"%d" % i for i in range(32)) + b"]}\n")
    trace = read_trace(path)
    assert trace.num_blocks == 2


def test_a_bom_after_the_first_line_is_still_an_error(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(LINES[0] + BOM + LINES[1])
    with pytest.raises(ValueError, match=r"t\.jsonl:2: not valid JSON"):
        read_trace(path)


@pytest.mark.parametrize("spec", ["²,8,128", "32,①,128", "32,8,128³"])
def test_a_model_shape_with_non_ascii_digits_is_one_clear_error(
    spec: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="LAYERS,KV_HEADS,HEAD_DIM"):
        parse_model_shape(spec)
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(b"".join(LINES))
    assert main(["simulate", str(trace), "-q", "--jobs", "1", "--model-shape", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"model shape {spec!r} is unknown" in err, err


def test_a_model_shape_in_other_decimal_digits_reads_as_ascii() -> None:
    # int() reads any Unicode decimal digit, as the capacities' parser does.
    assert parse_model_shape("32,8,１２８").block_bytes(16) == parse_model_shape(
        "32,8,128"
    ).block_bytes(16)


def _trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"".join(LINES))
    return path


@pytest.mark.parametrize("flag", ["--json", "--csv"])
@pytest.mark.parametrize("via", ["itself", "symlink", "hard link"])
def test_an_output_that_is_the_trace_is_refused_and_the_trace_kept(
    flag: str, via: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _trace(tmp_path)
    out = trace
    if via == "symlink":
        out = tmp_path / "link.jsonl"
        out.symlink_to(trace)
    elif via == "hard link":
        out = tmp_path / "hard.jsonl"
        out.hardlink_to(trace)
    argv = ["simulate", str(trace), "-q", "--jobs", "1", "--policies", "lru", flag, str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"kvtier simulate: error: {flag}={str(out)!r} is the trace being read; " + (
        "expected another file for the results"
    )
    assert trace.read_bytes() == b"".join(LINES)


def test_advise_with_only_opt_under_on_evict_stores_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """opt is skipped with --store on-evict: the search had nothing to size, printed an empty
    table (`[]` with --json) and exited 0."""
    trace = _trace(tmp_path)
    argv = ["simulate", str(trace), "-q", "--jobs", "1", "--advise", "--mode", "engine",
            "--store", "on-evict", "--policies", "opt,infinite", "--json", "-"]  # fmt: skip
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert err.count("\n") == 0 and "names only opt, which --store on-evict skips" in err, err


def test_advise_with_opt_and_a_policy_under_on_evict_sizes_the_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    trace = _trace(tmp_path)
    argv = ["simulate", str(trace), "-q", "--jobs", "1", "--advise", "--mode", "engine",
            "--store", "on-evict", "--policies", "opt,lru", "--json", "-"]  # fmt: skip
    assert main(argv) == 0
    assert [a["policy"] for a in json.loads(capsys.readouterr().out)] == ["lru"]
