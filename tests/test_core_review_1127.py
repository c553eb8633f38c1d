"""Review of the core modules (config, hashing): defects found and fixed on 2026-11-27."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvtier.config import ConfigError, KVTierConfig
from kvtier.hashing import BlockHasher


def test_an_abstract_cache_policy_class_is_a_config_error_naming_key_and_source() -> None:
    # It was accepted, and the manager's constructor then failed with "Can't instantiate
    # abstract class", naming neither the key nor where it was set.
    env = {"KVTIER_CACHE_POLICY": "kvtier.policies:CachePolicy"}
    with pytest.raises(ConfigError, match=r"KVTIER_CACHE_POLICY=.*\(from environment\).*abstract"):
        KVTierConfig.load(env=env)
    with pytest.raises(ConfigError, match=r"cache_policy=.*\(from dict\).*without .*evict"):
        KVTierConfig.from_dict({"cache_policy": "kvtier.policies.base:CachePolicy"})


def test_a_concrete_cache_policy_class_path_is_still_accepted() -> None:
    spec = "kvtier.policies.lru:LRUPolicy"
    assert KVTierConfig.from_dict({"cache_policy": spec}).cache_policy == spec


@pytest.mark.parametrize(
    "tokens",
    [
        [np.timedelta64(1), np.timedelta64(2)],  # hashed as the token ids [1, 2]
        [np.timedelta64(1, "h"), np.timedelta64(2, "ms")],
        np.array([1, 2], dtype="m8[s]"),
    ],
)
def test_timedelta_token_ids_are_refused_not_hashed_as_ints(tokens: Any) -> None:
    with pytest.raises(TypeError, match="timedelta64"):
        BlockHasher(2).hash_blocks(tokens)


def test_integer_token_ids_of_every_kind_still_hash_alike() -> None:
    hasher = BlockHasher(2)
    want = hasher.hash_blocks([1, 2])
    cases: list[Any] = [[np.uint64(1), np.int64(2)], np.array([1, 2], dtype=np.uint16), (1, 2)]
    for tokens in cases:
        assert hasher.hash_blocks(tokens) == want


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("KVTIER_NATIVECOPY", "KVTIER_NATIVE_COPY"),  # was told 'KVTIER_CPU_BYTES'
        ("KVTIER_PORTABLE_COPPY", "KVTIER_PORTABLE_COPY"),  # was told 'KVTIER_TRANSFER_CPUS'
        ("KVTIER_CACHEDIR", "KVTIER_CACHE_DIR"),  # was told 'KVTIER_CACHE_POLICY'
        ("KVTIER_WITH_VLM", "KVTIER_WITH_VLLM"),
    ],
)
def test_a_typo_of_a_variable_that_is_no_setting_is_pointed_at_that_variable(
    typo: str, meant: str
) -> None:
    with pytest.raises(ConfigError, match=rf"{typo}='0' \(from environment\): unknown key") as info:
        KVTierConfig.load(env={typo: "0"})
    message = str(info.value)
    assert f"did you mean {meant!r}?" in message
    assert message.endswith(meant) or f"{meant}," in message  # and it is listed


def test_a_typo_of_a_setting_is_still_pointed_at_the_setting() -> None:
    with pytest.raises(ConfigError, match="did you mean 'KVTIER_STORE_THRESHOLD'"):
        KVTierConfig.load(env={"KVTIER_STORE_TRESHOLD": "2"})
