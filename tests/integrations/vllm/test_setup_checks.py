"""KVTierConnector's start-up checks against the engine vLLM builds: attention whose KV a
block hash does not identify is refused, and a bad `kv_connector_extra_config` value is
named by the key the user wrote."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine as stand_in
from engine import BLOCK_SIZE, make_engine
from test_vllm import EXTRA, vllm_loaded

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm


def prefix_lm_kv_cache_config(num_blocks: int) -> Any:
    """The KV-cache config vLLM builds for `PrefillPrefixLMAttention` layers (hrm_text): the
    decoder's full-attention spec with `non_causal=True`."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=stand_in.NUM_KV_HEADS,
        head_size=stand_in.HEAD_SIZE,
        dtype=torch.float32,
        non_causal=True,
    )
    return stand_in.make_kv_cache_config(num_blocks, spec=spec)


def test_non_causal_attention_is_refused_at_start_up(vllm_loaded: None) -> None:
    """A Prefix LM layer attends over the whole prompt both ways: the KV of a prompt's first
    block depends on the prompt's later tokens, so another prompt with the same first block
    (the same block hash) has other KV there. vLLM turns its own prefix caching off for such
    a model; kvtier, keyed by the same hashes, would serve one request's KV to the other."""
    from kvtier.config import ConfigError

    with pytest.raises(ConfigError, match=r"KV-cache group 0 is non-causal .*non_causal=True"):
        make_engine(
            "KVTierConnector",
            EXTRA,
            with_worker=False,
            kv_cache_config=prefix_lm_kv_cache_config(64),
        )


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        # vLLM's name for the chunk size, as the user wrote it (kvtier's is chunk_tokens).
        (
            {**EXTRA, "block_size": 24},
            "block_size=24 (from vLLM kv_connector_extra_config): expected a multiple of "
            "vLLM's KV block size (16 tokens), such as 32",
        ),
        # A budget too small for one chunk, named as given.
        ({"cpu_bytes_to_use": "1KiB"}, "cpu_bytes_to_use='1KiB' (from vLLM"),
        ({"cpu_bytes": 1000}, "cpu_bytes=1000 (from vLLM"),
    ],
)
def test_a_value_the_engine_refuses_is_named_by_the_users_key(
    vllm_loaded: None, extra: dict[str, Any], needle: str
) -> None:
    from kvtier.config import ConfigError

    with pytest.raises(ConfigError) as info:
        make_engine("KVTierConnector", extra, with_worker=False)
    assert needle in str(info.value)
