"""KVTierConnector with vLLM's `RSWASpec` (reference sliding-window attention) through the
real vLLM Scheduler: vLLM's RSWAManager frees a running request's generated-token blocks
once they fall out of the window, so kvtier offloads the prompt only, and refuses
`offload_prompt_only: false` at start-up."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine as stand_in
from engine import BLOCK_SIZE, Engine, make_engine
from test_streaming_input import add_input, finish_turn
from test_vllm import (
    EXTRA,
    MODULE,
    assert_no_leaks,
    expect_loaded,
    gate,
    kvtier_side,
    step_until_running,
    vllm_loaded,
)

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm

WINDOW = 16  # rswa_window: generated tokens older than this leave the device
PROMPT = list(range(1, 41))  # 40 tokens: blocks 0-1 full, block 2 holds 8 prompt tokens


def rswa_kv_cache_config(num_blocks: int) -> Any:
    """One KV-cache group of `RSWASpec` layers, each layer its own tensor."""
    from vllm.v1.kv_cache_interface import RSWASpec

    spec = RSWASpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=stand_in.NUM_KV_HEADS,
        head_size=stand_in.HEAD_SIZE,
        dtype=torch.float32,
        rswa_window=WINDOW,
    )
    return stand_in.make_kv_cache_config(num_blocks, spec=spec)


def make_rswa_engine(extra: Mapping[str, Any], num_gpu_blocks: int = 64) -> Engine:
    """engine.make_engine with an RSWASpec group (vLLM picks its RSWAManager for it)."""
    from vllm.v1.core.single_type_kv_cache_manager import RSWAManager

    engine = make_engine(
        "KVTierConnector",
        extra,
        num_gpu_blocks=num_gpu_blocks,
        module_path=MODULE,
        kv_cache_config=rswa_kv_cache_config(num_gpu_blocks),
    )
    managers = engine.scheduler.kv_cache_manager.coordinator.single_type_managers
    assert [type(m) for m in managers] == [RSWAManager]
    return engine


def null_block_id(engine: Engine) -> int:
    return int(engine.scheduler.kv_cache_manager.block_pool.null_block.block_id)


def decode_past_the_window(engine: Engine, request: Any, until: int) -> None:
    """Step until `request` computed `until` tokens; vLLM has by then freed blocks 3 and 4
    (generated tokens 48-79, behind the window) and put its null block in their place."""
    while request.num_computed_tokens < until:
        engine.step(settle=False)
    table = engine.scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]
    null = null_block_id(engine)
    assert table[3] == table[4] == null
    assert null not in table[:3]


def loads_back(engine: Engine, tokens: list[int], num_blocks: int) -> None:
    """Forget everything on the device; a request with `tokens` loads `num_blocks` blocks
    from kvtier, byte for byte."""
    assert engine.scheduler.reset_prefix_cache()
    for t in engine.kv_caches.values():
        t.zero_()
    b = engine.add("b", tokens)
    engine.step()
    assert b.num_computed_tokens == num_blocks * BLOCK_SIZE
    step_until_running(engine, "b")
    expect_loaded(engine, "b", tokens, num_blocks * BLOCK_SIZE)
    engine.run_until(["b"])


def test_offload_prompt_only_false_is_refused_at_start_up(vllm_loaded: None) -> None:
    """Stores of generated tokens would race vLLM freeing their blocks (measured before the
    refusal: the blocks behind the window were stored from vLLM's null block, and a later
    request loaded those bytes), so the configuration fails when the engine starts."""
    from kvtier.config import ConfigError

    needle = r"group 0 uses RSWASpec .* and offload_prompt_only=False"
    with pytest.raises(ConfigError, match=needle):
        make_rswa_engine({**EXTRA, "offload_prompt_only": False})


def test_prompt_is_offloaded_while_the_window_frees_output_blocks(vllm_loaded: None) -> None:
    """The prompt's full blocks are stored and load back byte for byte, though the request's
    stores were held until vLLM had freed its blocks behind the window."""
    engine = make_rswa_engine(EXTRA)
    opened = gate(engine)
    a = engine.add("a", PROMPT, max_tokens=80)
    decode_past_the_window(engine, a, until=100)
    opened.set()
    engine.run_until(["a"])
    assert kvtier_side(engine).manager.get_stats().stores == 2
    tokens = list(a.all_token_ids)
    loads_back(engine, [*tokens[:100], 5], 2)
    assert_no_leaks(engine)


def test_streaming_session_offloads_no_freed_block(vllm_loaded: None) -> None:
    """A streaming session's next input makes the previous turn's output prompt, blocks
    vLLM freed behind the window included: kvtier keeps the first turn's prompt as the
    bound under RSWA, and never stores the null block in their place."""
    engine = make_rswa_engine(EXTRA)
    session = add_input(engine, "s", PROMPT, max_tokens=70)
    decode_past_the_window(engine, session, until=100)
    finish_turn(engine, session)
    add_input(engine, "s", list(range(300, 310)), max_tokens=4)
    assert session.num_prompt_tokens > 6 * BLOCK_SIZE
    finish_turn(engine, session)
    assert kvtier_side(engine).manager.get_stats().stores == 2
    prompt = list(session.prompt_token_ids)
    add_input(engine, "s", [0], resumable=False)
    for _ in range(5):
        engine.step()
    loads_back(engine, [*prompt, 5], 2)
    assert_no_leaks(engine)
