"""Every key through every layer (file, environment, explicit), and a config file that is not
UTF-8."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtier.config import ConfigError, KVTierConfig


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("kvtier.yaml", "cpu_bytes: 64GiB  # café\n".encode("latin-1")),
        ("kvtier.toml", 'cpu_bytes = "64GiB"  # café\n'.encode("latin-1")),
        ("kvtier.yml", "\ufeffcpu_bytes: 64GiB\n".encode("utf-16-le")),
    ],
)
def test_a_file_that_is_not_utf8_is_a_config_error_naming_it(
    tmp_path: Path, name: str, data: bytes
) -> None:
    """Each parser decodes as it reads: the UnicodeDecodeError named neither the file nor
    that it was kvtier's configuration."""
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(ConfigError, match=re.escape(f"config file {path} is not UTF-8 text")):
        KVTierConfig.load(path, env={})


# Per key, the values the file, the environment and the overrides give, as strings (parsed
# the same way in every layer), and what each parses to.
_LAYER_VALUES: dict[str, tuple[tuple[str, object], tuple[str, object], tuple[str, object]]] = {
    "cpu_bytes": (("1.5KiB", 1536), ("2kb", 2000), ("3 MiB", 3 << 20)),
    "num_slots": (("1", 1), ("2_0", 20), ("+3", 3)),
    "cache_policy": (("arc", "arc"), ("sieve", "sieve"), ("s3fifo", "s3fifo")),
    "store_threshold": (("1", 1), ("2", 2), ("0", 0)),
    "max_tracker_size": (("10", 10), ("20", 20), ("30", 30)),
    "blocks_per_chunk": (("2", 2), ("4", 4), ("8", 8)),
    "chunk_tokens": (("16", 16), ("32", 32), ("48", 48)),
    "hash_algorithm": (("XXH3_128", "xxh3_128"), ("sha256", "sha256"), ("xxh3_128", "xxh3_128")),
    "enable_events": (("yes", True), ("off", False), ("TRUE", True)),
    "max_pending_events": (("5", 5), ("6", 6), ("7", 7)),
    "self_describing_kv_events": (("on", True), ("no", False), ("1", True)),
    "release_finished_blocks": (("off", False), ("yes", True), ("0", False)),
    "transfer_backend": (("cpu", "cpu"), ("CUDA", "cuda"), ("auto", "auto")),
    "transfer_cpus": (("1", (1,)), ("3-4", (3, 4)), ("6,2", (2, 6))),
    "transfer_avoid_submitter_cpu": (("no", False), ("1", True), ("false", False)),
    "transfer_coalesce_depth": (("1", 1), ("2", 2), ("8", 8)),
    "pin_memory": (("true", True), ("off", False), ("auto", None)),
    "offload_prompt_only": (("false", False), ("on", True), ("0", False)),
}


def test_every_key_takes_the_last_layer_that_sets_it(tmp_path: Path) -> None:
    """defaults < file < environment < overrides, for every key and every subset of layers."""
    assert set(_LAYER_VALUES) == set(KVTierConfig().to_dict())
    default = KVTierConfig().to_dict()
    for key, (
        (in_file, from_file),
        (in_env, from_env),
        (given, from_overrides),
    ) in _LAYER_VALUES.items():
        for mask in range(8):
            path = tmp_path / f"{key}-{mask}.yaml"
            path.write_text(f"{key}: {in_file!r}\n" if mask & 1 else "")
            env = {f"KVTIER_{key.upper()}": in_env} if mask & 2 else {}
            overrides = {key: given} if mask & 4 else None
            want = [default[key], from_file, from_env, from_overrides][
                max((i + 1 for i in range(3) if mask >> i & 1), default=0)
            ]
            got = KVTierConfig.load(path, env=env, overrides=overrides).to_dict()[key]
            assert got == want, (key, mask)
