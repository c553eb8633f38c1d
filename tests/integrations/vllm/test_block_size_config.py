"""KVTierConnector's start-up with vLLM's chunk-size keys: `block_size` with
`blocks_per_chunk` is refused as vLLM refuses it, naming the keys the user wrote, and the
policy-plugin extra config of docs/vllm.md §2 carries over to KVTierConnector."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import make_engine
from test_vllm import EXTRA, vllm_loaded

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm


@pytest.mark.parametrize("blocks", [1, 2, 4])
def test_block_size_with_blocks_per_chunk_is_refused_naming_both_keys(
    vllm_loaded: None, blocks: int
) -> None:
    """It was refused naming `chunk_tokens` (a key the user did not write) and no source, and
    blocks_per_chunk=1 was silently overridden; vLLM 0.33 refuses both keys together."""
    from kvtier.config import ConfigError

    extra = {**EXTRA, "block_size": 64, "blocks_per_chunk": blocks}
    with pytest.raises(ConfigError) as info:
        make_engine("KVTierConnector", extra, with_worker=False)
    assert str(info.value).startswith(
        f"block_size=64 (from vLLM kv_connector_extra_config) and blocks_per_chunk={blocks} "
        "(from vLLM kv_connector_extra_config): expected only one of them to be set"
    )


@pytest.mark.parametrize(
    ("extra", "blocks_per_chunk"),
    [({"block_size": 64}, 4), ({"blocks_per_chunk": 2}, 2), ({}, 1)],
)
def test_either_key_alone_sizes_the_chunk(
    vllm_loaded: None, extra: dict[str, Any], blocks_per_chunk: int
) -> None:
    engine = make_engine("KVTierConnector", {**EXTRA, **extra}, with_worker=False)
    try:
        setup = engine.scheduler.connector.scheduler_side.setup
        assert setup.blocks_per_chunk == blocks_per_chunk
    finally:
        engine.scheduler.shutdown()


def test_the_policy_plugin_config_runs_kvtiers_policy(vllm_loaded: None) -> None:
    from kvtier.config import KVTierConfig
    from kvtier.integrations.vllm import policy

    name = policy.PREFIX + "arc"
    extra = {
        "cpu_bytes_to_use": 8 << 20,
        "cache_policy_module_path": policy.__name__,
        "eviction_policy": name,
    }
    # The class vLLM would load wraps the policy the connector is then configured with.
    assert getattr(policy, name).policy.name == "arc"
    assert KVTierConfig.from_vllm_extra_config(extra).cache_policy == "arc"
    engine = make_engine("KVTierConnector", extra, with_worker=False)
    try:
        assert engine.scheduler.connector.scheduler_side.setup.config.cache_policy == "arc"
    finally:
        engine.scheduler.shutdown()
