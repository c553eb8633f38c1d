"""Follow-ups of a review of the trace readers, `Request` and `Trace`: a CSV named as one, a
directory and bad reader arguments refused when a reader is called, one answer for an empty
file whatever the format, text policy names in rows, hand-built requests checked, and a
streamed replay held to one block size."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.base import OffloadKey, make_offload_key
from kvtier.cli import main
from kvtier.policies import LRUPolicy
from kvtier.sim.readers import (
    FORMATS,
    detect_format,
    infer_block_tokens,
    iter_trace,
    read_mooncake,
    read_token_prompts,
    read_trace,
)
from kvtier.sim.replay import make_manager, replay_engine, replay_flat
from kvtier.sim.report import write_csv, write_json
from kvtier.sim.runner import ReplayError, ReplayOptions, run_grid
from kvtier.sim.trace import Request, Trace, TraceFormatError

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


def _key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


# 1. A CSV file is named as one.


@pytest.fixture
def azure_csv(tmp_path: Path) -> Path:
    """The start of an Azure LLM inference trace (token counts only)."""
    path = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    path.write_text(
        f"{AZURE_HEADER}\n2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n"
    )
    return path


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_token_count_csv_is_named_as_one(azure_csv: Path, fmt: str) -> None:
    """It said "not valid JSON (JSON is malformed: invalid character (byte 0))"."""
    with pytest.raises(TraceFormatError) as info:
        list(iter_trace(azure_csv, fmt=fmt))
    assert str(info.value) == (
        f"{azure_csv}:1: not a JSONL trace: the file is CSV with the header '{AZURE_HEADER}', "
        "which has no prefix or block ids (no hash_ids or token_ids column), so it cannot be "
        "replayed for hit ratios; expected Mooncake JSONL ('hash_ids') or token-id JSONL "
        "('token_ids')"
    )


def test_the_cli_names_a_csv_trace(azure_csv: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(azure_csv), "-q"]) == 2
    err = capsys.readouterr().err
    assert f"the file is CSV with the header '{AZURE_HEADER}'" in err
    assert "cannot be replayed for hit ratios" in err and "byte 0" not in err


@pytest.mark.parametrize(
    ("header", "kind", "says"),
    [
        ("a,b,c", "CSV", "no prefix or block ids"),
        ('"time","prompt tokens"', "CSV", "no prefix or block ids"),
        ("\ufefftimestamp,input_length", "CSV", "no prefix or block ids"),  # Excel's BOM
        ("timestamp\tinput_length\toutput_length", "tab-separated", "no prefix or block ids"),
        ("timestamp,input_length,hash_ids", "CSV", "convert each row to a JSON object"),
        ("Token_IDs,conversation", "CSV", "convert each row to a JSON object"),
    ],
)
def test_any_csv_header_is_named(tmp_path: Path, header: str, kind: str, says: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text(f"{header}\n1,2,3\n", encoding="utf-8")
    with pytest.raises(TraceFormatError, match=f":1: not a JSONL trace: the file is {kind} with"):
        list(read_mooncake(path))
    with pytest.raises(TraceFormatError, match=says):
        list(read_mooncake(path))
    # After blank lines, the header's own line is named.
    path.write_text(f"\n \n{header.lstrip(chr(0xFEFF))}\n1,2,3\n", encoding="utf-8")
    with pytest.raises(TraceFormatError, match=f":3: not a JSONL trace: the file is {kind} with"):
        list(read_mooncake(path))


def test_only_a_first_line_of_column_names_is_called_csv(tmp_path: Path) -> None:
    """JSON cut short, a data row of numbers, a line after a record: still "not valid JSON"."""
    path = tmp_path / "t.csv"
    path.write_text("id,text\n")
    with pytest.raises(TraceFormatError, match=r":1: not a JSONL trace: the file is CSV with"):
        list(read_mooncake(path))
    for line in (
        '{"hash_ids": [1, 2], "input_length": 3',
        "1,2,3",
        "2023-11-16 18:15:46.68,374,44",
        "[1], [3]",
        "hi",
    ):
        path.write_text(line + "\n")
        with pytest.raises(TraceFormatError, match=r":1: not valid JSON \("):
            list(read_mooncake(path))
    path.write_text('{"input_length": 3, "hash_ids": [1]}\na,b\n')
    with pytest.raises(TraceFormatError, match=r":2: not valid JSON \("):
        list(read_mooncake(path))


# 2. A directory is refused, by the Python readers too, when they are called.


@pytest.mark.parametrize(
    "call",
    [read_mooncake, read_token_prompts, infer_block_tokens, detect_format],
    ids=lambda f: f.__name__,
)
def test_a_directory_is_refused_when_a_reader_is_called(
    tmp_path: Path, call: Callable[[Path], object]
) -> None:
    """They said "[Errno 21] Is a directory", and the streaming ones only at the first line."""
    with pytest.raises(IsADirectoryError) as info:
        call(tmp_path)  # not iterated: refused by the call itself
    assert str(info.value) == f"trace {str(tmp_path)!r} is a directory; expected a trace file"


@pytest.mark.parametrize("call", [read_mooncake, read_token_prompts], ids=lambda f: f.__name__)
def test_a_missing_file_is_refused_when_a_reader_is_called(
    tmp_path: Path, call: Callable[[Path], object]
) -> None:
    missing = tmp_path / "none.jsonl"
    with pytest.raises(FileNotFoundError, match=r"trace file .*none\.jsonl' does not exist"):
        call(missing)


# 3. Bad reader arguments are refused when the reader is called, even for an empty file.


@pytest.fixture
def empty(tmp_path: Path) -> Path:
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    return path


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda p: read_mooncake(p, group_idx=-1), ValueError, r"group_idx=-1 is out of range"),
        (lambda p: read_mooncake(p, group_idx=True), TypeError, r"group_idx=True has type bool"),
        (lambda p: read_token_prompts(p, group_idx=2**32), ValueError, r"group_idx=4294967296"),
        (
            lambda p: read_token_prompts(p, block_tokens=0),
            ValueError,
            r"^block_tokens=0 is invalid; expected an integer >= 1$",
        ),
        (lambda p: read_token_prompts(p, algorithm="md5"), ValueError, r"hash algorithm 'md5'"),
        (
            lambda p: read_token_prompts(p, namespace=7),  # type: ignore[arg-type]
            TypeError,
            r"namespace 7 has type int",
        ),
        (lambda p: infer_block_tokens(p, max_lines=0), ValueError, r"^max_lines=0 is invalid"),
    ],
)
def test_bad_reader_arguments_are_refused_at_the_call(
    empty: Path, call: Callable[[Path], object], error: type[Exception], message: str
) -> None:
    """They failed at the first line, inside the generator, or (empty file) never."""
    with pytest.raises(error, match=message):
        call(empty)


def test_infer_block_tokens_reads_at_least_a_line(tmp_path: Path) -> None:
    """max_lines=-1 read no line and answered 512 for a 16-token trace."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"input_length": 40, "hash_ids": [1, 2, 3]}\n')
    assert infer_block_tokens(path, max_lines=1) == 16
    with pytest.raises(ValueError, match=r"max_lines=-1 is invalid; expected an integer >= 1"):
        infer_block_tokens(path, max_lines=-1)


# 4. An empty file is no trace, whatever the format.


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("text", ["", "\n  \n\n"])
def test_an_empty_file_is_refused_whatever_the_format(tmp_path: Path, fmt: str, text: str) -> None:
    """ "auto" said the trace is empty; "mooncake" and "tokens" gave an empty Trace."""
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    expected = f"{path}: the trace is empty; expected one JSON object per line, one per request"
    with pytest.raises(TraceFormatError) as info:
        read_trace(path, fmt=fmt)
    assert str(info.value) == expected
    with pytest.raises(TraceFormatError):
        iter_trace(path, fmt=fmt)  # at the call, as detection does
    # A bad first record is the reader's to report, as that line.
    path.write_text(text + "[1]\n")
    with pytest.raises(TraceFormatError, match=r":\d: expected a JSON object, got list"):
        read_trace(path, fmt=fmt)


def test_the_cli_says_an_empty_trace_is_empty_with_a_format(
    empty: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", str(empty), "--format", "mooncake", "-q"]) == 2
    assert f"{empty}: the trace is empty" in capsys.readouterr().err


# 5. Rows name a policy given as a class by text.


class Fifo(LRUPolicy):
    """An unregistered subclass of a registered policy: it inherits the name "lru"."""

    def touch(self, keys: Any, ctx: Any) -> None:
        pass


@pytest.fixture
def small_trace() -> Trace:
    keys = [_key(i) for i in range(6)]
    return Trace(
        [Request(f"r{n}", keys[n % 3 : n % 3 + 3], 12, 4) for n in range(12)], name="small"
    )


def test_rows_name_a_policy_class_as_text(small_trace: Trace) -> None:
    """The row held the class, which `write_json` could not write."""
    rows = run_grid(small_trace, [(LRUPolicy, 2), (Fifo, 2), ("lru", 2)], ReplayOptions())
    fifo = f"{__name__}:Fifo"
    assert [r.policy for r in rows] == ["lru", fifo, "lru"]
    out = io.StringIO()
    write_json(rows, out, None)
    assert [row["policy"] for row in json.loads(out.getvalue())] == ["lru", fifo, "lru"]
    out = io.StringIO()
    write_csv(rows, out, None)
    assert f"\n{fifo}," in out.getvalue()


def test_a_failed_run_names_a_policy_class_as_text(small_trace: Trace) -> None:
    with pytest.raises(ValueError, match=rf"capacity=0 for policy '{__name__}:Fifo' is invalid"):
        run_grid(small_trace, [(Fifo, 0)], ReplayOptions())


class _Broken(LRUPolicy):
    def touch(self, keys: Any, ctx: Any) -> None:
        raise RuntimeError("broken")


def test_a_replay_error_names_a_policy_class_as_text(small_trace: Trace) -> None:
    with pytest.raises(ReplayError, match=rf"^policy '{__name__}:_Broken' at capacity 2 blocks"):
        run_grid(small_trace, [(_Broken, 2)], ReplayOptions())


# 6. A request built by hand is checked.


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        (("a", [b"k"], 4, 0), {}, ValueError, "request 'a': block_tokens=0 is invalid"),
        (("a", [b"k"], 4, 4.0), {}, ValueError, "request 'a': block_tokens=4.0 is invalid"),
        (("a", [b"k"], -1, 4), {}, ValueError, "request 'a': input_length=-1 is invalid"),
        (("a", [b"k"], True, 4), {}, ValueError, "request 'a': input_length=True is invalid"),
        (("a", [], 0, 4), {"output_length": -2}, ValueError, "output_length=-2 is invalid"),
        ((1, [b"k"], 4, 4), {}, TypeError, "req_id=1 has type int; expected a str"),
        (("a", (b"k",), 4, 4), {}, TypeError, r"keys=\(b'k',\) has type tuple; expected a list"),
        (("a", ["k"], 4, 4), {}, TypeError, r"keys\[0\]='k' has type str; expected an Offl"),
        (("a", [b"k", b"l"], 4, 4), {}, ValueError, "leaves the last of its 2 keys"),
        (("a", [b"k"], 0, 4), {}, ValueError, r"input_length=0 leaves .* input_length > 0"),
        (("a", [], 0, 4), {"timestamp": float("nan")}, ValueError, "timestamp=nan is invalid"),
        (("a", [], 0, 4), {"timestamp": -1}, ValueError, "timestamp=-1 is invalid"),
        (("a", [], 0, 4), {"timestamp": "0"}, ValueError, "timestamp='0' is invalid"),
        (("a", [], 0, 4), {"conversation_id": 3}, TypeError, "conversation_id=3 has type int"),
    ],
)
def test_a_bad_request_is_refused(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    """Each was accepted: block_tokens=0 and a negative length made every ratio wrong."""
    with pytest.raises(error, match=message):
        Request(*args, **kwargs)


def test_a_good_request_is_kept_and_numpy_counts_become_ints() -> None:
    keys = [_key(0), _key(1)]
    req = Request("a", keys, np.int64(5), np.int32(4), np.uint8(3))  # type: ignore[arg-type]
    assert (req.input_length, req.block_tokens, req.output_length) == (5, 4, 3)
    assert all(type(v) is int for v in (req.input_length, req.block_tokens, req.output_length))
    # A prompt may run on past its keyed blocks (an engine keys full blocks only).
    assert Request("b", keys[:1], 50, 4, timestamp=1.5).prefix_tokens(1) == 4


def test_a_trace_names_the_request_with_an_unhashable_key() -> None:
    """It said only "unhashable type: 'list'"."""
    good = Request("a", [_key(0)], 4, 4)
    bad = Request("b", [_key(0), [1]], 8, 4)  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"^requests\[1\] \('b'\): keys\[1\]=\[1\] has type list"):
        Trace([good, bad])


# 7. A streamed replay has one block size, as a Trace has.


def _stream(requests: list[Request]) -> Iterator[Request]:
    yield from requests


@pytest.mark.parametrize("replay", ["flat", "engine"])
def test_a_streamed_replay_refuses_a_second_block_size(replay: str) -> None:
    """It replayed 8-token blocks after 4-token ones and reported one block size."""
    keys = [_key(i) for i in range(3)]
    reqs = [Request("a", keys[:2], 8, 4), Request("b", keys[:2], 16, 8)]
    mgr = make_manager("lru", 4)
    message = (
        "request b has 8-token blocks; the trace started with 4-token blocks and a trace has "
        "one block size"
    )
    with pytest.raises(ValueError) as info:
        if replay == "flat":
            replay_flat(_stream(reqs), mgr)
        else:
            replay_engine(_stream(reqs), mgr, device_blocks=1)
    assert str(info.value) == message
    # Refused before it was replayed: the manager saw request a's two blocks only.
    stats = mgr.get_stats()
    assert stats.hits + stats.misses == 2
    # One block size streams as before.
    row = replay_flat(_stream([reqs[0], Request("c", keys[1:], 5, 4)]), make_manager("lru", 4))
    assert (row.requests, row.blocks, row.hits, row.block_tokens) == (2, 4, 1, 4)


def test_a_streamed_replay_refuses_what_is_no_request() -> None:
    req = Request("a", [_key(0)], 4, 4)
    with pytest.raises(TypeError, match=r"requests\[1\]='r2' has type str; expected a Request"):
        replay_flat(_stream([req, "r2"]), make_manager("lru", 4))  # type: ignore[list-item]
