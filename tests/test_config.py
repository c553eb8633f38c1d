"""Tests of kvtier.config: layering, aliases, parsing, and errors that name key, value, source."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import ConfigError, KVTierConfig, parse_size

YAML_TEXT = """\
cpu_bytes: 8GiB
cache_policy: arc
store_threshold: 2
enable_events: yes
hash_algorithm: xxh3_128
"""

TOML_TEXT = """\
cpu_bytes = "8GiB"
cache_policy = "arc"
store_threshold = 2
enable_events = true
hash_algorithm = "xxh3_128"
"""


@pytest.fixture(params=["yaml", "toml"])
def config_file(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    path = tmp_path / f"kvtier.{request.param}"
    path.write_text(YAML_TEXT if request.param == "yaml" else TOML_TEXT)
    return path


def test_defaults() -> None:
    cfg = KVTierConfig.load(env={})
    assert cfg == KVTierConfig()
    assert cfg.to_dict() == {
        "cpu_bytes": None,
        "num_slots": None,
        "cache_policy": "lru",
        "store_threshold": 0,
        "max_tracker_size": 64_000,
        "blocks_per_chunk": None,
        "chunk_tokens": None,
        "hash_algorithm": "sha256",
        "enable_events": False,
        "max_pending_events": 100_000,
        "self_describing_kv_events": False,
        "transfer_backend": "auto",
        "transfer_cpus": None,
        "transfer_avoid_submitter_cpu": True,
        "transfer_coalesce_depth": 0,
        "pin_memory": None,
        "offload_prompt_only": True,
        "release_finished_blocks": True,
    }


def test_file_layer(config_file: Path) -> None:
    cfg = KVTierConfig.load(config_file, env={})
    assert cfg.cpu_bytes == 8 * 2**30
    assert cfg.cache_policy == "arc"
    assert cfg.store_threshold == 2
    assert cfg.enable_events is True
    assert cfg.hash_algorithm == "xxh3_128"
    assert cfg.max_tracker_size == 64_000  # untouched fields keep their defaults


def test_each_layer_overrides_the_previous_one(config_file: Path) -> None:
    env = {"KVTIER_STORE_THRESHOLD": "3", "KVTIER_CACHE_POLICY": "sieve", "HOME": "/x"}
    cfg = KVTierConfig.load(config_file, env=env, overrides={"cache_policy": "s3fifo"})
    assert cfg.cpu_bytes == 8 * 2**30  # file
    assert cfg.store_threshold == 3  # env over file
    assert cfg.cache_policy == "s3fifo"  # overrides over env over file
    assert KVTierConfig.load(config_file, env=None).store_threshold == 2


def test_kvtier_config_variable_names_the_file(config_file: Path, tmp_path: Path) -> None:
    env = {"KVTIER_CONFIG": str(config_file)}
    assert KVTierConfig.load(env=env).cache_policy == "arc"
    other = tmp_path / "other.yml"
    other.write_text("cache_policy: sieve\n")
    assert KVTierConfig.load(other, env=env).cache_policy == "sieve"  # explicit file wins


def test_only_kvtier_variables_are_read() -> None:
    env = {"PATH": "/bin", "kvtier_store_threshold": "x", "XKVTIER_FOO": "1"}
    assert KVTierConfig.load(env=env) == KVTierConfig()


@pytest.mark.parametrize(
    ("var", "text", "field", "value"),
    [
        ("KVTIER_CPU_BYTES", "512MB", "cpu_bytes", 512 * 10**6),
        ("KVTIER_CPU_BYTES", "none", "cpu_bytes", None),
        ("KVTIER_NUM_SLOTS", "1_024", "num_slots", 1024),
        ("KVTIER_CACHE_POLICY", "kvtier.policies.lru:LRUPolicy", "cache_policy", None),
        ("KVTIER_STORE_THRESHOLD", " 2 ", "store_threshold", 2),
        ("KVTIER_MAX_TRACKER_SIZE", "10", "max_tracker_size", 10),
        ("KVTIER_BLOCKS_PER_CHUNK", "4", "blocks_per_chunk", 4),
        ("KVTIER_BLOCKS_PER_CHUNK", "null", "blocks_per_chunk", None),
        ("KVTIER_CHUNK_TOKENS", "256", "chunk_tokens", 256),
        ("KVTIER_HASH_ALGORITHM", "XXH3_128", "hash_algorithm", "xxh3_128"),
        ("KVTIER_ENABLE_EVENTS", "Yes", "enable_events", True),
        ("KVTIER_ENABLE_EVENTS", "1", "enable_events", True),
        ("KVTIER_MAX_PENDING_EVENTS", "7", "max_pending_events", 7),
        ("KVTIER_TRANSFER_BACKEND", "cuda", "transfer_backend", "cuda"),
        ("KVTIER_TRANSFER_CPUS", "6,2-3", "transfer_cpus", (2, 3, 6)),
        ("KVTIER_TRANSFER_CPUS", " 1 ", "transfer_cpus", (1,)),
        ("KVTIER_TRANSFER_CPUS", "none", "transfer_cpus", None),
        ("KVTIER_TRANSFER_AVOID_SUBMITTER_CPU", "off", "transfer_avoid_submitter_cpu", False),
        ("KVTIER_TRANSFER_COALESCE_DEPTH", " 2 ", "transfer_coalesce_depth", 2),
        ("KVTIER_TRANSFER_COALESCE_DEPTH", "8", "transfer_coalesce_depth", 8),
        ("KVTIER_PIN_MEMORY", "auto", "pin_memory", None),
        ("KVTIER_PIN_MEMORY", "off", "pin_memory", False),
        ("KVTIER_OFFLOAD_PROMPT_ONLY", "false", "offload_prompt_only", False),
        ("KVTIER_OFFLOAD_PROMPT_ONLY", "0", "offload_prompt_only", False),
    ],
)
def test_env_values_are_parsed_per_type(var: str, text: str, field: str, value: Any) -> None:
    cfg = KVTierConfig.load(env={var: text})
    assert getattr(cfg, field) == (text if value is None and field == "cache_policy" else value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("cpu_bytes", "lots"),
        ("cpu_bytes", "0"),
        ("cpu_bytes", -5),
        ("cpu_bytes", 1.5e9),
        ("cpu_bytes", "1.5B"),
        ("num_slots", 0),
        ("num_slots", "2.5"),
        ("cache_policy", "nope"),
        ("cache_policy", "no.such.module:Policy"),
        ("cache_policy", "kvtier.base:ReqContext"),
        ("cache_policy", 3),
        ("store_threshold", -1),
        ("store_threshold", "x"),
        ("store_threshold", True),
        ("store_threshold", 2.0),
        ("max_tracker_size", 0),
        ("blocks_per_chunk", 0),
        ("chunk_tokens", -16),
        ("hash_algorithm", "md5"),
        ("enable_events", "maybe"),
        ("enable_events", 2),
        ("max_pending_events", 0),
        ("transfer_backend", "rocm"),
        ("transfer_cpus", "3-1"),
        ("transfer_cpus", "1,,2"),
        ("transfer_cpus", "all"),
        ("transfer_cpus", []),
        ("transfer_cpus", [1, -2]),
        ("transfer_cpus", [True]),
        ("transfer_cpus", 1.0),
        ("transfer_avoid_submitter_cpu", "sometimes"),
        ("transfer_coalesce_depth", 9),
        ("transfer_coalesce_depth", -1),
        ("transfer_coalesce_depth", True),
        ("transfer_coalesce_depth", "two"),
        ("pin_memory", "sometimes"),
        ("offload_prompt_only", None),
        ("release_finished_blocks", "later"),
    ],
)
def test_bad_values_name_key_value_and_source(key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        KVTierConfig.from_dict({key: value})
    message = str(info.value)
    assert f"{key}={value!r} (from dict): expected " in message
    with pytest.raises(ConfigError, match=r"\(from KVTierConfig\(\)\)"):
        KVTierConfig(**{key: value})


def test_error_message_format_for_environment() -> None:
    with pytest.raises(ConfigError) as info:
        KVTierConfig.load(env={"KVTIER_STORE_THRESHOLD": "x"})
    assert str(info.value) == (
        "KVTIER_STORE_THRESHOLD='x' (from environment): expected a non-negative integer"
    )
    assert isinstance(info.value, ValueError)


def test_bad_value_in_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("transfer_backend: rocm\n")
    with pytest.raises(ConfigError, match=f"transfer_backend='rocm' \\(from file {path}\\)"):
        KVTierConfig.load(path, env={})


def test_import_failure_of_a_policy_path_says_why() -> None:
    with pytest.raises(ConfigError, match="No module named 'no'"):
        KVTierConfig.from_dict({"cache_policy": "no.such.module:Policy"})


@pytest.mark.parametrize("layer", ["file", "env", "overrides", "dict", "vllm"])
def test_unknown_keys_are_errors_in_every_layer(layer: str, tmp_path: Path) -> None:
    key = "KVTIER_STORE_TRESHOLD" if layer == "env" else "store_treshold"
    with pytest.raises(ConfigError) as info:
        if layer == "file":
            path = tmp_path / "c.toml"
            path.write_text(f"{key} = 2\n")
            KVTierConfig.load(path, env={})
        elif layer == "env":
            KVTierConfig.load(env={key: "2"})
        elif layer == "overrides":
            KVTierConfig.load(env={}, overrides={key: 2})
        elif layer == "dict":
            KVTierConfig.from_dict({key: 2})
        else:
            KVTierConfig.from_vllm_extra_config({key: 2})
    message = str(info.value)
    assert f"{key}=" in message and "unknown key" in message
    assert "did you mean" in message and "STORE_THRESHOLD".lower() in message.lower()


def test_vllm_aliases_are_not_kvtier_keys() -> None:
    with pytest.raises(ConfigError, match="cpu_bytes_to_use=1 \\(from dict\\): unknown key"):
        KVTierConfig.from_dict({"cpu_bytes_to_use": 1})


def test_vllm_unknown_key_lists_every_key_vllm_may_pass() -> None:
    """vLLM's spec_name and spec_module_path are accepted (and ignored): the list of the keys
    expected, in the error for an unknown one, names them too."""
    with pytest.raises(ConfigError, match="unknown key") as info:
        KVTierConfig.from_vllm_extra_config({"nope": 1})
    expected = str(info.value).split("expected one of: ")[1].split(", ")
    for key in ("spec_name", "spec_module_path", "cpu_bytes_to_use", "cache_policy"):
        assert key in expected
    KVTierConfig.from_vllm_extra_config({"spec_name": "X", "spec_module_path": "m"})


def test_non_string_key_in_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("1: 2\n")
    with pytest.raises(ConfigError, match=r"1=2 .*expected a string key"):
        KVTierConfig.load(path, env={})


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("c.json", "{}", "unknown format '.json'"),
        ("c.yaml", "a: [1,\n", "is not valid YAML"),
        ("c.toml", "a = \n", "is not valid TOML"),
        ("c.yaml", "- 1\n- 2\n", "holds a list; expected a mapping"),
    ],
)
def test_bad_files(tmp_path: Path, name: str, text: str, match: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        KVTierConfig.load(path, env={})


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        KVTierConfig.load(tmp_path / "absent.yaml", env={})
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert KVTierConfig.load(empty, env={}) == KVTierConfig()


def test_cpu_bytes_and_num_slots_exclude_each_other(config_file: Path) -> None:
    with pytest.raises(ConfigError) as info:
        KVTierConfig.load(config_file, env={"KVTIER_NUM_SLOTS": "10"})
    message = str(info.value)
    assert f"cpu_bytes={8 * 2**30} (from file {config_file})" in message
    assert "KVTIER_NUM_SLOTS=10 (from environment)" in message
    # A later layer can clear an earlier one.
    env = {"KVTIER_NUM_SLOTS": "10", "KVTIER_CPU_BYTES": "none"}
    cfg = KVTierConfig.load(config_file, env=env)
    assert (cfg.cpu_bytes, cfg.num_slots) == (None, 10)


@pytest.mark.parametrize(
    ("settings", "device_block_size", "expected"),
    [
        ({}, 16, 1),
        ({"blocks_per_chunk": 4}, 16, 4),
        ({"chunk_tokens": 64}, 16, 4),
        ({"chunk_tokens": 16}, 16, 1),
    ],
)
def test_resolve_blocks_per_chunk(
    settings: dict[str, int], device_block_size: int, expected: int
) -> None:
    cfg = KVTierConfig.from_dict(settings)
    assert cfg.resolve_blocks_per_chunk(device_block_size) == expected


def test_resolve_blocks_per_chunk_errors() -> None:
    with pytest.raises(
        ConfigError,
        match=r"chunk_tokens=40 \(from KVTierConfig\(\)\): expected a multiple .*use 48",
    ):
        KVTierConfig(chunk_tokens=40).resolve_blocks_per_chunk(16)
    with pytest.raises(ConfigError, match="device_block_size=0"):
        KVTierConfig().resolve_blocks_per_chunk(0)
    # Both set is refused on construction, even where they agree for this block size.
    with pytest.raises(ConfigError, match=r"chunk_tokens=64 .*blocks_per_chunk=4 .*only one"):
        KVTierConfig.from_dict({"chunk_tokens": 64, "blocks_per_chunk": 4})


def test_vllm_extra_config_aliases() -> None:
    cfg = KVTierConfig.from_vllm_extra_config(
        {
            "cpu_bytes_to_use": 2**30,
            "eviction_policy": "arc",
            "block_size": 64,
            "store_threshold": 2,
            "max_tracker_size": 1000,
            "offload_prompt_only": False,
            "hash_algorithm": "xxh3_128",  # kvtier names are accepted too
        }
    )
    assert cfg == KVTierConfig(
        cpu_bytes=2**30,
        cache_policy="arc",
        chunk_tokens=64,
        store_threshold=2,
        max_tracker_size=1000,
        offload_prompt_only=False,
        hash_algorithm="xxh3_128",
    )
    assert KVTierConfig.from_vllm_extra_config({"blocks_per_chunk": 2}).blocks_per_chunk == 2
    routing = {"spec_name": "KVTierSpec", "spec_module_path": "kvtier.integrations.vllm"}
    assert KVTierConfig.from_vllm_extra_config(routing) == KVTierConfig()


def test_vllm_cache_policy_module_path() -> None:
    extra = {"eviction_policy": "LRUPolicy", "cache_policy_module_path": "kvtier.policies.lru"}
    cfg = KVTierConfig.from_vllm_extra_config(extra)
    assert cfg.cache_policy == "kvtier.policies.lru:LRUPolicy"
    # As in vLLM, a registered name wins over the module path.
    extra = {"eviction_policy": "arc", "cache_policy_module_path": "kvtier.policies.lru"}
    assert KVTierConfig.from_vllm_extra_config(extra).cache_policy == "arc"


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"cache_policy_module_path": "kvtier.policies.lru"}, "eviction_policy=None"),
        (
            {"cache_policy_module_path": "a:b", "eviction_policy": "X"},
            "cache_policy_module_path='a:b'",
        ),
        (
            {"cache_policy_module_path": "kvtier.policies.lru", "eviction_policy": "Nope"},
            "cache_policy_module_path:eviction_policy='kvtier.policies.lru:Nope'",
        ),
        ({"cpu_bytes_to_use": "big"}, "cpu_bytes_to_use='big' \\(from vLLM"),
        ({"block_size": 0}, "block_size=0 \\(from vLLM"),
        ({"cpu_bytes_to_use": 1, "cpu_bytes": 2}, "cpu_bytes_to_use=1 and cpu_bytes=2"),
    ],
)
def test_vllm_extra_config_errors(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        KVTierConfig.from_vllm_extra_config(extra)


def test_direct_construction_normalizes_and_is_frozen() -> None:
    cfg = KVTierConfig(cpu_bytes="1GiB", enable_events="yes")  # type: ignore[arg-type]
    assert cfg.cpu_bytes == 2**30 and cfg.enable_events is True
    assert KVTierConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cpu_bytes = 1  # type: ignore[misc]
    with pytest.raises(ConfigError, match="num_slots=3"):
        dataclasses.replace(cfg, num_slots=3)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (4096, 4096),
        ("4096", 4096),
        ("1B", 1),
        ("1kb", 1000),
        ("1KiB", 1024),
        ("512MB", 512 * 10**6),
        ("512 MiB", 512 * 2**20),
        ("64GiB", 64 * 2**30),
        ("64gb", 64 * 10**9),
        ("1.5GiB", 3 * 2**29),
        ("2TB", 2 * 10**12),
        ("1TiB", 2**40),
        ("0.5KiB", 512),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad", ["", "-1", -1, "1.5", "0.1KiB", "GiB", "64G", "64 GiBs", "1e9", "1,000", 1.5, True]
)
def test_parse_size_rejects(bad: Any) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


def test_examples_in_the_docs_load(tmp_path: Path) -> None:
    docs = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    text = docs.read_text()
    loaded = []
    for lang in ("yaml", "toml"):
        (block,) = re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)
        path = tmp_path / f"kvtier.{lang}"
        path.write_text(block)
        loaded.append(KVTierConfig.load(path, env={}))
    yaml_cfg, toml_cfg = loaded
    assert yaml_cfg.cpu_bytes == 64 * 2**30 and yaml_cfg.resolve_blocks_per_chunk(16) == 16
    assert toml_cfg == yaml_cfg


def test_transfer_cpus_from_a_list_or_a_cpu_list_string(tmp_path: Path) -> None:
    assert KVTierConfig.from_dict({"transfer_cpus": [3, 1, 3]}).transfer_cpus == (1, 3)
    # A CPU-list string, converted on construction (the field's type is the converted form).
    assert KVTierConfig(transfer_cpus="0-2, 5").transfer_cpus == (0, 1, 2, 5)  # type: ignore[arg-type]
    path = tmp_path / "kvtier.toml"
    path.write_text("transfer_cpus = [4, 2]\n")
    assert KVTierConfig.load(path, env={}).transfer_cpus == (2, 4)


def test_transfer_library_switches_are_not_settings() -> None:
    # docs/configuration.md documents these beside the settings; setting one for the transfer
    # backend must not make every config load fail.
    env = {"KVTIER_NATIVE_COPY": "0", "KVTIER_PORTABLE_COPY": "1", "KVTIER_CACHE_DIR": "/tmp/x"}
    assert KVTierConfig.load(env=env) == KVTierConfig()
    assert KVTierConfig.load(env={**env, "KVTIER_NUM_SLOTS": "8"}).num_slots == 8


def test_environment_names_are_upper_case_only() -> None:
    # Accepting both spellings let one silently override the other, by the environment's order.
    env = {"KVTIER_CACHE_POLICY": "arc", "KVTIER_cache_policy": "lru"}
    with pytest.raises(ConfigError, match=r"KVTIER_cache_policy='lru'.*unknown key") as info:
        KVTierConfig.load(env=env)
    assert "did you mean 'KVTIER_CACHE_POLICY'" in str(info.value)
    with pytest.raises(ConfigError, match=r"KVTIER_Num_Slots='8'.*unknown key"):
        KVTierConfig.load(env={"KVTIER_Num_Slots": "8"})


def test_yaml_file_with_a_key_twice_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text("cache_policy: arc\nstore_threshold: 2\ncache_policy: lru\n")
    with pytest.raises(
        ConfigError, match=r"(?s)kvtier\.yaml is not valid YAML.*'cache_policy' twice"
    ):
        KVTierConfig.load(path, env={})
    # A merge key's values may be overridden: that is not a key given twice.
    merged = tmp_path / "merged.yaml"
    merged.write_text("<<: {cache_policy: arc, store_threshold: 2}\ncache_policy: lru\n")
    cfg = KVTierConfig.load(merged, env={})
    assert (cfg.cache_policy, cfg.store_threshold) == ("lru", 2)


def test_vllm_cpu_bytes_to_use_may_be_a_json_float() -> None:
    # vLLM's spec takes int(cpu_bytes_to_use), and JSON reads 64e9 as a float.
    cfg = KVTierConfig.from_vllm_extra_config({"cpu_bytes_to_use": 64e9})
    assert cfg.cpu_bytes == 64 * 10**9 and isinstance(cfg.cpu_bytes, int)
    with pytest.raises(ConfigError, match=r"cpu_bytes_to_use=1000\.5"):
        KVTierConfig.from_vllm_extra_config({"cpu_bytes_to_use": 1000.5})
    with pytest.raises(ConfigError, match=r"cpu_bytes=64000000000\.0 \(from dict\)"):
        KVTierConfig.from_dict({"cpu_bytes": 64e9})  # kvtier's own layers keep integers exact


@pytest.mark.parametrize("cpus", ["0-4000000000", "70000", [70000]])
def test_cpu_list_beyond_any_cpu_id_is_an_error(cpus: Any) -> None:
    with pytest.raises(ConfigError, match=r"transfer_cpus=.*CPU ids 0\.\.65535"):
        KVTierConfig.from_dict({"transfer_cpus": cpus})
