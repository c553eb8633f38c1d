"""The store retry through vLLM 0.33's real Scheduler: a request whose store finds the host tier
full of stores still being written is stored once they end, from the block table vLLM holds
then, and a later request loads the right bytes from it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import BLOCK_SIZE, make_engine
from test_vllm import (
    PROMPT,
    assert_no_leaks,
    expect_loaded,
    gate,
    kvtier_side,
    step_until_running,
    vllm_loaded,
)

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm

C_PROMPT = list(range(500, 550))  # 50 tokens: 3 full blocks


def test_a_store_turned_away_while_the_tier_is_being_written_is_stored_later(
    vllm_loaded: None,
) -> None:
    engine = make_engine("KVTierConnector", {"num_slots": 4})
    side = kvtier_side(engine)
    opened = gate(engine)
    try:
        engine.add("a", PROMPT)  # 4 full blocks: a's stores take every slot, held at the gate
        engine.add("c", C_PROMPT, max_tokens=12)
        for _ in range(4):
            engine.step(settle=False)
        stats = side.manager.get_stats()
        assert stats.pending_writes == 4 and stats.stores_no_room >= 3
        assert not any(
            j.req_id == "c" for so in engine.outputs for j in so.kv_connector_metadata.step.stores
        )
    finally:
        opened.set()
    engine.run_until(["a", "c"])
    c_stores = [
        j for so in engine.outputs for j in so.kv_connector_metadata.step.stores if j.req_id == "c"
    ]
    assert len(c_stores) == 1, "c's chunks were not offered again once a's stores ended"
    assert engine.scheduler.reset_prefix_cache()
    for t in engine.kv_caches.values():
        t.zero_()  # only a load from kvtier can bring c's bytes back
    d_prompt = [*C_PROMPT, 900]
    engine.add("d", d_prompt)
    step_until_running(engine, "d")
    expect_loaded(engine, "d", d_prompt, 3 * BLOCK_SIZE)
    engine.run_until(["d"])
    assert_no_leaks(engine)
