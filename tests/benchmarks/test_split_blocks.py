"""benchmarks/split_blocks.py: Mooncake traces rewritten with finer blocks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import split_blocks
from kvtier.sim import read_trace
from split_blocks import split_request, split_trace


def test_blocks_split_and_the_partial_last_block_keeps_only_its_tokens() -> None:
    row = {"timestamp": 3, "input_length": 600, "output_length": 9, "hash_ids": [0, 7]}
    out = split_request(row, 16)
    ids = out["hash_ids"]
    assert isinstance(ids, list)
    # Block 0: 32 sub-blocks; block 7 holds 88 tokens: 6 sub-blocks of 16.
    assert ids == list(range(32)) + [7 * 32 + j for j in range(6)]
    assert {k: v for k, v in out.items() if k != "hash_ids"} == {
        "timestamp": 3,
        "input_length": 600,
        "output_length": 9,
    }


def test_split_trace_keeps_shared_prefixes_and_reads_back_at_the_new_size(
    tmp_path: Path,
) -> None:
    rows = [
        {"input_length": 1100, "hash_ids": [0, 1, 2]},
        {"input_length": 1024, "hash_ids": [0, 1]},
        {"input_length": 5, "hash_ids": [3]},
    ]
    src, dst = tmp_path / "t.jsonl", tmp_path / "t64.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dst.write_text("".join(split_trace(src, 64)))
    trace = read_trace(dst)  # the block size is inferred from the lengths
    assert trace.block_tokens == 64
    first, second, third = trace.requests
    assert [len(r.keys) for r in trace.requests] == [16 + 2, 16, 1]
    assert second.keys == first.keys[:16]  # the shared 1,024-token prefix
    assert third.keys[0] not in set(first.keys)


@pytest.mark.parametrize("tokens", [0, 24, 1024])
def test_block_sizes_that_do_not_divide_512_are_rejected(tokens: int) -> None:
    with pytest.raises(ValueError, match=f"tokens={tokens} is invalid"):
        split_request({"input_length": 5, "hash_ids": [1]}, tokens)


def _main(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["split_blocks.py", *argv])
    split_blocks.main()


@pytest.mark.parametrize("tokens", ["0", "24"])
def test_a_refused_block_size_leaves_the_destination_as_it_was(
    tokens: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dst = tmp_path / "t.jsonl", tmp_path / "t16.jsonl"
    src.write_text(json.dumps({"input_length": 5, "hash_ids": [1]}) + "\n")
    dst.write_text("an earlier split\n")
    with pytest.raises(SystemExit):
        _main([str(src), str(dst), "--tokens", tokens], monkeypatch)
    assert dst.read_text() == "an earlier split\n"


def test_the_source_is_never_its_own_destination(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "t.jsonl"
    src.write_text(json.dumps({"input_length": 5, "hash_ids": [1]}) + "\n")
    before = src.read_text()
    with pytest.raises(SystemExit):
        _main([str(src), str(tmp_path / "." / "t.jsonl")], monkeypatch)
    assert src.read_text() == before


@pytest.mark.parametrize(
    ("length", "ids"),
    [
        (1100, [1, 2]),  # more tokens than 2 blocks of 512 hold: sub-ids of block 3 (96..100)
        (100, [1, 2]),  # the second block holds no token: it was dropped, unlike the reader
        (0, [1]),
        (5, []),
    ],
)
def test_a_row_that_does_not_fit_512_token_blocks_is_refused(length: int, ids: list[int]) -> None:
    with pytest.raises(ValueError, match=f"input_length={length} does not fit {len(ids)} blocks"):
        split_request({"input_length": length, "hash_ids": ids}, 16)


def test_a_trace_split_already_is_refused_and_no_output_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Splitting a 16-token trace again wrote, with exit status 0, a trace no reader accepts.
    src, once, twice = tmp_path / "t.jsonl", tmp_path / "t16.jsonl", tmp_path / "t16x2.jsonl"
    src.write_text(json.dumps({"input_length": 600, "hash_ids": [0, 7]}) + "\n")
    _main([str(src), str(once)], monkeypatch)
    with pytest.raises(SystemExit):
        _main([str(once), str(twice)], monkeypatch)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "t16.jsonl:1: not a Mooncake trace line (input_length=600 does not fit 38" in err
    assert not twice.exists()
