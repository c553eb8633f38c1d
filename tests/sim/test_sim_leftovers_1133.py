"""Leftovers of the 1133 review in the simulator's Python API: a streamed replay refuses a
repeated `req_id` as `Trace` does, a direct replay names an unregistered policy class as the
runner does, the low-level readers refuse an empty file as `iter_trace` does, and `Trace`
refuses a key that is no `bytes` anywhere in a request, not only the first."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.base import OffloadKey, make_offload_key
from kvtier.policies import get_policy_cls
from kvtier.sim import (
    Request,
    Trace,
    TraceFormatError,
    make_manager,
    opt_result,
    read_mooncake,
    read_token_prompts,
    replay_engine,
    replay_flat,
)
from kvtier.sim.result import RunResult

Replay = Callable[..., RunResult]
REPLAYS: list[Replay] = [
    replay_flat,
    lambda trace, mgr, **kw: replay_engine(trace, mgr, device_blocks=0, **kw),
]


def _key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def _request(req_id: str, ids: list[int]) -> Request:
    return Request(req_id, [_key(i) for i in ids], 4 * len(ids), 4)


class _UnregisteredLru(get_policy_cls("lru")):  # type: ignore[misc]
    """LRU by inheritance, but not the registered policy: its row must not read "lru"."""


@pytest.mark.parametrize("replay", REPLAYS, ids=["flat", "engine"])
def test_streamed_replay_refuses_a_repeated_req_id(replay: Replay) -> None:
    mgr = make_manager("lru", 10, store_threshold=2)
    stream = iter([_request("a", [1, 2]), _request("b", [1, 2]), _request("a", [1, 2, 3])])
    with pytest.raises(ValueError, match=r"requests\[2\] has req_id 'a', as requests\[0\] has"):
        replay(stream, mgr)
    # The repeat was refused before it reached the manager: the two requests before it stored
    # blocks 1 and 2 on their second sighting, and block 3 was never offered.
    assert mgr.get_stats().stores == 2
    assert replay(iter([_request("c", [1, 2, 3])]), mgr).hits == 2
    # Distinct ids still reach the threshold: sightings 1 and 2 miss, the other three hit.
    stream = (_request(f"r{n}", [1, 2, 3]) for n in range(5))
    result = replay(stream, make_manager("lru", 10, store_threshold=2))
    assert (result.requests, result.hits) == (5, 9)


@pytest.mark.parametrize("replay", REPLAYS, ids=["flat", "engine"])
def test_direct_replay_names_an_unregistered_subclass_as_the_runner_does(
    replay: Replay,
) -> None:
    trace = Trace([_request("a", [1, 2])])
    row = replay(trace, make_manager(_UnregisteredLru, 4))
    assert row.policy == f"{__name__}:_UnregisteredLru"
    assert replay(trace, make_manager("lru", 4)).policy == "lru"
    assert replay(trace, make_manager(_UnregisteredLru, 4), policy="mine").policy == "mine"


READERS: list[Callable[[Path], Iterator[Request]]] = [read_mooncake, read_token_prompts]


@pytest.mark.parametrize("reader", READERS, ids=["mooncake", "tokens"])
@pytest.mark.parametrize("text", ["", "\n  \n\n"], ids=["empty", "blank-lines"])
def test_reader_refuses_a_file_without_a_record_at_the_call(
    reader: Callable[[Path], Iterator[Request]], text: str, tmp_path: Path
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    with pytest.raises(TraceFormatError, match=r"t\.jsonl: the trace is empty"):
        reader(path)  # at the call, not at the first next()
    path.write_text(text + '{"input_length": 600, "hash_ids": [7, 8], "token_ids": [1, 2, 3, 4]}')
    assert len(list(reader(path))) == 1  # one record is a trace


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
@pytest.mark.parametrize("reader", READERS, ids=["mooncake", "tokens"])
def test_reader_refuses_an_empty_pipe_at_its_end(
    reader: Callable[[Path], Iterator[Request]], tmp_path: Path
) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    requests = reader(fifo)  # a pipe cannot be read ahead: nothing is read at the call
    writer = threading.Thread(target=lambda: open(fifo, "wb").close())
    writer.start()
    try:
        with pytest.raises(TraceFormatError, match="the trace is empty"):
            list(requests)
    finally:
        writer.join(timeout=10)


class _Bytes(bytes):
    """A bytes subclass: the manager refuses it (`type(key) is bytes`)."""


@pytest.mark.parametrize(("bad", "type_name"), [("x", "str"), (3, "int"), (_Bytes(b"k"), "_Bytes")])
def test_trace_refuses_a_later_key_that_is_no_bytes(bad: object, type_name: str) -> None:
    good = _request("a", [1, 2])
    mixed = Request("m", [_key(1), bad, _key(3)], 12, 4)  # type: ignore[list-item]
    with pytest.raises(
        TypeError, match=rf"requests\[1\] \('m'\): keys\[1\]=.* has type {type_name}; expected"
    ):
        Trace([good, mixed])


def test_opt_cannot_rate_a_trace_the_manager_refuses() -> None:
    mixed = Request("m", [_key(1), "x"], 8, 4)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="keys\\[1\\]='x' has type str"):
        opt_result(Trace([mixed]), 2)
    with pytest.raises(TypeError, match="offload keys are bytes"):
        replay_flat(iter([mixed]), make_manager("lru", 2))  # a stream meets the manager's check
