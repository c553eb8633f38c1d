"""A request stream in the simulator's form: per request, its chained block keys and token count."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtier.base import OffloadKey, ReqContext


class TraceFormatError(ValueError):
    """A trace line that cannot be read; the message names the file and line number."""


@dataclass(slots=True)
class Request:
    """One request of a trace.

    `keys` are the `OffloadKey`s of the request's prompt blocks, in order; the same key means
    the same prefix up to and including that block. `input_length` counts prompt tokens, so
    block `i` covers tokens `[i * block_tokens, min((i + 1) * block_tokens, input_length))`.
    """

    req_id: str
    keys: list[OffloadKey]
    input_length: int
    block_tokens: int
    output_length: int = 0
    timestamp: float | None = None
    conversation_id: str | None = None
    _ctx: ReqContext | None = field(default=None, repr=False, compare=False)

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


class Trace:
    """A whole trace held in memory, with the totals the capacities and ratios are based on.

    Replays and the offline bounds need the whole stream (OPT looks into the future, and one
    trace is replayed at many capacities); the readers themselves stream.
    """

    def __init__(self, requests: Iterable[Request], *, name: str = "trace") -> None:
        self.name = name
        self.requests: list[Request] = list(requests)
        unique: set[OffloadKey] = set()
        num_blocks = 0
        num_tokens = 0
        block_tokens = 0
        first: dict[str, int] = {}
        for i, req in enumerate(self.requests):
            if not isinstance(req, Request):
                # Else "'str' object has no attribute 'keys'", from a path given as requests.
                raise TypeError(
                    f"requests[{i}]={req!r:.80} has type {type(req).__name__}; expected a "
                    "Request (read_trace(path) reads a trace file)"
                )
            # The manager keeps per-request state by id, and reuse admission counts the
            # distinct ids that offer a block: repeats of one id were one request, whose
            # blocks never reached a store threshold of 2 (0% hits, without a word).
            if first.setdefault(req.req_id, i) != i:
                raise ValueError(
                    f"requests[{i}] has req_id {req.req_id!r}, as requests[{first[req.req_id]}] "
                    "has; expected an id of its own for each request"
                )
            unique.update(req.keys)
            num_blocks += len(req.keys)
            num_tokens += req.input_length
            block_tokens = block_tokens or req.block_tokens
            if req.block_tokens != block_tokens:
                raise ValueError(
                    f"request {req.req_id} has {req.block_tokens}-token blocks; the trace "
                    f"started with {block_tokens}-token blocks and a trace has one block size"
                )
        self.num_unique_blocks = len(unique)
        self.num_blocks = num_blocks
        self.num_tokens = num_tokens
        self.block_tokens = block_tokens

    def __len__(self) -> int:
        return len(self.requests)

    def __repr__(self) -> str:
        return (
            f"Trace({self.name!r}, requests={len(self)}, blocks={self.num_blocks}, "
            f"unique_blocks={self.num_unique_blocks}, block_tokens={self.block_tokens})"
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
