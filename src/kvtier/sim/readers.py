"""Trace readers: Mooncake JSONL (chained block ids) and JSONL of token-id prompts.

Both yield `Request`s one line at a time, so a trace is never loaded whole by a reader. Every
bad line raises `TraceFormatError` naming the file and the line number; bad arguments, a
path that is no file and a file without a record (`TraceFormatError`, as `iter_trace` raises)
are refused when a reader is called, not at its first line (a pipe's emptiness at its end).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any, Final

import msgspec

from kvtier.base import OffloadKey, checked_int, make_offload_key
from kvtier.hashing import HASH_ALGORITHMS, BlockHasher
from kvtier.sim.trace import Request, Trace, TraceFormatError

MOONCAKE_BLOCK_TOKENS: Final = 512
"""Tokens per block of the Mooncake traces' `hash_ids`."""

FORMATS: Final = ("auto", "mooncake", "tokens")
"""Trace formats `read_trace` accepts."""

_MAX_ID: Final = (1 << 64) - 1
_MAX_TOKEN: Final = (1 << 32) - 1
_decode = msgspec.json.Decoder()
_BOM: Final = b"\xef\xbb\xbf"
# How a trace file is often shipped instead of UTF-8 JSONL, by its first bytes (none can start
# a JSON value): the decoder called each only "invalid character (byte 0)".
_NOT_JSONL: Final = (
    (b"\x1f\x8b", "gzip-compressed", "decompress it first, e.g. gunzip -k"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed", "decompress it first, e.g. zstd -d"),
    (b"BZh", "bzip2-compressed", "decompress it first, e.g. bunzip2 -k"),
    (b"\xfd7zXZ\x00", "xz-compressed", "decompress it first, e.g. unxz -k"),
    (b"PK\x03\x04", "a zip archive", "extract the trace first, e.g. unzip"),
    # UTF-32 before UTF-16: the little-endian marks share their first two bytes.
    (b"\xff\xfe\x00\x00", "UTF-32 text", "convert it, e.g. iconv -f UTF-32 -t UTF-8"),
    (b"\x00\x00\xfe\xff", "UTF-32 text", "convert it, e.g. iconv -f UTF-32 -t UTF-8"),
    (b"\xff\xfe", "UTF-16 text", "convert it, e.g. iconv -f UTF-16 -t UTF-8"),
    (b"\xfe\xff", "UTF-16 text", "convert it, e.g. iconv -f UTF-16 -t UTF-8"),
)
# Columns that would hold a request's blocks; a CSV without them has only lengths and times.
_ID_COLUMNS: Final = frozenset({"hash_ids", "token_ids"})


def _trace_file(path: str | Path, *, regular: bool = False) -> Path:
    """`path`, if it names a file to read; else an OSError saying a trace file was expected.

    `regular` also refuses a pipe or device, for callers that read the file more than once.
    """
    path = Path(path)
    if path.is_dir():
        # open() said only "[Errno 21] Is a directory", and only at the first line.
        raise IsADirectoryError(f"trace {str(path)!r} is a directory; expected a trace file")
    if not path.exists():
        raise FileNotFoundError(f"trace file {str(path)!r} does not exist")
    if regular and not path.is_file():
        raise OSError(f"trace {str(path)!r} is not a regular file; expected a trace file")
    return path


def _csv_header(raw: bytes) -> tuple[str, str, list[str]] | None:
    """(kind, header, column names) if `raw`, a first line that is not JSON, looks like the
    header of a CSV or tab-separated file; else None."""
    text = raw.decode("utf-8", "replace").strip()
    for sep, kind in ((",", "CSV"), ("\t", "tab-separated")):
        names = [name.strip().strip('"').strip() for name in text.split(sep)]
        # Column names each have a letter (a data row of numbers and dates does not) and no
        # JSON punctuation (JSON cut short does).
        if len(names) >= 2 and all(
            any(c.isalpha() for c in name) and not any(c in name for c in '{}[]:"')
            for name in names
        ):
            return kind, text, names
    return None


def _not_csv(where: str, raw: bytes) -> None:
    """Raise `TraceFormatError` naming a CSV file as one, if `raw`, the first line that is not
    blank, is a header."""
    found = _csv_header(raw)
    if found is None:
        return
    kind, header, names = found
    shown = repr(header if len(header) <= 80 else header[:77] + "...")
    if _ID_COLUMNS.isdisjoint(name.lower() for name in names):
        # Such as the Azure LLM inference traces (TIMESTAMP,ContextTokens,GeneratedTokens).
        raise TraceFormatError(
            f"{where}: not a JSONL trace: the file is {kind} with the header {shown}, which "
            "has no prefix or block ids (no hash_ids or token_ids column), so it cannot be "
            "replayed for hit ratios; expected Mooncake JSONL ('hash_ids') or token-id JSONL "
            "('token_ids')"
        )
    raise TraceFormatError(
        f"{where}: not a JSONL trace: the file is {kind} with the header {shown}; expected "
        "JSON Lines, one object per request (convert each row to a JSON object with a list of "
        "'hash_ids' (Mooncake) or 'token_ids' (token prompts))"
    )


def _lines(path: Path) -> Generator[tuple[int, dict[str, Any]], None, None]:
    """Yield (line number, JSON object) for every non-blank line."""
    first = True  # no record read yet
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1:
                if raw.startswith(_BOM):
                    raw = raw[len(_BOM) :]  # editors on Windows start UTF-8 files with one
                for magic, what, fix in _NOT_JSONL:
                    if raw.startswith(magic):
                        raise TraceFormatError(
                            f"{path}:1: not a JSONL trace: the file is {what}; expected "
                            f"uncompressed UTF-8 JSON Lines ({fix})"
                        )
            if not raw.strip():
                continue
            try:
                obj = _decode.decode(raw)
            except msgspec.DecodeError as e:
                if first:
                    # The decoder said only "invalid character (byte 0)" of a CSV header.
                    _not_csv(f"{path}:{lineno}", raw)
                raise TraceFormatError(f"{path}:{lineno}: not valid JSON ({e})") from None
            except UnicodeDecodeError as e:
                # msgspec raises it bare for a bad byte inside a string (`e.object`), which
                # named neither the file nor the line.
                raise TraceFormatError(
                    f"{path}:{lineno}: not valid UTF-8 (byte {e.object[e.start]:#04x} in a "
                    f"string: {e.reason}); expected UTF-8 JSON"
                ) from None
            except RecursionError:
                # Valid JSON, but nested deeper than the decoder can follow.
                raise TraceFormatError(
                    f"{path}:{lineno}: not valid JSON (nested too deeply to decode)"
                ) from None
            if not isinstance(obj, dict):
                raise TraceFormatError(
                    f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}"
                )
            first = False
            yield lineno, obj


def _got(obj: dict[str, Any], name: str) -> str:
    """What a line has in place of a required field, for its error message."""
    if name not in obj:
        return "it is missing"
    value = obj[name]
    text = "null" if value is None else repr(value)
    # A line's value can be megabytes long; the start says what it is.
    return f"got {text if len(text) <= 60 else text[:57] + '...'}"


def _int_field(obj: dict[str, Any], name: str, where: str, *, default: int | None = None) -> int:
    value = obj.get(name)
    if value is None:
        # null is "not given", as for `timestamp`: fine for an optional field only.
        if default is not None:
            return default
        if name in obj:
            raise TraceFormatError(f"{where}: {name}=null is invalid; expected an integer >= 0")
        raise TraceFormatError(f"{where}: missing field {name!r}")
    if type(value) is not int or value < 0:
        raise TraceFormatError(f"{where}: {name}={value!r} is invalid; expected an integer >= 0")
    return value


def _timestamp(obj: dict[str, Any], where: str) -> float | None:
    value = obj.get("timestamp")
    if value is not None and (type(value) not in (int, float) or value < 0):
        raise TraceFormatError(f"{where}: timestamp={value!r} is invalid; expected a number >= 0")
    return value


def read_mooncake(
    path: str | Path, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS, group_idx: int = 0
) -> Iterator[Request]:
    """Stream a Mooncake trace: `{"timestamp", "input_length", "output_length", "hash_ids"}`.

    Each hash id becomes an `OffloadKey` (the id as 8 big-endian bytes plus the group), so equal
    ids give equal keys. The last block may be partial, as in the published traces:
    `(len(hash_ids) - 1) * block_tokens < input_length <= len(hash_ids) * block_tokens`.
    """
    # Checked now, not at the first line: a bad size was reported as line 1 not fitting it,
    # a bad group only at the first line (an empty file accepted it).
    block_tokens = checked_int("block_tokens", block_tokens)
    _check_group(group_idx)
    return _read_mooncake(_nonempty_file(path), block_tokens, group_idx)


def _check_group(group_idx: int) -> None:
    """Refuse a KV-cache group index no key can carry (`make_offload_key`'s own check)."""
    make_offload_key(b"", group_idx)


def _inferred_size_hint(length: int, n: int, block_tokens: int) -> str:
    """What to tell a user whose line does not fit the block size inferred from earlier lines."""
    low = -(-length // n)
    high = (length - 1) // (n - 1) if n > 1 else None
    if length < 1 or (high is not None and low > high):
        return ""  # no block size fits this line: naming --block-tokens would not help
    sizes = f"{low} or more" if high is None else f"{low}..{high}"
    return (
        f"; {block_tokens} is the block size inferred from the trace's first lines, and this "
        f"line fits blocks of {sizes} tokens: pass the trace's block size explicitly "
        f"(--block-tokens)"
    )


def _read_mooncake(
    path: Path, block_tokens: int, group_idx: int, *, inferred: bool = False
) -> Iterator[Request]:
    keys: dict[int, OffloadKey] = {}  # one bytes object per id: less memory, cached hashes
    lineno = 0
    for lineno, obj in _lines(path):
        where = f"{path}:{lineno}"
        ids = obj.get("hash_ids")
        if not isinstance(ids, list):
            raise TraceFormatError(
                f"{where}: field 'hash_ids' must be a list of block ids; {_got(obj, 'hash_ids')}"
            )
        length = _int_field(obj, "input_length", where)
        n = len(ids)
        fits = (n - 1) * block_tokens < length <= n * block_tokens
        if n == 0 and length > 0:
            raise TraceFormatError(
                f"{where}: input_length={length} does not fit 0 blocks (hash_ids is empty); "
                f"expected input_length=0, or {-(-length // block_tokens)} hash ids of "
                f"{block_tokens}-token blocks"
            )
        if not fits and n > 0:
            raise TraceFormatError(
                f"{where}: input_length={length} does not fit {n} block{'s' * (n != 1)} of "
                f"{block_tokens} tokens; expected {(n - 1) * block_tokens + 1}..{n * block_tokens}"
                + (_inferred_size_hint(length, n, block_tokens) if inferred else "")
            )
        req_keys: list[OffloadKey] = []
        for block_id in ids:
            key = keys.get(block_id) if type(block_id) is int else None
            if key is None:
                if type(block_id) is not int or not 0 <= block_id <= _MAX_ID:
                    raise TraceFormatError(
                        f"{where}: hash id {block_id!r} is invalid; expected an integer "
                        f"in 0..2**64-1"
                    )
                key = keys[block_id] = make_offload_key(block_id.to_bytes(8, "big"), group_idx)
            req_keys.append(key)
        if len(set(ids)) != len(ids):
            # Chained ids name a block by its whole prefix, so one request cannot repeat one.
            first: dict[int, int] = {}
            for i, block_id in enumerate(ids):
                if block_id in first:
                    raise TraceFormatError(
                        f"{where}: hash id {block_id} repeats (positions {first[block_id]} and "
                        f"{i}); expected distinct chained prefix block ids within a request"
                    )
                first[block_id] = i
        yield Request(
            req_id=f"r{lineno}",
            keys=req_keys,
            input_length=length,
            block_tokens=block_tokens,
            output_length=_int_field(obj, "output_length", where, default=0),
            timestamp=_timestamp(obj, where),
        )
    if not lineno:
        raise _empty(path)  # a pipe, which `_nonempty_file` cannot read ahead of the reader


def read_token_prompts(
    path: str | Path,
    *,
    block_tokens: int = 16,
    algorithm: str = "sha256",
    namespace: str | bytes = b"",
    group_idx: int = 0,
) -> Iterator[Request]:
    """Stream a JSONL of prompts: `{"token_ids": [...], "conversation_id"?, "timestamp"?,
    "output_length"?}`.

    Prompts are hashed with `kvtier.hashing.BlockHasher` into chained keys of full
    `block_tokens`-token blocks (a trailing partial block gets no key, as in an engine). The
    conversation id is kept on the request and in its id, for reports and per-request policies.
    """
    # Built now, so a bad size, algorithm or namespace is refused at the call, not at line 1.
    hasher = BlockHasher(
        checked_int("block_tokens", block_tokens), algorithm=algorithm, namespace=namespace
    )
    _check_group(group_idx)
    return _read_token_prompts(_nonempty_file(path), hasher, group_idx)


def _read_token_prompts(path: Path, hasher: BlockHasher, group_idx: int) -> Iterator[Request]:
    block_tokens = hasher.block_size
    interned: dict[bytes, OffloadKey] = {}
    lineno = 0
    for lineno, obj in _lines(path):
        where = f"{path}:{lineno}"
        tokens = obj.get("token_ids")
        if not isinstance(tokens, list):
            raise TraceFormatError(
                f"{where}: field 'token_ids' must be a list of token ids; {_got(obj, 'token_ids')}"
            )
        conv = obj.get("conversation_id")
        if conv is not None and type(conv) not in (str, int):
            raise TraceFormatError(
                f"{where}: conversation_id={conv!r} is invalid; expected a string or integer"
            )
        try:
            # numpy would read a JSON true among ints as token 1; msgspec's strict check is cheap.
            msgspec.convert(tokens, list[int])
        except msgspec.ValidationError:
            i, bad = next((i, t) for i, t in enumerate(tokens) if type(t) is not int)
            raise TraceFormatError(
                f"{where}: bad token_ids (token id {bad!r} at index {i} is not an integer; "
                f"expected 0..{_MAX_TOKEN})"
            ) from None
        try:
            hashes = hasher.hash_blocks(tokens)
        except (ValueError, TypeError, OverflowError) as e:
            raise TraceFormatError(f"{where}: bad token_ids ({e})") from None
        req_keys: list[OffloadKey] = []
        for h in hashes:
            key = interned.get(h)
            if key is None:
                key = interned[h] = make_offload_key(h, group_idx)
            req_keys.append(key)
        conv_id = None if conv is None else str(conv)
        yield Request(
            req_id=f"r{lineno}" if conv_id is None else f"{conv_id}/r{lineno}",
            keys=req_keys,
            input_length=len(tokens),
            block_tokens=block_tokens,
            output_length=_int_field(obj, "output_length", where, default=0),
            timestamp=_timestamp(obj, where),
            conversation_id=conv_id,
        )
    if not lineno:
        raise _empty(path)


def _head(path: Path, max_lines: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """The first `max_lines` lines' objects, up to the first bad one (the reader reports it)."""
    with closing(_lines(path)) as lines:  # closes the file now, not at garbage collection
        try:
            for lineno, obj in lines:
                yield lineno, obj
                if lineno >= max_lines:
                    return
        except TraceFormatError:
            return


def infer_block_tokens(path: str | Path, *, max_lines: int = 1000) -> int:
    """Tokens per block of a Mooncake-format trace, from its first `max_lines` lines.

    Each line with `n` ids and `input_length` `L` allows block sizes `B` with
    `(n - 1) * B < L <= n * B`. The sizes every line allows form a range: 512 (the published
    Mooncake traces) when it is in it, else the smallest power of two in it, else its smallest
    value. Traces with other block sizes (Qwen-Bailian's 16-token `hash_ids`) thus load
    without `--block-tokens`; lines that agree on no size raise `TraceFormatError`. A line that
    fits no size by itself ends the search, and the reader reports it.
    """
    max_lines = checked_int("max_lines", max_lines)  # 0 or less read nothing and said 512
    path = _trace_file(path)
    low, high = 1, None  # allowed sizes: low..high (None: unbounded)
    for lineno, obj in _head(path, max_lines):
        ids, length = obj.get("hash_ids"), obj.get("input_length")
        if isinstance(ids, list) and ids and type(length) is int and length > 0:
            n = len(ids)
            line_low = -(-length // n)
            cap = (length - 1) // (n - 1) if n > 1 else None
            if cap is not None and line_low > cap:
                # This line fits no block size: the reader reports it as the bad line. Taken
                # into the range, it blamed every line before it and sent the user to
                # --block-tokens, which cannot help.
                break
            low = max(low, line_low)
            if cap is not None:
                high = cap if high is None else min(high, cap)
            if high is not None and low > high:
                raise TraceFormatError(
                    f"{path}:{lineno}: no block size fits the input_length and the number of "
                    f"hash_ids of lines 1..{lineno}; pass the trace's block size explicitly "
                    f"(--block-tokens)"
                )
            if low == high:
                return low
    if low <= MOONCAKE_BLOCK_TOKENS and (high is None or high >= MOONCAKE_BLOCK_TOKENS):
        return MOONCAKE_BLOCK_TOKENS
    power = 1 << (low - 1).bit_length()
    return power if high is None or power <= high else low


def detect_format(path: str | Path) -> str:
    """Say whether `path` is a `"mooncake"` or a `"tokens"` trace, from its first record."""
    path = _trace_file(path)
    with closing(_lines(path)) as lines:
        for lineno, obj in lines:
            if "hash_ids" in obj:
                return "mooncake"
            if "token_ids" in obj:
                return "tokens"
            raise TraceFormatError(
                f"{path}:{lineno}: unknown trace format; expected a 'hash_ids' (Mooncake) or "
                f"'token_ids' (token prompts) field"
            )
    raise _empty(path)


def _empty(path: Path) -> TraceFormatError:
    return TraceFormatError(
        f"{path}: the trace is empty; expected one JSON object per line, one per request"
    )


def _check_not_empty(path: Path) -> None:
    """Refuse a file without a record, as format detection does; a bad first line is left to
    the reader, which reports it."""
    with closing(_lines(path)) as lines:
        try:
            next(lines)
        except StopIteration:
            raise _empty(path) from None
        except TraceFormatError:
            pass


def _nonempty_file(path: str | Path) -> Path:
    """`path`, checked as `_trace_file` checks it and, if a regular file, refused when it holds
    no record (as `iter_trace` refuses it): the readers yielded nothing for an empty file."""
    file = _trace_file(path)
    if file.is_file():  # a pipe's first line would be consumed; its reader checks at its end
        _check_not_empty(file)
    return file


def iter_trace(
    path: str | Path,
    *,
    fmt: str = "auto",
    block_tokens: int | None = None,
    algorithm: str = "sha256",
    namespace: str | bytes = b"",
) -> Iterator[Request]:
    """Stream the requests of a trace of format `fmt` (`"auto"` detects it).

    `block_tokens` defaults, for Mooncake-format traces, to the size their lengths imply
    (`infer_block_tokens`: 512 for the published Mooncake traces) and to 16 for token prompts.
    A file without a record raises `TraceFormatError` whatever `fmt` is: it is no trace (an
    empty download, a wrong path), and every replay refuses it.
    """
    if fmt not in FORMATS:
        raise ValueError(f"trace format {fmt!r} is unknown; expected one of: {', '.join(FORMATS)}")
    if algorithm not in HASH_ALGORITHMS:
        raise ValueError(
            f"unknown hash algorithm {algorithm!r}; expected one of: {', '.join(HASH_ALGORITHMS)}"
        )
    if block_tokens is not None and (type(block_tokens) is not int or block_tokens < 1):
        raise ValueError(f"block_tokens={block_tokens!r} is invalid; expected a positive int")
    # Regular only: the file is read more than once (detection, block size, requests).
    file = _trace_file(path, regular=True)
    detected = fmt == "auto"
    if detected:
        fmt = detect_format(file)  # which refuses an empty file, as the readers do
    if fmt == "mooncake":
        if algorithm != "sha256" or namespace not in ("", b""):
            # Its hash_ids are block ids already: a hash setting would be silently ignored.
            raise ValueError(
                f"hash algorithm {algorithm!r} and namespace {namespace!r} apply to token-prompt "
                f"traces; {str(path)!r} is in Mooncake format, whose hash_ids are already block "
                "ids (leave them at sha256 and none)"
            )
        if block_tokens is None:
            if not detected:
                _check_not_empty(file)  # as `read_mooncake` does: at the call
            return _read_mooncake(file, infer_block_tokens(file), 0, inferred=True)
        return read_mooncake(file, block_tokens=block_tokens)
    return read_token_prompts(
        file, block_tokens=block_tokens or 16, algorithm=algorithm, namespace=namespace
    )


def read_trace(path: str | Path, **kwargs: Any) -> Trace:
    """Read a whole trace (see `iter_trace` for the arguments) for replays and bounds."""
    return Trace(iter_trace(path, **kwargs), name=Path(path).name)
