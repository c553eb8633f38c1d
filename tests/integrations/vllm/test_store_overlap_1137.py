"""A request's stores of successive steps overlap, behind vLLM 0.33's real Scheduler with
chunked prefill (`max_num_batched_tokens` of two blocks) and every store reported one step
late. With one output token vLLM finishes a request in the step of its last prefill chunk,
before it reads that step's transfer results: chunks computed in a step whose build found an
earlier store of the request still in flight were never stored once the connector allowed
one set of stores per request."""

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
    load_back,
    vllm_loaded,
)

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm

PROMPT = list(range(1, 8 * BLOCK_SIZE + 1))  # 8 full blocks: prefilled in 4 steps


@pytest.mark.parametrize("release", [True, False], ids=["released", "held"])
def test_a_prompt_ending_beside_its_store_in_flight_is_stored_whole(
    vllm_loaded: None, release: bool
) -> None:
    """Fails on the old source: steps 2 and 4 stored nothing (step 1's, then step 3's store
    was in flight), step 3 stored chunks 2-5, and chunks 6-7, computed in step 4, were lost
    with the request: a later request with the same prompt loaded 6 blocks, not 8."""
    extra = {"num_slots": 16, "release_finished_blocks": release}
    engine = make_engine("KVTierConnector", extra, max_num_batched_tokens=2 * BLOCK_SIZE)
    _swap_transfer(engine, _slow_stores)
    engine.add("a", PROMPT, max_tokens=1)
    engine.run_until(["a"])
    steps = [len(so.kv_connector_metadata.step.stores) for so in engine.outputs]
    assert steps[:4] == [1, 1, 1, 1]
    loaded = load_back(engine, "d", [*PROMPT, 900])
    assert loaded == 8 * BLOCK_SIZE
