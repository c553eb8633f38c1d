"""KVTierConnector's KV events through the real vLLM Scheduler and its ZMQ event publisher.

The scheduler drains `take_events()` after every step and publishes the batches with vLLM's
`ZmqEventPublisher`; the test reads them back from the publisher's replay socket, decoded as a
consumer (a KV-aware router) would, and checks the host tier's stores and evictions.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import Engine, make_engine

PROMPT_A = list(range(1, 70))  # 69 tokens: 4 full 16-token blocks are offloaded
PROMPT_B = list(range(101, 170))
FOUR_SLOTS = {"num_slots": 4}
_endpoints = itertools.count()


@pytest.fixture(scope="module")
def vllm_loaded() -> Iterator[None]:
    """Import vLLM once for the module (about 15-30 s)."""
    import vllm.v1.core.sched.scheduler  # noqa: F401

    import kvtier.integrations.vllm  # noqa: F401

    yield


def events_config() -> Any:
    """vLLM KV events published over in-process ZMQ sockets, with a replay socket."""
    from vllm.config import KVEventsConfig

    n = next(_endpoints)
    return KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"inproc://kvtier-events-{n}",
        replay_endpoint=f"inproc://kvtier-events-replay-{n}",
    )


def published(engine: Engine) -> list[Any]:
    """Every event vLLM published so far, read back from the publisher's replay socket."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    publisher = engine.scheduler.kv_event_publisher
    publisher._event_queue.join()  # the publisher thread has sent every batch queued so far
    endpoint = publisher.get_publisher_config().replay_endpoint
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode
    events: list[Any] = []
    try:
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        while True:
            assert sock.poll(10_000), "no replay from vLLM's event publisher"
            _, _, seq, payload = sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) < 0:
                return events
            events.extend(decode(payload).events)
    finally:
        sock.close(linger=0)


def host_events(engine: Engine) -> list[tuple[str, list[Any], int | None]]:
    """(kind, block hashes, group) of the published events whose medium is the host tier."""
    return [
        (type(e).__name__, list(e.block_hashes), e.group_idx)
        for e in published(engine)
        if getattr(e, "medium", None) == "CPU"
    ]


def external(hashes: list[bytes]) -> list[Any]:
    """Block hashes as vLLM publishes them (bytes, or ints with VLLM_KV_EVENTS_USE_INT_...)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return [maybe_convert_block_hash(h) for h in hashes]  # type: ignore[arg-type]


def test_stored_and_evicted_chunks_are_published_with_their_hashes(vllm_loaded: None) -> None:
    engine = make_engine("KVTierConnector", FOUR_SLOTS, kv_events_config=events_config())
    try:
        a = engine.add("a", PROMPT_A)
        engine.run_until(["a"])
        a_hashes = external(list(a.block_hashes[:4]))
        assert host_events(engine) == [("BlockStored", [h], 0) for h in a_hashes]

        b = engine.add("b", PROMPT_B)
        engine.run_until(["b"])
        b_hashes = external(list(b.block_hashes[:4]))
        events = host_events(engine)[4:]
        # Four slots: b's chunks evict all of a's, announced before b's stores.
        assert events[0][0] == "BlockRemoved" and events[0][2] == 0
        assert sorted(events[0][1]) == sorted(a_hashes)
        assert events[1:] == [("BlockStored", [h], 0) for h in b_hashes]

        # The GPU prefix cache's own events are published next to kvtier's.
        gpu = [e for e in published(engine) if getattr(e, "medium", None) == "GPU"]
        assert gpu
        assert kvtier_stats(engine).evictions == 4
    finally:
        engine.scheduler.shutdown()


def test_two_groups_remove_per_group(vllm_loaded: None) -> None:
    engine = make_engine(
        "KVTierConnector", FOUR_SLOTS, num_groups=2, kv_events_config=events_config()
    )
    try:
        engine.add("a", PROMPT_A[:37])  # 2 blocks x 2 groups fill the 4 slots
        engine.run_until(["a"])
        engine.add("b", PROMPT_B[:37])
        engine.run_until(["b"])
        events = host_events(engine)
        stored = [(h[0], g) for kind, h, g in events if kind == "BlockStored"]
        removed = [(kind, g, len(h)) for kind, h, g in events if kind == "BlockRemoved"]
        assert len(stored) == 8 and {g for _, g in stored} == {0, 1}
        assert sorted(removed) == [("BlockRemoved", 0, 2), ("BlockRemoved", 1, 2)]
    finally:
        engine.scheduler.shutdown()


def test_reset_announces_the_removal_of_every_chunk(vllm_loaded: None) -> None:
    engine = make_engine("KVTierConnector", FOUR_SLOTS, kv_events_config=events_config())
    try:
        a = engine.add("a", PROMPT_A)
        engine.run_until(["a"])
        assert engine.scheduler.reset_prefix_cache(reset_connector=True)
        engine.step()  # the next step drains the connector's events
        events = host_events(engine)
        assert events[-1][0] == "BlockRemoved"
        assert sorted(events[-1][1]) == sorted(external(list(a.block_hashes[:4])))
    finally:
        engine.scheduler.shutdown()


def test_enable_events_false_keeps_kvtier_quiet(vllm_loaded: None) -> None:
    extra = {**FOUR_SLOTS, "enable_events": False}
    engine = make_engine("KVTierConnector", extra, kv_events_config=events_config())
    try:
        engine.add("a", PROMPT_A)
        engine.run_until(["a"])
        assert kvtier_stats(engine).stores == 4
        assert host_events(engine) == []
    finally:
        engine.scheduler.shutdown()


def test_enable_events_without_vllm_events_fails_at_start_up(vllm_loaded: None) -> None:
    from kvtier.config import ConfigError

    with pytest.raises(ConfigError, match="enable_kv_cache_events"):
        make_engine("KVTierConnector", {**FOUR_SLOTS, "enable_events": True}, with_worker=False)


def kvtier_stats(engine: Engine) -> Any:
    return engine.scheduler.connector.scheduler_side.manager.get_stats()
