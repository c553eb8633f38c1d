"""A request stream in the simulator's form: per request, its chained block keys and token count."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtier.base import OffloadKey, ReqContext, checked_int


class TraceFormatError(ValueError):
    """A trace line that cannot be read; the message names the file and line number."""


@dataclass(slots=True)
class Request:
    """One request of a trace.

    `keys` are the `OffloadKey`s of the request's prompt blocks, in order; the same key means
    the same prefix up to and including that block. `input_length` counts prompt tokens, so
    block `i` covers tokens `[i * block_tokens, min((i + 1) * block_tokens, input_length))`.

    A request built by hand must have a str `req_id`, a list of `keys`, `block_tokens >= 1`,
    `input_length` and `output_length >= 0`, a `timestamp` of `None` or a number >= 0, a
    `conversation_id` of `None` or a str, and at least one prompt token in every keyed block
    (`(len(keys) - 1) * block_tokens < input_length`); else ValueError or TypeError. Keys must
    be `OffloadKey`s (bytes): the first is checked here (keys given as str or int), every one
    by `Trace` and by the manager as it is replayed; a check of each here would slow the
    readers, which build a request per line.
    """

    req_id: str
    keys: list[OffloadKey]
    input_length: int
    block_tokens: int
    output_length: int = 0
    timestamp: float | None = None
    conversation_id: str | None = None
    _ctx: ReqContext | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        # One combined test, all in this frame: the readers build a request per trace line.
        length, bt, out, ts = (
            self.input_length,
            self.block_tokens,
            self.output_length,
            self.timestamp,
        )
        if not (
            type(length) is int
            and type(bt) is int
            and type(out) is int
            and length >= 0
            and bt >= 1
            and out >= 0
            and type(self.req_id) is str
            and type(self.keys) is list
            and (
                not self.keys
                or (type(self.keys[0]) is bytes and (len(self.keys) - 1) * bt < length)
            )
            and (ts is None or (type(ts) in (int, float) and ts >= 0))
            and (self.conversation_id is None or type(self.conversation_id) is str)
        ):
            self._check_fields()

    def _check_fields(self) -> None:
        """Normalise integer-like counts (numpy ints) to int, or raise naming the bad field."""
        rid = self.req_id
        if not isinstance(rid, str):
            raise TypeError(f"req_id={rid!r:.80} has type {type(rid).__name__}; expected a str")
        where = f"request {rid!r}"
        if not isinstance(self.keys, list):
            raise TypeError(
                f"{where}: keys={self.keys!r:.80} has type {type(self.keys).__name__}; expected "
                "a list of OffloadKey"
            )
        self.input_length = _count(where, "input_length", self.input_length, 0)
        self.block_tokens = _count(where, "block_tokens", self.block_tokens, 1)
        self.output_length = _count(where, "output_length", self.output_length, 0)
        ts = self.timestamp
        if ts is not None and (
            isinstance(ts, bool) or not isinstance(ts, (int, float)) or not ts >= 0
        ):
            # `not >=`: NaN too, which no ordering of arrivals can use.
            raise ValueError(
                f"{where}: timestamp={ts!r} is invalid; expected None or a number >= 0"
            )
        conv = self.conversation_id
        if conv is not None and not isinstance(conv, str):
            raise TypeError(
                f"{where}: conversation_id={conv!r:.80} has type {type(conv).__name__}; "
                "expected None or a str"
            )
        if self.keys and not isinstance(self.keys[0], bytes):
            _check_keys(where, self.keys)
        n, bt, length = len(self.keys), self.block_tokens, self.input_length
        if n and (n - 1) * bt >= length:
            # A block past the prompt's end covers no token: its hits would count for nothing
            # in `prefix_tokens`, and a negative or zero length made the ratios meaningless.
            raise ValueError(
                f"{where}: input_length={length} leaves the last of its {n} keys "
                f"({bt}-token blocks) without a prompt token; expected input_length > "
                f"{(n - 1) * bt}, or fewer keys"
            )

    def prefix_tokens(self, num_blocks: int) -> int:
        """Prompt tokens covered by the first `num_blocks` blocks."""
        return min(num_blocks * self.block_tokens, self.input_length)

    @property
    def ctx(self) -> ReqContext:
        """The manager's view of this request: its id and where each key's block ends.

        Built once and reused by every replay of the trace, so replays allocate no context.
        """
        if self._ctx is None:
            bt, length = self.block_tokens, self.input_length
            positions = {key: min((i + 1) * bt, length) for i, key in enumerate(self.keys)}
            self._ctx = ReqContext(self.req_id, key_positions=positions)
        return self._ctx


def _count(where: str, name: str, value: object, minimum: int) -> int:
    try:
        return checked_int(name, value, minimum)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


class Trace:
    """A whole trace held in memory, with the totals the capacities and ratios are based on.

    Replays and the offline bounds need the whole stream (OPT looks into the future, and one
    trace is replayed at many capacities); the readers themselves stream. Each request needs an
    id of its own and keys that are all `OffloadKey`s (bytes itself, as the manager requires);
    else ValueError or TypeError naming the request.
    """

    def __init__(self, requests: Iterable[Request], *, name: str = "trace") -> None:
        self.name = name
        self.requests: list[Request] = list(requests)
        totals = TraceTotals()
        add = totals.add
        for i, req in enumerate(self.requests):
            add(i, req)
        # `Request` checks only the first key; OPT took a str or int key as a block, where the
        # manager refuses it. Types gathered in C cost ~4% of reading a trace.
        if not totals.key_types <= {bytes}:
            for i, req in enumerate(self.requests):
                _check_keys(f"requests[{i}] ({req.req_id!r})", req.keys)
        self.num_unique_blocks = len(totals.unique)
        self.num_blocks = totals.num_blocks
        self.num_tokens = totals.num_tokens
        self.block_tokens = totals.block_tokens

    def __len__(self) -> int:
        return len(self.requests)

    def __repr__(self) -> str:
        return (
            f"Trace({self.name!r}, requests={len(self)}, blocks={self.num_blocks}, "
            f"unique_blocks={self.num_unique_blocks}, block_tokens={self.block_tokens})"
        )


class TraceTotals:
    """A trace's totals, and the checks each of its requests must pass, one request at a time:
    for a `Trace`, and for a stream of requests as it is replayed."""

    def __init__(self) -> None:
        self.num_requests = self.num_blocks = self.num_tokens = self.block_tokens = 0
        self.unique: set[OffloadKey] = set()
        self.key_types: set[type] = set()
        # Where each id was first seen (~100 bytes an id: 290 MiB for 3M requests; the key set
        # is larger: the Mooncake trace has 12k ids and 183k distinct keys).
        self._first: dict[str, int] = {}

    def add(self, i: int, req: Request) -> None:
        """Count `req`, the `i`-th request, or raise naming what is wrong with it."""
        if not isinstance(req, Request):
            # Else "'str' object has no attribute 'keys'", from a path given as requests.
            raise TypeError(
                f"requests[{i}]={req!r:.80} has type {type(req).__name__}; expected a Request "
                "(read_trace(path) reads a trace file, iter_trace(path) streams one)"
            )
        # The manager keeps per-request state by id, and reuse admission counts the distinct
        # ids that offer a block: repeats of one id were one request, whose blocks never
        # reached a store threshold of 2 (0% hits, without a word).
        first = self._first.setdefault(req.req_id, i)
        if first != i:
            raise ValueError(
                f"requests[{i}] has req_id {req.req_id!r}, as requests[{first}] has; expected "
                "an id of its own for each request"
            )
        if self.block_tokens and req.block_tokens != self.block_tokens:
            # Each block counts as one slot: mixed sizes made every ratio meaningless.
            raise ValueError(
                f"request {req.req_id} has {req.block_tokens}-token blocks; the trace "
                f"started with {self.block_tokens}-token blocks and a trace has one block size"
            )
        try:
            self.unique.update(req.keys)
        except TypeError:  # else "unhashable type: 'list'", naming no request
            _check_keys(f"requests[{i}] ({req.req_id!r})", req.keys)
            raise
        self.key_types.update(map(type, req.keys))
        self.num_requests += 1
        self.num_blocks += len(req.keys)
        self.num_tokens += req.input_length
        self.block_tokens = req.block_tokens


def _check_keys(where: str, keys: list[OffloadKey]) -> None:
    """Raise a TypeError naming the first of `keys` that is no `OffloadKey` (bytes)."""
    for j, key in enumerate(keys):
        if type(key) is not bytes:  # as the manager checks: a subclass of bytes is refused
            raise TypeError(
                f"{where}: keys[{j}]={key!r:.80} has type {type(key).__name__}; expected an "
                "OffloadKey (bytes: make_offload_key makes one)"
            )


def check_replayable(trace: object) -> Trace:
    """`trace`, if it is a `Trace` with blocks to replay; else a TypeError or ValueError."""
    if not isinstance(trace, Trace):
        # A list of requests or `iter_trace`'s stream failed deep in the first replay.
        raise TypeError(
            f"trace has type {type(trace).__name__}; expected a Trace (read_trace(path) or "
            "Trace(requests) makes one)"
        )
    if trace.num_blocks == 0:
        # Every ratio would be 0/0, reported as 0.0 and a share of no blocks; the CLI refuses
        # such a trace too.
        raise ValueError(f"trace {trace.name!r} has no blocks to replay; expected at least one")
    return trace
