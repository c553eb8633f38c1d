"""Review fixes: a compressed or UTF-16/32 trace named for what it is, a line that fits no
block size reported as the bad line (not as a disagreement that `--block-tokens` would settle),
a `hash_ids` or `token_ids` that is not a list named by its value, and `--advise` answering the
smallest tier when a device cache in front reaches the target alone."""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.base import make_offload_key
from kvtier.cli import main
from kvtier.sim.advise import advise, reaches
from kvtier.sim.readers import infer_block_tokens, iter_trace, read_trace
from kvtier.sim.runner import ReplayOptions, run_one
from kvtier.sim.shapes import parse_capacity
from kvtier.sim.trace import Request, Trace, TraceFormatError

_ROWS = [
    {"timestamp": 0, "input_length": 10, "hash_ids": [1, 2, 3]},
    {"timestamp": 1, "input_length": 9, "hash_ids": [1, 2, 4]},
]
_TEXT = "".join(json.dumps(r) + "\n" for r in _ROWS)


def _zip(text: str) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("trace.jsonl", text)
    return out.getvalue()


# What a trace is often shipped as instead of UTF-8 JSONL. zstd is not in the standard library
# before 3.14: its frame magic is enough, as the reader reads no further.
_ENCODED: dict[str, tuple[Callable[[str], bytes], str]] = {
    "gzip": (lambda t: gzip.compress(t.encode()), "gzip-compressed"),
    "bzip2": (lambda t: bz2.compress(t.encode()), "bzip2-compressed"),
    "xz": (lambda t: lzma.compress(t.encode()), "xz-compressed"),
    "zstd": (lambda t: b"\x28\xb5\x2f\xfd" + b"\x00\x58\x51\x00\x00\n" + t.encode(), "zstd"),
    "zip": (_zip, "zip archive"),
    "utf-16": (lambda t: t.encode("utf-16"), "UTF-16"),
    "utf-16-be": (lambda t: b"\xfe\xff" + t.encode("utf-16-be"), "UTF-16"),
    "utf-32": (lambda t: t.encode("utf-32"), "UTF-32"),
}


@pytest.mark.parametrize("kind", sorted(_ENCODED))
def test_a_compressed_or_utf16_trace_is_named_for_what_it_is(tmp_path: Path, kind: str) -> None:
    encode, what = _ENCODED[kind]
    path = tmp_path / f"trace.{kind}"
    path.write_bytes(encode(_TEXT))
    for fmt in ("auto", "mooncake", "tokens"):
        with pytest.raises(TraceFormatError) as info:
            read_trace(path, fmt=fmt)
        message = str(info.value)
        # Was "not valid JSON (JSON is malformed: invalid character (byte 0))".
        assert message.startswith(f"{path}:1: not a JSONL trace"), message
        assert what in message
        assert "expected uncompressed UTF-8 JSON Lines" in message


def test_the_command_says_a_gzipped_trace_must_be_decompressed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "trace.jsonl.gz"
    path.write_bytes(gzip.compress(_TEXT.encode()))
    assert main(["simulate", str(path), "--policies", "lru", "-q", "--jobs", "1"]) == 2
    err = capsys.readouterr().err
    assert "trace.jsonl.gz:1: not a JSONL trace: the file is gzip-compressed" in err
    assert "gunzip" in err


def test_only_the_first_bytes_of_a_trace_are_a_signature(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\x1f\x8b\n" + _TEXT.encode())
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:1: not a JSONL trace: the file is gzip"):
        read_trace(path)
    # A later line is JSON or not, as before.
    path.write_bytes(_TEXT.encode() + b"\x1f\x8b\n")
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:3: not valid JSON"):
        read_trace(path)
    path.write_bytes(b"\xef\xbb\xbf" + _TEXT.encode())  # a UTF-8 BOM still reads
    assert len(read_trace(path)) == 2


def test_a_line_that_fits_no_block_size_is_reported_as_the_bad_line(tmp_path: Path) -> None:
    rows = [{"input_length": 1000, "hash_ids": [1, 2]}] * 3
    rows.append({"input_length": 1, "hash_ids": [3, 4]})  # 2 blocks need 2 tokens at least
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # The lines before it still decide the size (500..999 holds 512).
    assert infer_block_tokens(path) == 512
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    message = str(info.value)
    # Was "bad.jsonl:4: no block size fits the input_length and the number of hash_ids of
    # lines 1..4; pass the trace's block size explicitly (--block-tokens)": no size fits line
    # 4 alone, so --block-tokens only leads to this same error.
    assert message.startswith(f"{path}:4: input_length=1 does not fit 2 blocks"), message
    assert "--block-tokens" not in message


def test_a_bad_first_line_does_not_set_the_block_size(tmp_path: Path) -> None:
    rows = [{"input_length": 2, "hash_ids": [1, 2, 3]}, {"input_length": 600, "hash_ids": [1]}]
    path = tmp_path / "first.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(TraceFormatError, match=r"first\.jsonl:1: input_length=2 does not fit 3"):
        list(iter_trace(path))


@pytest.mark.parametrize(
    ("line", "said"),
    [
        (
            '{"input_length": 5, "hash_ids": "1,2"}',
            "field 'hash_ids' must be a list of block ids; got '1,2'",
        ),
        (
            '{"input_length": 5, "hash_ids": null}',
            "field 'hash_ids' must be a list of block ids; got null",
        ),
        (
            '{"input_length": 5, "hash_ids": {"0": 1}}',
            "field 'hash_ids' must be a list of block ids; got {'0': 1}",
        ),
        ('{"input_length": 5}', "field 'hash_ids' must be a list of block ids; it is missing"),
        ('{"token_ids": "1 2 3"}', "field 'token_ids' must be a list of token ids; got '1 2 3'"),
        ('{"token_ids": 7}', "field 'token_ids' must be a list of token ids; got 7"),
    ],
)
def test_a_field_that_is_not_a_list_is_named_by_its_value(
    tmp_path: Path, line: str, said: str
) -> None:
    path = tmp_path / "t.jsonl"
    good = '{"input_length": 5, "hash_ids": [1]}' if "hash_ids" in said else '{"token_ids": [1]}'
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    # Was "field 'hash_ids' must be a list of block ids" alone, whatever the line held.
    assert str(info.value) == f"{path}:3: {said}"


def test_a_long_value_in_place_of_a_list_is_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"input_length": 5, "hash_ids": "1," * 100_000}) + "\n")
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    message = str(info.value)
    assert "got '1,1," in message
    assert message.endswith("...")
    assert len(message) < len(str(path)) + 150


def _conversations(turns: int = 6, users: int = 5, blocks_per_turn: int = 3) -> Trace:
    """Users whose every turn repeats the conversation so far and adds a few blocks."""
    requests = []
    for turn in range(turns):
        for user in range(users):
            ids = [user * 1000 + i for i in range((turn + 1) * blocks_per_turn)]
            keys = [make_offload_key(i.to_bytes(8, "big"), 0) for i in ids]
            requests.append(Request(f"u{user}t{turn}", keys, len(keys) * 4, 4))
    return Trace(requests)


def test_advise_answers_one_block_when_the_device_alone_reaches_the_target() -> None:
    trace = _conversations()
    # A device holding every block serves each one from its second use: no CPU tier needed.
    opts = ReplayOptions(mode="engine", device_blocks=trace.num_unique_blocks)
    infinite = run_one(trace, "infinite", trace.num_unique_blocks, opts).block_hit_ratio
    assert infinite > 0
    resolution = 8
    for policy in ("lru", "opt"):
        answer = advise(trace, policy, 0.95 * infinite, opts, resolution)
        # Was 5 (of 90 unique blocks): the bisection stopped within `resolution` of 0.
        assert answer.capacity_blocks == 1, answer
        assert answer.block_hit_ratio == run_one(trace, policy, 1, opts).block_hit_ratio


def test_advise_still_bisects_when_the_smallest_tier_falls_short() -> None:
    trace = _conversations()
    opts = ReplayOptions(mode="engine", device_blocks=0)
    target = 0.95 * run_one(trace, "infinite", 0, opts).block_hit_ratio
    answer = advise(trace, "opt", target, opts, 1)
    assert answer.capacity_blocks is not None and answer.capacity_blocks > 1
    assert answer.block_hit_ratio is not None and reaches(answer.block_hit_ratio, target)
    below = run_one(trace, "opt", answer.capacity_blocks - 1, opts).block_hit_ratio
    assert not reaches(below, target)
    # With the device that reaches it alone, the same search answers the smallest tier.
    full = ReplayOptions(mode="engine", device_blocks=trace.num_unique_blocks)
    assert advise(trace, "opt", target, full, 4).capacity_blocks == 1


@pytest.mark.parametrize(
    ("block_bytes", "least"),
    [(64 * 2**20, "64 MiB"), (3 * 2**30 // 2, "1.5 GiB"), (2**20 + 1, "1 MiB (1,048,577 bytes)")],
)
def test_a_size_below_one_block_says_how_large_a_block_is(block_bytes: int, least: str) -> None:
    for allow_zero in (False, True):  # a CPU tier, a device cache
        with pytest.raises(ValueError) as info:
            parse_capacity(
                "1KiB", unique_blocks=100, block_bytes=block_bytes, allow_zero=allow_zero
            )
        # Was "capacity '1KiB' is less than one block" alone.
        assert str(info.value) == (
            f"capacity '1KiB' is less than one block; expected at least {least}, the KV cache "
            "of one block of this trace with this model shape"
        )
    # Zero is no size to grow: the message stays as it was, and a device may be empty.
    with pytest.raises(ValueError, match=r"^capacity '0GiB' is less than one block$"):
        parse_capacity("0GiB", unique_blocks=100, block_bytes=block_bytes)
    assert (
        parse_capacity("0GiB", unique_blocks=100, block_bytes=block_bytes, allow_zero=True)[0] == 0
    )


def test_the_command_names_the_block_size_a_device_capacity_falls_short_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(_TEXT)  # 4-token blocks: 4 x 57,344 bytes of Qwen-2.5-7B KV cache
    args = ["simulate", str(path), "--mode", "engine", "--model-shape", "qwen-2.5-7b", "-q"]
    assert main([*args, "--device-capacity", "200KiB", "--jobs", "1"]) == 2
    err = capsys.readouterr().err
    assert "--device-capacity: capacity '200KiB' is less than one block; expected at least " in err
    assert "224 KiB, the KV cache of one block" in err
