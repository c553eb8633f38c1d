"""One setting, one meaning in every layer: an explicit blocks_per_chunk beside chunk_tokens,
YAML 1.1 integer forms, a file named by KVTIER_CONFIG, vLLM's policy-plugin extra config, a
single CPU id and `_` digit groups in sizes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.config import ConfigError, KVTierConfig, parse_size

# --- blocks_per_chunk and chunk_tokens -------------------------------------------------------


@pytest.mark.parametrize("blocks", [1, 2, 16])
def test_blocks_per_chunk_beside_chunk_tokens_is_refused_even_an_explicit_1(blocks: int) -> None:
    """blocks_per_chunk=1 was the default, so an explicit 1 was silently overridden by
    chunk_tokens (resolve gave 16); vLLM refuses block_size with blocks_per_chunk."""
    with pytest.raises(ConfigError) as info:
        KVTierConfig.from_dict({"chunk_tokens": 256, "blocks_per_chunk": blocks})
    assert str(info.value) == (
        f"chunk_tokens=256 (from dict) and blocks_per_chunk={blocks} (from dict): expected only "
        "one of them to be set (both size a chunk: in tokens and in device blocks)"
    )
    with pytest.raises(ConfigError, match=r"\(from KVTierConfig\(\)\)"):
        KVTierConfig(chunk_tokens=256, blocks_per_chunk=blocks)


def test_the_refusal_names_each_layer_and_a_later_layer_may_clear_one(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text("chunk_tokens: 256\n")
    with pytest.raises(ConfigError) as info:
        KVTierConfig.load(path, env={"KVTIER_BLOCKS_PER_CHUNK": "1"})
    message = str(info.value)
    assert f"chunk_tokens=256 (from file {path})" in message
    assert "KVTIER_BLOCKS_PER_CHUNK=1 (from environment)" in message
    env = {"KVTIER_BLOCKS_PER_CHUNK": "2", "KVTIER_CHUNK_TOKENS": "none"}
    cfg = KVTierConfig.load(path, env=env)
    assert (cfg.chunk_tokens, cfg.resolve_blocks_per_chunk(16)) == (None, 2)


def test_vllm_block_size_with_blocks_per_chunk_is_named_as_written() -> None:
    with pytest.raises(ConfigError) as info:
        KVTierConfig.from_vllm_extra_config({"block_size": 256, "blocks_per_chunk": 1})
    message = str(info.value)
    assert message.startswith(
        "block_size=256 (from vLLM kv_connector_extra_config) and blocks_per_chunk=1 "
        "(from vLLM kv_connector_extra_config): expected only one of them"
    )
    # As in vLLM, a null blocks_per_chunk is not set.
    extra = {"block_size": 256, "blocks_per_chunk": None}
    assert KVTierConfig.from_vllm_extra_config(extra).resolve_blocks_per_chunk(16) == 16


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({}, 1),
        ({"blocks_per_chunk": None}, 1),
        ({"blocks_per_chunk": 1}, 1),
        ({"chunk_tokens": 64}, 4),
    ],
)
def test_unset_blocks_per_chunk_means_1_unless_chunk_tokens_is_set(
    settings: dict[str, Any], expected: int
) -> None:
    cfg = KVTierConfig.from_dict(settings)
    assert cfg.resolve_blocks_per_chunk(16) == expected
    assert KVTierConfig.from_dict(cfg.to_dict()) == cfg


def test_a_chunk_tokens_error_found_late_names_its_layer() -> None:
    cfg = KVTierConfig.load(env={"KVTIER_CHUNK_TOKENS": "40"})
    with pytest.raises(
        ConfigError,
        match=r"^KVTIER_CHUNK_TOKENS=40 \(from environment\): expected a multiple .*use 48",
    ):
        cfg.resolve_blocks_per_chunk(16)


def test_describe_names_the_key_value_and_layer(tmp_path: Path) -> None:
    cfg = KVTierConfig.load(env={"KVTIER_CPU_BYTES": "1KiB"})
    assert cfg.describe("cpu_bytes") == "KVTIER_CPU_BYTES=1024 (from environment)"
    assert cfg.describe("num_slots") == "num_slots=None (from defaults)"
    extra = KVTierConfig.from_vllm_extra_config({"cpu_bytes_to_use": "1KiB"})
    assert extra.describe("cpu_bytes") == (
        "cpu_bytes_to_use=1024 (from vLLM kv_connector_extra_config)"
    )
    assert KVTierConfig(num_slots=3).describe("num_slots") == "num_slots=3 (from KVTierConfig())"
    assert cfg == KVTierConfig(cpu_bytes=1024)  # where a value came from is not part of it


# --- YAML integers -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "text", "expected"),
    [
        ("num_slots", "010", 10),  # PyYAML's YAML 1.1 read octal 8; the environment reads 10
        ("num_slots", "1_000", 1000),
        ("num_slots", "+5", 5),
        ("cpu_bytes", "1_000_000", 1_000_000),
        ("transfer_cpus", "[010, 2]", (2, 10)),
        ("transfer_cpus", "010", (10,)),
        ("store_threshold", "!!int 010", 10),
    ],
)
def test_yaml_reads_decimal_integers_as_the_environment_does(
    tmp_path: Path, field: str, text: str, expected: object
) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text(f"{field}: {text}\n")
    assert getattr(KVTierConfig.load(path, env=None), field) == expected
    env_text = text.removeprefix("!!int ").strip("[]").replace(" ", "")
    env = {f"KVTIER_{field.upper()}": env_text}
    assert getattr(KVTierConfig.load(env=env), field) == expected


@pytest.mark.parametrize(
    ("field", "text"),
    [
        ("num_slots", "0x10"),  # YAML 1.1: 16
        ("num_slots", "0o10"),
        ("chunk_tokens", "1:30"),  # YAML 1.1 sexagesimal: 90
        ("store_threshold", "0b11"),  # YAML 1.1: 3
        ("max_tracker_size", "!!int 0x10"),
        ("transfer_cpus", "0x3"),
    ],
)
def test_yaml_1_1_integer_forms_are_refused_as_in_the_environment(
    tmp_path: Path, field: str, text: str
) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text(f"{field}: {text}\n")
    shown = text.removeprefix("!!int ")
    with pytest.raises(ConfigError, match=rf"^{field}='{shown}' \(from file .*expected"):
        KVTierConfig.load(path, env=None)
    with pytest.raises(ConfigError, match=rf"^KVTIER_{field.upper()}='{shown}' .*expected"):
        KVTierConfig.load(env={f"KVTIER_{field.upper()}": shown})


def test_yaml_booleans_and_nulls_agree_with_the_environment(tmp_path: Path) -> None:
    # YAML's boolean words are all among the environment's; `y` and `n` are neither's.
    for word, value in [("yes", True), ("No", False), ("ON", True), ("off", False)]:
        path = tmp_path / "kvtier.yaml"
        path.write_text(f"enable_events: {word}\n")
        assert KVTierConfig.load(path, env=None).enable_events is value
        assert KVTierConfig.load(env={"KVTIER_ENABLE_EVENTS": word}).enable_events is value
    path.write_text("enable_events: y\n")
    with pytest.raises(ConfigError, match="enable_events='y'"):
        KVTierConfig.load(path, env=None)
    path.write_text("cpu_bytes: null\nnum_slots: 4\n")
    assert KVTierConfig.load(path, env={"KVTIER_CPU_BYTES": "null"}).num_slots == 4


# --- a file named by KVTIER_CONFIG ------------------------------------------------------------


def test_errors_about_the_kvtier_config_file_say_kvtier_config_named_it(tmp_path: Path) -> None:
    gone = tmp_path / "gone.yaml"
    with pytest.raises(
        ConfigError,
        match=rf"^config file {re.escape(str(gone))} \(named by KVTIER_CONFIG\) cannot be read",
    ):
        KVTierConfig.load(env={"KVTIER_CONFIG": str(gone)})
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_slots: x\n")
    with pytest.raises(
        ConfigError,
        match=rf"^num_slots='x' \(from file {re.escape(str(bad))} \(named by KVTIER_CONFIG\)\)",
    ):
        KVTierConfig.load(env={"KVTIER_CONFIG": str(bad)})
    # A file given to load() is not named by KVTIER_CONFIG, whatever the variable says.
    with pytest.raises(ConfigError) as info:
        KVTierConfig.load(bad, env={"KVTIER_CONFIG": str(gone)})
    assert str(info.value).startswith(f"num_slots='x' (from file {bad}): expected")


# --- vLLM's policy-plugin config -------------------------------------------------------------

PLUGIN = "kvtier.integrations.vllm.policy"


@pytest.mark.parametrize(
    ("policy", "expected"), [("kvtier_arc", "arc"), (" kvtier_sieve ", "sieve"), ("lru", "lru")]
)
def test_the_policy_plugin_config_means_the_kvtier_policy(policy: str, expected: str) -> None:
    """docs/vllm.md §2's extra config for vLLM's own connector was refused: kvtier joined it
    into 'kvtier.integrations.vllm.policy:kvtier_arc', not a kvtier CachePolicy class."""
    extra = {
        "cpu_bytes_to_use": 68719476736,
        "cache_policy_module_path": PLUGIN,
        "eviction_policy": policy,
    }
    assert KVTierConfig.from_vllm_extra_config(extra).cache_policy == expected


@pytest.mark.parametrize("policy", ["kvtier_nope", "KVTierPolicyAdapter", "arc_kvtier"])
def test_an_unknown_plugin_policy_names_the_choices(policy: str) -> None:
    extra = {"cache_policy_module_path": PLUGIN, "eviction_policy": policy}
    with pytest.raises(ConfigError) as info:
        KVTierConfig.from_vllm_extra_config(extra)
    message = str(info.value)
    assert f"eviction_policy='{policy}' (from vLLM kv_connector_extra_config)" in message
    assert "kvtier_arc" in message and "eviction_policy='arc'" in message


# --- transfer_cpus and sizes -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("suffix", "line"), [(".yaml", "transfer_cpus: 3"), (".toml", "transfer_cpus = 3")]
)
def test_one_cpu_id_as_an_int_in_every_layer(tmp_path: Path, suffix: str, line: str) -> None:
    path = tmp_path / f"kvtier{suffix}"
    path.write_text(line + "\n")
    assert KVTierConfig.load(path, env=None).transfer_cpus == (3,)
    assert KVTierConfig.load(env={"KVTIER_TRANSFER_CPUS": "3"}).transfer_cpus == (3,)
    assert KVTierConfig.from_vllm_extra_config({"transfer_cpus": 3}).transfer_cpus == (3,)
    assert KVTierConfig.from_dict({"transfer_cpus": np.int64(0)}).transfer_cpus == (0,)


@pytest.mark.parametrize("cpus", [True, 3.0, 70000, -1, 2**70])
def test_a_single_cpu_id_is_checked_like_a_list_entry(cpus: object) -> None:
    with pytest.raises(ConfigError, match=r"transfer_cpus=.*\(CPU ids 0\.\.65535\), or null$"):
        KVTierConfig.from_dict({"transfer_cpus": cpus})


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1_000_000", 1_000_000), ("64_000MiB", 64_000 * 2**20), ("1_000.5KB", 1_000_500)],
)
def test_sizes_take_digit_groups_as_integers_do(text: str, expected: int) -> None:
    assert parse_size(text) == expected
    assert KVTierConfig.load(env={"KVTIER_CPU_BYTES": text}).cpu_bytes == expected


@pytest.mark.parametrize("text", ["1__000", "_1000", "1000_", "1_000_MiB", "1.0_5KB"])
def test_misplaced_digit_group_marks_are_not_sizes(text: str) -> None:
    with pytest.raises(ValueError, match="is invalid"):
        parse_size(text)
