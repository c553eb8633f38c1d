"""kvaware behind vLLM 0.33's real Scheduler with chunked prefill (`max_num_batched_tokens` of
two blocks): request "a"'s 8-block prompt is stored two blocks a step into an 8-slot tier,
request "b" then stores 2 new chunks, and a request with a's prompt, none of it left on the
device, loads what is left of it. The victims must be a's last two chunks: 6 blocks load."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import BLOCK_SIZE, make_engine
from test_vllm import load_back, vllm_loaded

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm

A_PROMPT = list(range(1, 8 * BLOCK_SIZE + 2))  # 8 full blocks and one token
B_PROMPT = list(range(3000, 3000 + 2 * BLOCK_SIZE + 1))


@pytest.mark.parametrize("release", [True, False], ids=["released", "held"])
def test_kvaware_keeps_the_head_of_a_prompt_prefilled_in_steps(
    vllm_loaded: None, release: bool
) -> None:
    """Fails on the old source: kvaware ignored `prefix_extended` and applied the
    deepest-block rule to each step's last chunk, so b's stores evicted chunks from a's head
    and middle: 2 blocks loaded."""
    extra = {"num_slots": 8, "release_finished_blocks": release, "cache_policy": "kvaware"}
    engine = make_engine("KVTierConnector", extra, max_num_batched_tokens=2 * BLOCK_SIZE)
    engine.add("a", A_PROMPT, max_tokens=4)
    engine.run_until(["a"])
    steps = [len(so.kv_connector_metadata.step.stores) for so in engine.outputs]
    assert steps[:4] == [1, 1, 1, 1]  # a's prompt, two chunks a step
    engine.add("b", B_PROMPT)
    engine.run_until(["b"])
    assert load_back(engine, "d", [*A_PROMPT[:-1], 900]) == 6 * BLOCK_SIZE
