"""Keys of vLLM's own OffloadingConnector for features kvtier lacks (secondary tiers, a shared
host layout, same-step loads): accepted when they ask for nothing, refused by name otherwise,
never "unknown key" (which reads like a typo to someone moving a config from vLLM's
connector), and never silently dropped while asking for a tier."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvtier.config import ConfigError, KVTierConfig

BASE = {"num_slots": 8}


@pytest.mark.parametrize(
    "extra",
    [
        {"secondary_tiers": []},
        {"canonical_layout": False},
        {"canonical_layout": 0},
        {"enable_telemetry": None},
        {"sync_load_budget_bytes": 0},
        {"sync_load_budget_bytes": 0.0},
        # Inert: they tune only secondary tiers.
        {"tier_poll_interval_s": 0.5},
        {"backpressure": {"high_water_mark": 0.9}},
    ],
    ids=repr,
)
def test_values_that_ask_for_nothing_are_accepted_and_change_nothing(
    extra: dict[str, object],
) -> None:
    assert KVTierConfig.from_vllm_extra_config({**BASE, **extra}) == (
        KVTierConfig.from_vllm_extra_config(BASE)
    )


@pytest.mark.parametrize(
    ("extra", "feature"),
    [
        ({"secondary_tiers": [{"type": "fs", "path": "/mnt/kv"}]}, "secondary tiers"),
        ({"secondary_tiers": None}, "secondary tiers"),
        ({"canonical_layout": True}, "shared host layout"),
        ({"enable_telemetry": "yes"}, "telemetry"),
        ({"sync_load_budget_bytes": 1 << 30}, "same-step loads"),
    ],
    ids=repr,
)
def test_values_that_ask_for_a_missing_feature_are_refused_by_name(
    extra: dict[str, object], feature: str
) -> None:
    with pytest.raises(ConfigError) as info:
        KVTierConfig.from_vllm_extra_config({**BASE, **extra})
    message = str(info.value)
    (key,) = extra
    assert message.startswith(f"{key}=")
    assert feature in message and "kvtier does not have" in message
    assert "unknown key" not in message and "OffloadingConnector" in message


def test_they_are_vllm_keys_only() -> None:
    """kvtier's own layers do not take them: they are vLLM's names, not kvtier settings."""
    with pytest.raises(ConfigError, match=r"secondary_tiers=\[\] \(from dict\): unknown key"):
        KVTierConfig.from_dict({**BASE, "secondary_tiers": []})


def test_a_misspelt_one_is_pointed_at_the_real_name() -> None:
    with pytest.raises(ConfigError, match="did you mean 'secondary_tiers'"):
        KVTierConfig.from_vllm_extra_config({**BASE, "secondary_tier": []})


def test_each_key_is_one_vllm_033_reads() -> None:
    """Guards against a stale list: every key named here is read from the extra config by the
    installed vLLM's offloading code."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    root = Path(spec.origin).parent
    sources = [
        p.read_text(encoding="utf-8")
        for sub in ("v1/kv_offload", "distributed/kv_transfer/kv_connector/v1/offloading")
        for p in (root / sub).rglob("*.py")
    ]
    with pytest.raises(ConfigError) as info:
        KVTierConfig.from_vllm_extra_config({"nope": 1})
    listed = str(info.value).split("expected one of: ")[1].split(", ")
    vllm_only = [
        "secondary_tiers",
        "tier_poll_interval_s",
        "backpressure",
        "enable_telemetry",
        "canonical_layout",
        "sync_load_budget_bytes",
    ]
    for key in vllm_only:
        assert key in listed
        assert any(f'get("{key}"' in text for text in sources), key
