"""KVTierConnector's KV events through vLLM's Scheduler and ZMQ publisher: failed stores,
events merged under `max_pending_events`, events off with vLLM's, and int block hashes.

The helpers (the publisher's replay socket read back as a consumer would) are test_events.py's.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import make_engine
from test_events import (
    FOUR_SLOTS,
    PROMPT_A,
    PROMPT_B,
    events_config,
    external,
    host_events,
    kvtier_stats,
)


@pytest.fixture(scope="module")
def vllm_loaded() -> Iterator[None]:
    import vllm.v1.core.sched.scheduler  # noqa: F401

    import kvtier.integrations.vllm  # noqa: F401

    yield


def test_a_failed_store_publishes_nothing(vllm_loaded: None) -> None:
    """A store the workers report failed never reached the host tier: no BlockStored, and no
    BlockRemoved for it later (a reset announces only what was announced)."""
    from kvtier.connector import OffloadingWorker
    from kvtier.transfer import CPUTransferWorker

    engine = make_engine("KVTierConnector", FOUR_SLOTS, kv_events_config=events_config())
    try:

        def fail_stores(job_id: int, kind: str) -> None:
            if kind == "store":
                raise RuntimeError("injected store failure")

        ws = engine.worker.worker_side
        old = ws.transfer
        new = CPUTransferWorker(old.registration, old.pool, fault_injector=fail_stores)
        old.shutdown()
        ws.transfer = new
        ws._worker = OffloadingWorker(new)

        engine.add("a", PROMPT_A)
        engine.run_until(["a"])
        stats = kvtier_stats(engine)
        assert stats.failed_stores == 4 and stats.stores == 0
        assert engine.scheduler.reset_prefix_cache(reset_connector=True)
        engine.step()
        assert host_events(engine) == []
    finally:
        engine.scheduler.shutdown()


def test_events_merged_under_the_cap_publish_the_net_effect(vllm_loaded: None) -> None:
    """With `max_pending_events: 1` a step's evictions and stores are merged into their net
    effect: a consumer ends up believing the host tier holds what it does, as when every
    event is kept."""
    prompt_c = [t + 200 for t in PROMPT_A]

    def run(extra: dict[str, Any]) -> tuple[set[Any], set[Any], int]:
        engine = make_engine("KVTierConnector", extra, kv_events_config=events_config())
        try:
            engine.add("a", PROMPT_A)
            engine.run_until(["a"])
            # Two requests at once: one store fits, the other evicts a's chunks, and both
            # stores complete in the same step.
            b = engine.add("b", PROMPT_B)
            c = engine.add("c", prompt_c)
            engine.run_until(["b", "c"])
            side = engine.scheduler.connector.scheduler_side
            expected = set(external([*b.block_hashes[:4], *c.block_hashes[:4]]))
            return _contents(host_events(engine)), expected, side.manager.events_merged
        finally:
            engine.scheduler.shutdown()

    held, expected, merged = run({"num_slots": 8})
    assert merged == 0 and held == expected
    held, expected, merged = run({"num_slots": 8, "max_pending_events": 1})
    assert merged > 0  # the cap was reached
    assert held == expected


def _contents(events: list[tuple[str, list[Any], int | None]]) -> set[Any]:
    """What a consumer applying the events in order believes the host tier holds; a removal
    of a hash it was not told of, or a second store of one it holds, fails."""
    held: set[Any] = set()
    for kind, hashes, _ in events:
        for h in hashes:
            if kind == "BlockStored":
                assert h not in held, ("stored twice", h)
                held.add(h)
            else:
                assert h in held, ("removed but never stored", h)
                held.remove(h)
    return held


def test_no_events_when_vllms_kv_events_are_off(vllm_loaded: None) -> None:
    """Without vLLM's --kv-events-config (and no enable_events key) the manager keeps no
    events at all: nothing would publish them, and they would only pile up."""
    engine = make_engine("KVTierConnector", FOUR_SLOTS)
    try:
        side = engine.scheduler.connector.scheduler_side
        assert side.setup.events is False
        engine.add("a", PROMPT_A)
        engine.run_until(["a"])
        assert kvtier_stats(engine).stores == 4
        assert list(side.manager.take_events()) == []
        assert side.take_events() == []
    finally:
        engine.scheduler.shutdown()


def test_int_block_hashes_match_vllms_own_events(
    vllm_loaded: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES the host tier's events carry the same ints
    vLLM publishes for the same blocks in its own (GPU) events."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    engine = make_engine("KVTierConnector", FOUR_SLOTS, kv_events_config=events_config())
    try:
        engine.add("a", PROMPT_A)
        engine.run_until(["a"])
        stored = [h for kind, hashes, _ in host_events(engine) for h in hashes]
        assert len(stored) == 4 and all(isinstance(h, int) for h in stored)
        from test_events import published

        gpu = {
            h
            for e in published(engine)
            if getattr(e, "medium", None) == "GPU" and type(e).__name__ == "BlockStored"
            for h in e.block_hashes
        }
        assert set(stored) <= gpu
    finally:
        engine.scheduler.shutdown()
