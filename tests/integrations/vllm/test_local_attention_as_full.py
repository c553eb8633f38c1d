"""KVTierConnector on a model whose sliding-window layers vLLM allocates as full attention.

With the hybrid KV-cache manager off (or page sizes it cannot unify), vLLM's planner promotes
sliding-window layers to one `FullAttentionSpec` group that carries `sliding_window`: every
token's KV stays in its blocks and vLLM's prefix cache serves them by hash. kvtier must offload
that group as full attention, not refuse it at start-up."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import (
    BLOCK_SIZE,
    HEAD_SIZE,
    NUM_KV_HEADS,
    NUM_LAYERS,
    Engine,
    make_engine,
    make_vllm_config,
    token_value,
)
from test_vllm import EXTRA, MODULE, PROMPT, vllm_loaded

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm


def hybrid_manager_off(vllm_config: Any) -> None:
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = True


def _promoted_engine(num_blocks: int = 64) -> Engine:
    """The real Scheduler and a worker-side connector on the KV-cache config vLLM's own
    planner builds for one full and one 32-token sliding-window layer, hybrid manager off."""
    import torch
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheTensor,
        SlidingWindowSpec,
    )

    vllm_config = make_vllm_config("KVTierConnector", EXTRA, num_blocks, MODULE)
    hybrid_manager_off(vllm_config)
    shape: dict[str, Any] = {
        "block_size": BLOCK_SIZE,
        "num_kv_heads": NUM_KV_HEADS,
        "head_size": HEAD_SIZE,
        "dtype": torch.float32,
    }
    names = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    specs: dict[str, Any] = {
        names[0]: FullAttentionSpec(**shape),
        names[1]: SlidingWindowSpec(**shape, sliding_window=32),
    }
    groups = get_kv_cache_groups(vllm_config, specs)
    assert len(groups) == 1
    spec = groups[0].kv_cache_spec
    assert type(spec) is FullAttentionSpec and spec.sliding_window == 32  # vLLM's promotion
    page = spec.page_size_bytes
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=page * num_blocks, layers=[n], layer_stride=0, block_stride=page)
            for n in names
        ],
        kv_cache_groups=groups,
    )
    return make_engine(
        "KVTierConnector",
        EXTRA,
        num_gpu_blocks=num_blocks,
        kv_cache_config=kv_cache_config,
        configure=hybrid_manager_off,
    )


def test_sliding_window_layers_vllm_allocates_as_full_attention_are_offloaded(
    vllm_loaded: None,
) -> None:
    engine = _promoted_engine()
    engine.add("a", PROMPT)
    engine.run_until(["a"])
    side = engine.scheduler.connector.scheduler_side
    assert side.manager.get_stats().stores == 4
    assert engine.scheduler.reset_prefix_cache()
    for t in engine.kv_caches.values():
        t.zero_()  # only a load from kvtier can bring the bytes back

    tokens = [*PROMPT, 900, 901]
    b = engine.add("b", tokens)
    engine.step()
    assert b.status.name == "WAITING_FOR_REMOTE_KVS"
    assert b.num_computed_tokens == 4 * BLOCK_SIZE
    engine.step()  # the load completes and b is scheduled
    table = engine.scheduler.kv_cache_manager.get_block_ids("b")
    for name, t in engine.kv_caches.items():
        layer = int(name.split(".")[2])
        for p in range(4 * BLOCK_SIZE):
            got = t[table[0][p // BLOCK_SIZE], :, p % BLOCK_SIZE, :]
            assert bool((got == token_value(tokens, p, layer)).all()), (name, p)
    engine.run_until(["a", "b"])
    assert side.scheduler.num_jobs_in_flight() == 0
    assert side.manager.get_stats().pinned == 0
