"""The host tier's size on the scheduler for a KV-cache group whose layers differ in page size.

vLLM groups such layers in one `UniformTypeKVCacheSpecs` on the workers, but gives the
scheduler one layer's spec in its place (`generate_scheduler_kv_cache_config`). The scheduler
half must still size `cpu_bytes_to_use` by the workers' bytes per block, or it hands out more
slots than the workers' pools hold (each worker then grows its pool past the budget) or
fewer (the rest of the budget lies idle)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import BLOCK_SIZE, HEAD_SIZE, make_engine, make_vllm_config
from test_vllm import EXTRA, MODULE, vllm_loaded

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm


def _worker_config(vllm_config: Any, heads: list[int]) -> Any:
    """vLLM's own planning of layers with `heads` KV heads each: one group, uniform type."""
    import torch
    from vllm.v1.core.kv_cache_planning import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs

    specs: dict[str, Any] = {
        f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=h, head_size=HEAD_SIZE, dtype=torch.float32
        )
        for i, h in enumerate(heads)
    }
    groups = get_kv_cache_groups(vllm_config, specs)
    assert len(groups) == 1 and isinstance(groups[0].kv_cache_spec, UniformTypeKVCacheSpecs)
    page = sum(s.page_size_bytes for s in specs.values())
    return get_kv_cache_config_from_groups(vllm_config, groups, 64 * page)


@pytest.mark.parametrize("heads", [[4, 2, 2], [2, 2, 4]])
def test_scheduler_sizes_the_tier_by_the_workers_pages(vllm_loaded: None, heads: list[int]) -> None:
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    from kvtier.integrations.vllm.setup import resolve_setup

    vllm_config = make_vllm_config("KVTierConnector", EXTRA, 64, MODULE)
    vllm_config.cache_config.kv_cache_layout = "LBHNC"  # the layout kvtier asks vLLM for
    worker_config = _worker_config(vllm_config, heads)
    worker = resolve_setup(vllm_config, worker_config)  # as each worker's connector does
    page = sum(h * BLOCK_SIZE * 2 * HEAD_SIZE * 4 for h in heads)
    assert worker.page_bytes == (page,)

    def layout(config: Any) -> None:
        config.cache_config.kv_cache_layout = "LBHNC"

    # The real Scheduler builds the scheduler-side connector from the config vLLM gives it.
    engine = make_engine(
        "KVTierConnector",
        EXTRA,
        kv_cache_config=generate_scheduler_kv_cache_config([worker_config]),
        with_worker=False,
        configure=layout,
    )
    scheduler = engine.scheduler.connector.scheduler_side.setup
    assert scheduler.page_bytes == worker.page_bytes
    assert scheduler.num_slots == worker.num_slots
