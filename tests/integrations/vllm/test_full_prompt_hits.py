"""Through vLLM's real scheduler: a prompt that fills its last chunk loads that chunk too (vLLM
recomputes the last token of a full hit loaded asynchronously, as its own OffloadingConnector
relies on), and a request that must compute its whole prompt (prompt logprobs) looks nothing
up in the tier."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import BLOCK_SIZE, Engine, make_engine
from test_vllm import (
    assert_no_leaks,
    expect_loaded,
    kvtier_side,
    offloading_connector_engine,
    step_until_running,
    vllm_loaded,
)

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm

FULL = list(range(1, 4 * BLOCK_SIZE + 1))  # 64 tokens: exactly 4 full blocks


def _store_then_forget(engine: Engine, prompt: list[int]) -> None:
    engine.add("a", prompt)
    engine.run_until(["a"])
    assert engine.scheduler.reset_prefix_cache()
    for t in engine.kv_caches.values():
        t.zero_()  # only a load from kvtier can bring the bytes back


def test_a_prompt_of_whole_blocks_loads_every_block(vllm_loaded: None) -> None:
    """Before, the hit stopped a token short of the prompt: 3 of the 4 blocks were loaded and
    the fourth recomputed, although the tier held it."""
    engine = make_engine("KVTierConnector", {"cpu_bytes_to_use": "8MiB"})
    _store_then_forget(engine, FULL)
    side = kvtier_side(engine)
    assert side.manager.get_stats().stores == 4
    b = engine.add("b", FULL, max_tokens=3)
    engine.step()
    assert b.status.name == "WAITING_FOR_REMOTE_KVS"
    assert b.num_computed_tokens == len(FULL)
    step_until_running(engine, "b")
    # vLLM rewound the full hit by one token: its first step recomputes that token alone, to
    # sample from its logits.
    assert engine.outputs[-1].num_scheduled_tokens == {"b": 1}
    expect_loaded(engine, "b", FULL, len(FULL))
    engine.run_until(["b"])
    assert b.num_output_tokens == 3
    assert side.manager.get_stats().loads == 4
    assert_no_leaks(engine)
    engine.worker.shutdown()


def test_the_hit_matches_vllms_own_offloading_connector(vllm_loaded: None) -> None:
    """The same flow with vLLM's OffloadingConnector (its worker needs a GPU, so jobs complete
    at once): it too serves every block of a prompt of whole blocks."""
    engine = offloading_connector_engine({"cpu_bytes_to_use": 1 << 20})
    engine.add("a", FULL)
    engine.run_until(["a"])
    assert engine.scheduler.reset_prefix_cache()
    b = engine.add("b", FULL)
    engine.step()
    assert b.num_computed_tokens == len(FULL)


def test_a_request_with_prompt_logprobs_looks_nothing_up(vllm_loaded: None) -> None:
    """vLLM computes such a request's whole prompt and drops any offer; looked up, its chunks
    counted as hits in the tier's stats (and as uses, for the cache policy) with nothing
    served."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    engine = make_engine("KVTierConnector", {"cpu_bytes_to_use": "8MiB"})
    prompt = [*FULL, 900]
    _store_then_forget(engine, prompt)
    side = kvtier_side(engine)
    before = side.manager.get_stats()
    params = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    assert params.skip_reading_prefix_cache
    b = Request(
        "b", prompt, params, None, block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256)
    )
    engine.scheduler.add_request(b)
    engine.run_until(["b"])
    after = side.manager.get_stats()
    assert (after.hits, after.misses, after.loads) == (before.hits, before.misses, before.loads)
    assert side._loaded_tokens == 0
    assert_no_leaks(engine)
    engine.worker.shutdown()
