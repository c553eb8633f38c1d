"""KVTierGenerator with a cpu_bytes too small for one host slot: a ConfigError naming the
setting as the user gave it, as the vLLM connector's start-up check does."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.config import ConfigError, KVTierConfig
from kvtier.integrations.hf.generator import KVTierGenerator
from kvtier.integrations.hf.models import make_demo_model

BS = 16
SMALL = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}


@pytest.fixture(scope="module")
def model() -> Any:
    return make_demo_model("llama", seed=4, **SMALL)[0]


def _slot_bytes(model: Any, blocks_per_chunk: int) -> int:
    with KVTierGenerator(
        model, KVTierConfig(num_slots=1, blocks_per_chunk=blocks_per_chunk), block_size=BS
    ) as gen:
        return int(gen.pool.slot_bytes)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (
            KVTierConfig.load(env={"KVTIER_CPU_BYTES": "1KiB"}),
            "KVTIER_CPU_BYTES=1024 (from environment)",
        ),
        (KVTierConfig.from_dict({"cpu_bytes": 1000}), "cpu_bytes=1000 (from dict)"),
        (KVTierConfig(cpu_bytes=1), "cpu_bytes=1 (from KVTierConfig())"),
    ],
)
def test_a_budget_below_one_slot_is_a_config_error_naming_cpu_bytes(
    model: Any, config: KVTierConfig, named: str
) -> None:
    """It was a bare ValueError naming HostPool's `byte_budget`, a name the user never wrote."""
    slot = _slot_bytes(model, 1)
    with pytest.raises(ConfigError) as info:
        KVTierGenerator(model, config, block_size=BS, max_blocks=8)
    assert str(info.value) == (
        f"{named} holds no slot of {slot} bytes (1 blocks x {slot} bytes); "
        f"expected at least {slot} bytes"
    )


def test_the_slot_counts_every_block_of_a_chunk(model: Any) -> None:
    slot = _slot_bytes(model, 2)
    config = KVTierConfig(cpu_bytes=slot - 1, blocks_per_chunk=2)
    with pytest.raises(ConfigError, match=rf"holds no slot of {slot} bytes \(2 blocks x"):
        KVTierGenerator(model, config, block_size=BS, max_blocks=8)
    with KVTierGenerator(
        model, KVTierConfig(cpu_bytes=slot, blocks_per_chunk=2), block_size=BS
    ) as gen:
        assert gen.pool.num_slots == 1
