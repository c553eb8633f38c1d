"""A request preempted after generating output reloads every chunk kvtier holds for it, its
generated tokens' chunks too, as vLLM's own prefix cache and OffloadingConnector do (they cap
a resumed request's hit at its token count less one, not at its prompt)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import BLOCK_SIZE, make_engine
from test_vllm import assert_no_leaks, expect_loaded, kvtier_side, step_until_running, vllm_loaded

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm


def test_a_preempted_request_reloads_its_generated_chunks(vllm_loaded: None) -> None:
    """With offload_prompt_only=False the generated tokens' chunks are stored; once vLLM
    preempts the request and its device blocks are gone, those chunks are loaded back, not
    recomputed (before: only the 32 tokens of the 40-token prompt's full chunks)."""
    engine = make_engine(
        "KVTierConnector", {"cpu_bytes_to_use": "8MiB", "offload_prompt_only": False}
    )
    a = engine.add("a", list(range(1, 41)), max_tokens=80)
    while a.num_output_tokens < 60:
        engine.step()
    side = kvtier_side(engine)
    assert a.num_tokens == 100 and side.manager.get_stats().stores == 6
    assert engine.scheduler.reset_prefix_cache(reset_running_requests=True)
    assert a.num_preemptions == 1
    for t in engine.kv_caches.values():
        t.zero_()  # only a load from kvtier can bring the bytes back

    loaded = side._loaded_tokens
    step_until_running(engine, "a")
    # Every full chunk of the 99 computed tokens: 6 blocks, 96 tokens.
    assert side._loaded_tokens - loaded == 6 * BLOCK_SIZE
    expect_loaded(engine, "a", list(a.all_token_ids), 6 * BLOCK_SIZE)
    engine.run_until(["a"])
    assert_no_leaks(engine)
    engine.worker.shutdown()


def test_a_preempted_request_still_stores_only_its_prompt_with_offload_prompt_only(
    vllm_loaded: None,
) -> None:
    """The resumed request's lookups reach its generated tokens, but offload_prompt_only still
    keeps their chunks out of the tier: the lookup limit is not where stores stop."""
    engine = make_engine("KVTierConnector", {"cpu_bytes_to_use": "8MiB"})
    a = engine.add("a", list(range(1, 41)), max_tokens=80)
    while a.num_output_tokens < 60:
        engine.step()
    side = kvtier_side(engine)
    assert side.manager.get_stats().stores == 2  # the prompt's full chunks only
    assert engine.scheduler.reset_prefix_cache(reset_running_requests=True)
    loaded = side._loaded_tokens
    step_until_running(engine, "a")
    assert side._loaded_tokens - loaded == 2 * BLOCK_SIZE
    engine.run_until(["a"])
    assert side.manager.get_stats().stores == 2
    assert_no_leaks(engine)
    engine.worker.shutdown()
