"""Trace readers: Mooncake and token prompts, streaming, and errors with line numbers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.hashing import BlockHasher
from kvtier.sim.readers import (
    detect_format,
    infer_block_tokens,
    iter_trace,
    read_mooncake,
    read_token_prompts,
    read_trace,
)
from kvtier.sim.trace import Request, Trace, TraceFormatError

from .conftest import key

WriteTrace = Callable[[Path, list[dict[str, object]]], Path]
MOONCAKE_FILE = (
    Path(__file__).parents[2] / "data/traces/mooncake_conversation/conversation_trace.jsonl"
)


def test_mooncake_rows_become_requests(tmp_path: Path, trace_file: WriteTrace) -> None:
    path = trace_file(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]},
            {"timestamp": 7, "input_length": 512, "output_length": 3, "hash_ids": [0]},
        ],
    )
    reqs = list(read_mooncake(path))
    assert [r.keys for r in reqs] == [[key(0), key(1)], [key(0)]]
    assert reqs[0].keys[0] is reqs[1].keys[0]  # interned
    assert (reqs[0].input_length, reqs[0].output_length, reqs[1].timestamp) == (600, 5, 7)
    assert reqs[0].ctx.key_positions == {key(0): 512, key(1): 600}
    assert detect_format(path) == "mooncake"
    trace = read_trace(path)
    assert (trace.num_blocks, trace.num_unique_blocks, trace.num_tokens) == (3, 2, 1112)
    assert trace.block_tokens == 512


def test_reader_streams(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    good = json.dumps({"input_length": 1, "hash_ids": [0]})
    path.write_text(good + "\n" + "not json\n")
    it = iter_trace(path)
    assert next(it).keys == [key(0)]  # the bad second line is not read yet
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:2: not valid JSON"):
        next(it)


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_a_line_nested_too_deeply_names_its_line(tmp_path: Path, depth: int) -> None:
    """Valid JSON, but 1,000 levels deep: a RecursionError without a line number."""
    path = tmp_path / "t.jsonl"
    good = json.dumps({"input_length": 5, "hash_ids": [1]})
    deep = '{"input_length": 5, "hash_ids": [2], "meta": ' + "[" * depth + "]" * depth + "}"
    path.write_text(f"{good}\n{good}\n{deep}\n")
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:3: not valid JSON \(nested too deeply"):
        read_trace(path, block_tokens=512)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[1, 2]", "expected a JSON object"),
        ('{"input_length": 5}', "'hash_ids' must be a list"),
        ('{"hash_ids": [0]}', "missing field 'input_length'"),
        ('{"input_length": -1, "hash_ids": []}', "input_length=-1"),
        ('{"input_length": 5.5, "hash_ids": [0]}', "input_length=5.5"),
        ('{"input_length": 513, "hash_ids": [0]}', "does not fit 1 block"),
        ('{"input_length": 512, "hash_ids": [0, 1]}', "does not fit 2 blocks"),
        ('{"input_length": 5, "hash_ids": [-1]}', "hash id -1"),
        ('{"input_length": 5, "hash_ids": ["a"]}', "hash id 'a'"),
        ('{"input_length": 5, "hash_ids": [true]}', "hash id True"),
        ('{"input_length": 5, "hash_ids": [18446744073709551616]}', "hash id"),
        ('{"input_length": 5, "hash_ids": [0], "output_length": "x"}', "output_length='x'"),
        ('{"input_length": 5, "hash_ids": [0], "timestamp": -3}', "timestamp=-3"),
        ('{"input_length": 1536, "hash_ids": [7, 8, 7]}', "hash id 7 repeats (positions 0 and 2)"),
        ('{"input_length": 1024, "hash_ids": [9, 9]}', "hash id 9 repeats (positions 0 and 1)"),
    ],
)
def test_mooncake_rejects_bad_lines_with_line_number(
    tmp_path: Path, line: str, message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_length": 1, "hash_ids": [9]}\n\n' + line + "\n")
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:3: ") as info:
        list(read_mooncake(path))
    assert message in str(info.value)


def _bailian_rows() -> list[dict[str, object]]:
    """Lines in the Qwen-Bailian trace layout: 16-token blocks, seconds, chat fields."""
    return [
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 10,
         "output_length": 3, "type": "text", "turn": 1, "hash_ids": [7]},
        {"chat_id": 2, "parent_chat_id": 1, "timestamp": 61.114, "input_length": 521,
         "output_length": 132, "type": "text", "turn": 2, "hash_ids": list(range(7, 40))},
    ]  # fmt: skip


def test_block_size_is_inferred_from_the_lengths(tmp_path: Path, trace_file: WriteTrace) -> None:
    path = trace_file(tmp_path / "bailian.jsonl", _bailian_rows())
    assert infer_block_tokens(path) == 16  # line 2 allows only 16: 32 * 16 < 521 <= 33 * 16
    trace = read_trace(path)
    assert trace.block_tokens == 16 and trace.num_blocks == 34
    assert trace.requests[1].timestamp == 61.114
    with pytest.raises(TraceFormatError, match=r"bailian\.jsonl:2: input_length=521 does not fit"):
        read_trace(path, block_tokens=512)  # an explicit size is checked, not overridden
    # The published traces' size wins whenever the lines allow it.
    assert infer_block_tokens(MOONCAKE_FILE) == 512
    short = trace_file(tmp_path / "short.jsonl", [{"input_length": 300, "hash_ids": [1]}])
    assert infer_block_tokens(short) == 512
    # Otherwise the smallest power of two the lines allow, else the smallest size.
    pow2 = trace_file(tmp_path / "pow2.jsonl", [{"input_length": 100, "hash_ids": [1, 2]}])
    assert infer_block_tokens(pow2) == 64  # 50..99
    odd = trace_file(tmp_path / "odd.jsonl", [{"input_length": 41, "hash_ids": [1, 2, 3, 4]}])
    assert infer_block_tokens(odd) == 11  # 11..13


def test_lines_that_agree_on_no_block_size_are_rejected(
    tmp_path: Path, trace_file: WriteTrace
) -> None:
    rows: list[dict[str, object]] = [
        {"input_length": 1000, "hash_ids": [1, 2]},  # 500..999
        {"input_length": 3, "hash_ids": [1]},
        {"input_length": 100, "hash_ids": [1, 2]},  # 50..99
    ]
    path = trace_file(tmp_path / "mixed.jsonl", rows)
    with pytest.raises(TraceFormatError, match=r"mixed\.jsonl:3: no block size fits") as info:
        iter_trace(path)
    assert "--block-tokens" in str(info.value)


def test_token_prompts_hash_full_blocks(tmp_path: Path, trace_file: WriteTrace) -> None:
    path = trace_file(
        tmp_path / "p.jsonl",
        [
            {"token_ids": list(range(10)), "conversation_id": "c1"},
            {"token_ids": [*range(8), 99, 98], "conversation_id": 7, "output_length": 2},
            {"token_ids": [1, 2]},
        ],
    )
    assert detect_format(path) == "tokens"
    reqs = list(iter_trace(path, block_tokens=4))
    hasher = BlockHasher(4)
    expected = [h + b"\0\0\0\0" for h in hasher.hash_blocks(list(range(10)))]
    assert reqs[0].keys == expected and len(expected) == 2  # the partial block has no key
    assert reqs[1].keys == reqs[0].keys  # same first 8 tokens, same chained keys
    assert reqs[2].keys == [] and reqs[2].input_length == 2
    assert (reqs[0].conversation_id, reqs[1].conversation_id) == ("c1", "7")
    assert reqs[0].req_id.startswith("c1/") and reqs[1].output_length == 2
    other = list(read_token_prompts(path, block_tokens=4, namespace="model-b"))
    assert other[0].keys != reqs[0].keys


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"token_ids": "abc"}', "'token_ids' must be a list"),
        ('{"token_ids": [1, -2]}', "bad token_ids"),
        ('{"token_ids": [4294967296]}', "bad token_ids"),
        ('{"token_ids": [1.5]}', "bad token_ids"),
        ('{"token_ids": [1, 2, true]}', "token id True at index 2 is not an integer"),
        ('{"token_ids": [false, 3]}', "token id False at index 0 is not an integer"),
        ('{"token_ids": [true]}', "token id True at index 0 is not an integer"),
        ('{"token_ids": [1, null]}', "token id None at index 1 is not an integer"),
        ('{"token_ids": [1], "conversation_id": [1]}', "conversation_id=[1]"),
    ],
)
def test_token_prompts_reject_bad_lines(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:1: ") as info:
        list(read_token_prompts(path))
    assert message in str(info.value)


def test_format_detection_and_arguments(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TraceFormatError, match="empty"):
        detect_format(empty)
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"prompt": "hi"}\n')
    with pytest.raises(TraceFormatError, match=r"odd\.jsonl:1: unknown trace format"):
        iter_trace(odd)
    with pytest.raises(ValueError, match="trace format 'csv'"):
        iter_trace(odd, fmt="csv")
    with pytest.raises(ValueError, match="block_tokens=0"):
        iter_trace(odd, block_tokens=0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        iter_trace(tmp_path / "missing.jsonl")
    with pytest.raises(IsADirectoryError, match="is a directory; expected a trace file"):
        iter_trace(tmp_path)


def test_trace_rejects_mixed_block_sizes() -> None:
    with pytest.raises(ValueError, match="one block size"):
        Trace([Request("a", [key(0)], 4, 4), Request("b", [key(0)], 4, 8)])


@pytest.mark.skipif(not MOONCAKE_FILE.exists(), reason="Mooncake trace not in the checkout")
def test_mooncake_conversation_trace_statistics() -> None:
    trace = read_trace(MOONCAKE_FILE)
    assert (len(trace), trace.num_blocks, trace.num_unique_blocks) == (12_031, 288_500, 182_790)


def test_hash_settings_are_refused_for_a_mooncake_trace(tmp_path: Path) -> None:
    """Its hash_ids are block ids already: --hash and --namespace were silently ignored, and a
    bogus --hash passed."""
    path = tmp_path / "m.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}\n'
    )
    for kwargs in ({"algorithm": "xxh3_128"}, {"namespace": "llama"}):
        with pytest.raises(ValueError, match=r"apply to token-prompt traces.*Mooncake format"):
            read_trace(path, **kwargs)
    with pytest.raises(ValueError, match="unknown hash algorithm 'bogus'"):
        read_trace(path, algorithm="bogus")
    assert read_trace(path).num_blocks == 2
