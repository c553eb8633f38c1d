"""Review of overlapping store jobs of one request (#1137) behind vLLM 0.33's real Scheduler:
a connector reset (`reset_prefix_cache(reset_connector=True)`, which resets the connector even
while requests run) with a running request's store in flight. The request's next step plans
its chunks again beside that store, and the host tier, short of the slots the old store still
uses (quarantined until it ends), has no room for them: the offer was dropped for good, as if
it could never fit, and the prompt was never stored."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import BLOCK_SIZE, make_engine
from test_prefix_extended_review_1136 import _slow_stores
from test_vllm import (
    _swap_transfer,
    kvtier_side,
    load_back,
    vllm_loaded,
)

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm

PROMPT = list(range(1, 8 * BLOCK_SIZE + 2))  # 8 full blocks and one token: 3 prefill steps


@pytest.mark.parametrize("release", [True, False], ids=["released", "held"])
def test_a_connector_reset_beside_a_running_requests_store_loses_no_chunk(
    vllm_loaded: None, release: bool
) -> None:
    """A tier of 8 slots (one block a chunk), chunked prefill of 4 blocks a step, every store
    starting 0.5 s late (reported the step after it was submitted). Step 1 stores chunks
    0-3; the connector is reset; step 2 (chunks 4-7 computed) plans chunks 0-7 beside step
    1's store, whose 4 slots are quarantined: no room for 8. On the old source step 2 stored
    nothing (a's store was in flight) and step 3, once it had ended, stored all 8 chunks. With
    stores overlapping, the offer was dropped as 'can never fit' (the quarantined slots were
    counted as room) and a later request with the prompt loaded nothing."""
    extra = {"num_slots": 8, "release_finished_blocks": release}
    engine = make_engine("KVTierConnector", extra, max_num_batched_tokens=4 * BLOCK_SIZE)
    _swap_transfer(engine, _slow_stores)  # step 1's store is surely in flight at the reset
    engine.add("a", PROMPT, max_tokens=4)
    engine.step()
    assert len(engine.outputs[0].kv_connector_metadata.step.stores) == 1
    # vLLM cannot reset its own prefix cache while "a" runs; the connector's is reset anyway.
    assert not engine.scheduler.reset_prefix_cache(reset_connector=True)
    engine.run_until(["a"])
    assert kvtier_side(engine).manager.get_stats().ready == 8, (
        f"a's prompt was not stored after the reset: {kvtier_side(engine).manager.get_stats()}"
    )
    loaded = load_back(engine, "d", [*PROMPT[:-1], 900])
    assert loaded == 8 * BLOCK_SIZE
