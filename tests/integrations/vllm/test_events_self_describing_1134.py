"""`self_describing_kv_events`: the host tier's KV events carry what a consumer needs to index
a chunk without the engine (every block hash of the chunk, its parent hash, its token ids, the
block size), as vLLM's own OffloadingConnector sends them with the same key.

Without it, a chunk of several blocks was announced by its last block hash alone, so a
KV-aware router matched none of the chunk's earlier blocks, and one that hashes tokens itself
had no tokens to hash.
"""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import Engine, make_engine
from test_events import PROMPT_A, PROMPT_B, events_config, external, published
from test_vllm import _swap_transfer, offloading_connector_engine, vllm_loaded

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm

SLOT_BYTES = 32_768  # one 32-token chunk of the test model's KV in kvtier's pool
EXTRA = {"block_size": 32, "self_describing_kv_events": True}


def fail_stores(job_id: int, kind: str) -> None:
    if kind == "store":
        raise RuntimeError("injected store failure")


def host(engine: Engine) -> list[Any]:
    return [e for e in published(engine) if getattr(e, "medium", None) == "CPU"]


def fields(e: Any) -> tuple[Any, ...]:
    return (
        type(e).__name__,
        tuple(e.block_hashes),
        getattr(e, "parent_block_hash", None),
        tuple(getattr(e, "token_ids", ())),
        getattr(e, "block_size", None),
        e.group_idx,
        getattr(e, "kv_cache_spec_kind", None),
        getattr(e, "kv_cache_spec_sliding_window", None),
        getattr(e, "lora_name", None),
    )


def kvtier_engine(slots: int, extra: dict[str, Any] = EXTRA) -> Engine:
    """kvtier with vLLM's KV events on and room for `slots` chunks."""
    budget = {**extra, "cpu_bytes_to_use": slots * SLOT_BYTES}
    return make_engine("KVTierConnector", budget, kv_events_config=events_config())


def a_then_b(engine: Engine) -> list[Any]:
    try:
        engine.add("a", PROMPT_A)
        engine.run_until(["a"])
        engine.add("b", PROMPT_B)
        engine.run_until(["b"])
        return host(engine)
    finally:
        engine.scheduler.shutdown()


@pytest.mark.parametrize("int_hashes", ["1", "0"])
def test_chunks_are_described_as_vllms_own_connector_describes_them(
    vllm_loaded: None, monkeypatch: pytest.MonkeyPatch, int_hashes: str
) -> None:
    # Hashes published as ints (vLLM's default) or as bytes: kvtier reads the setting once,
    # where vLLM reads it for every hash.
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", int_hashes)
    # Two chunks of two 16-token blocks each way: vLLM's pool counts its chunk bytes
    # differently, so it gets half kvtier's budget for the same two chunks.
    ours = a_then_b(kvtier_engine(2))
    theirs = a_then_b(
        offloading_connector_engine(
            {**EXTRA, "cpu_bytes_to_use": SLOT_BYTES}, kv_events_config=events_config()
        )
    )
    stored = [fields(e) for e in ours if type(e).__name__ == "BlockStored"]
    assert len(stored) == 4
    # vLLM announces one step's chunks in another order; the payloads are the same.
    assert Counter(stored) == Counter(
        fields(e) for e in theirs if type(e).__name__ == "BlockStored"
    )
    first, second = sorted(stored, key=lambda f: f[3])[:2]  # a's chunks, by their tokens
    assert first[2] is None and first[3] == tuple(PROMPT_A[:32]) and first[4] == 16
    assert second[2] == first[1][-1] and second[3] == tuple(PROMPT_A[32:64])
    assert first[6] == "full_attention"
    assert all(isinstance(h, int if int_hashes == "1" else bytes) for h in first[1])


def test_a_removal_names_every_block_of_the_chunks(vllm_loaded: None) -> None:
    engine = kvtier_engine(2)
    events = a_then_b(engine)
    removed = [e for e in events if type(e).__name__ == "BlockRemoved"]
    assert len(removed) == 1 and removed[0].group_idx == 0
    # b's two chunks evict both of a's: all four of a's block hashes, not two.
    a_hashes = [h for e in events[:2] for h in e.block_hashes]
    assert sorted(removed[0].block_hashes) == sorted(a_hashes)
    assert len(a_hashes) == 4
    side = engine.scheduler.connector.scheduler_side
    assert side._payloads is not None and len(side._payloads) == 2  # b's, held


def test_a_failed_store_announces_nothing_and_keeps_no_payload(vllm_loaded: None) -> None:
    engine = kvtier_engine(4)
    side = engine.scheduler.connector.scheduler_side
    try:
        _swap_transfer(engine, fail_stores)
        engine.add("a", PROMPT_A)
        engine.run_until(["a"])
        engine.step()  # events are taken after the step that completes the jobs
        assert host(engine) == []
        assert side._payloads is not None and len(side._payloads) == 0
    finally:
        engine.scheduler.shutdown()


def test_a_reset_removes_every_block_and_forgets_the_payloads(vllm_loaded: None) -> None:
    engine = kvtier_engine(4)
    side = engine.scheduler.connector.scheduler_side
    try:
        a = engine.add("a", PROMPT_A)
        engine.run_until(["a"])
        assert engine.scheduler.reset_prefix_cache(reset_connector=True)
        engine.step()
        last = host(engine)[-1]
        assert type(last).__name__ == "BlockRemoved"
        assert sorted(last.block_hashes) == sorted(external(list(a.block_hashes[:4])))
        assert side._payloads is not None and len(side._payloads) == 0
    finally:
        engine.scheduler.shutdown()


def test_without_the_key_a_chunk_is_announced_by_its_last_hash(vllm_loaded: None) -> None:
    engine = kvtier_engine(4, {"block_size": 32})
    events = a_then_b(engine)
    assert [len(e.block_hashes) for e in events] == [1, 1, 1, 1]
    assert all(e.token_ids == [] and e.parent_block_hash is None for e in events)


def test_the_key_without_kv_events_is_inert(
    vllm_loaded: None, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine("KVTierConnector", {**EXTRA, "cpu_bytes_to_use": 4 * SLOT_BYTES})
    try:
        side = engine.scheduler.connector.scheduler_side
        assert side._payloads is None and not side.setup.events
        engine.add("a", PROMPT_A)
        engine.run_until(["a"])
        assert side.manager.get_stats().stores == 2
    finally:
        engine.scheduler.shutdown()
