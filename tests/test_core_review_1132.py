"""Third-pass review of kvtier's core: defects found, each pinned by a test.

- CLI: a Ctrl-C while `main()` built its parser (importing every command's module) or parsed
  the arguments escaped as a KeyboardInterrupt traceback, not `kvtier: interrupted`, exit 130.
- Config: vLLM's names (`block_size`, `eviction_policy`, `cpu_bytes_to_use`) in kvtier's own
  layers got a hint by spelling alone: `KVTIER_BLOCK_SIZE` was pointed at
  `KVTIER_MAX_TRACKER_SIZE`, `eviction_policy` and `block_size` at nothing.
- Hashing: token ids given as a generator, map, set or str were told "token_ids has shape ()",
  naming neither what was given nor what to give.
- Config: a TOML file starting with a UTF-8 byte order mark (Notepad's, PowerShell's) was
  "not valid TOML: Invalid statement (at line 1, column 1)"; the same YAML file loaded.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import cli
from kvtier.config import ConfigError, KVTierConfig
from kvtier.hashing import BlockHasher


def _interrupt(*_: object) -> Any:
    raise KeyboardInterrupt


def _add_interrupting_type(p: argparse.ArgumentParser) -> None:
    p.add_argument("value", type=_interrupt)


@pytest.mark.parametrize(
    ("add_arguments", "argv"),
    [
        (_interrupt, ["cmd"]),  # while build_parser() imports and declares a command
        (_add_interrupting_type, ["cmd", "x"]),  # while parse_args() converts an argument
    ],
    ids=["building", "parsing"],
)
def test_ctrl_c_before_the_command_runs_is_exit_130_without_a_traceback(
    add_arguments: Callable[[argparse.ArgumentParser], None],
    argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ran: list[argparse.Namespace] = []

    def run(args: argparse.Namespace) -> int:
        ran.append(args)
        return 0

    command = cli.Command("cmd", "a command", add_arguments, run)
    monkeypatch.setattr(cli, "COMMANDS", [command])
    try:
        status = cli.main(argv)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped main() as a traceback")
    assert (status, ran) == (cli.INTERRUPTED, [])
    assert status == 130
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "kvtier: interrupted\n")


def _from_dict(key: str, value: object, tmp_path: Path) -> KVTierConfig:
    return KVTierConfig.from_dict({key: value})


def _from_overrides(key: str, value: object, tmp_path: Path) -> KVTierConfig:
    return KVTierConfig.load(env=None, overrides={key: value})


def _from_yaml(key: str, value: object, tmp_path: Path) -> KVTierConfig:
    path = tmp_path / "kvtier.yaml"
    path.write_text(f"{key}: {value}\n", encoding="utf-8")
    return KVTierConfig.load(path, env=None)


def _from_env(key: str, value: object, tmp_path: Path) -> KVTierConfig:
    return KVTierConfig.load(env={"KVTIER_" + key.upper(): str(value)})


@pytest.mark.parametrize("build", [_from_dict, _from_overrides, _from_yaml, _from_env])
@pytest.mark.parametrize(
    ("vllm_name", "value", "field"),
    [
        ("block_size", 256, "chunk_tokens"),
        ("eviction_policy", "arc", "cache_policy"),
        ("cpu_bytes_to_use", "64GiB", "cpu_bytes"),
    ],
)
def test_a_vllm_name_in_a_kvtier_layer_is_pointed_at_its_kvtier_name(
    build: Callable[[str, object, Path], KVTierConfig],
    vllm_name: str,
    value: object,
    field: str,
    tmp_path: Path,
) -> None:
    meant = "KVTIER_" + field.upper() if build is _from_env else field
    with pytest.raises(ConfigError) as info:
        build(vllm_name, value, tmp_path)
    message = str(info.value)
    assert "unknown key" in message
    assert f"did you mean {meant!r}? ({vllm_name!r} is vLLM's name for it)" in message
    # The kvtier name it suggests takes the same value in the same layer.
    assert getattr(build(field, value, tmp_path), field) is not None


def test_the_vllm_layer_still_reads_vllm_names_and_hints_its_own_typos() -> None:
    cfg = KVTierConfig.from_vllm_extra_config({"block_size": 256, "eviction_policy": "arc"})
    assert (cfg.chunk_tokens, cfg.cache_policy) == (256, "arc")
    with pytest.raises(ConfigError, match="did you mean 'eviction_policy'\\? expected"):
        KVTierConfig.from_vllm_extra_config({"evicton_policy": "arc"})
    # A misspelt kvtier name in a kvtier layer keeps its spelling hint.
    with pytest.raises(ConfigError, match="did you mean 'KVTIER_CHUNK_TOKENS'\\? expected"):
        KVTierConfig.load(env={"KVTIER_CHUNK_TOKEN": "256"})
    # The case the spelling hint got wrong: the engine-facing block size of vLLM's config.
    with pytest.raises(ConfigError) as info:
        KVTierConfig.load(env={"KVTIER_BLOCK_SIZE": "16"})
    assert "MAX_TRACKER_SIZE" not in str(info.value).split("expected one of")[0]


def _gen(ids: list[int]) -> Any:
    return (t for t in ids)


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (_gen, "generator"),
        (lambda ids: map(int, ids), "map"),
        (set, "set"),
        (lambda ids: dict.fromkeys(ids).keys(), "dict_keys"),
        (lambda ids: "".join(map(str, ids)), "str"),
        (lambda ids: ids[0], "int"),
    ],
)
def test_token_ids_that_are_no_sequence_are_named_by_their_type(
    make: Callable[[list[int]], Any], kind: str
) -> None:
    hasher = BlockHasher(2)
    ids = [1, 2, 3, 4]
    with pytest.raises(TypeError, match=f"has type {kind}; expected a 1-D sequence of token ids"):
        hasher.hash_blocks(make(ids))
    # What the message asks for hashes, alike in each form.
    expected = hasher.hash_blocks(ids)
    assert len(expected) == 2
    assert hasher.hash_blocks(tuple(ids)) == hasher.hash_blocks(np.array(ids)) == expected


def test_arrays_of_the_wrong_shape_are_still_told_their_shape() -> None:
    hasher = BlockHasher(2)
    with pytest.raises(ValueError, match=r"token_ids has shape \(1, 4\); expected a 1-D"):
        hasher.hash_blocks(np.array([[1, 2, 3, 4]]))
    # A 0-d array is an array: its shape is the news, not its type.
    with pytest.raises(ValueError, match=r"token_ids has shape \(\); expected a 1-D"):
        hasher.hash_blocks(np.array(5))
    # Only what is no array at all is named by its type.
    with pytest.raises(TypeError, match="has type generator"):
        hasher.hash_blocks(_gen([1, 2]))


def test_a_toml_file_with_a_byte_order_mark_loads_as_its_yaml_twin_does(tmp_path: Path) -> None:
    text = 'cpu_bytes = "64GiB"\ncache_policy = "arc"\n'
    plain, marked, yaml_marked = (tmp_path / n for n in ("a.toml", "b.toml", "c.yaml"))
    plain.write_text(text, encoding="utf-8")
    marked.write_text(text, encoding="utf-8-sig")
    yaml_marked.write_text(text.replace(" =", ":").replace('"', ""), encoding="utf-8-sig")
    assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
    expected = KVTierConfig.load(plain, env=None)
    assert expected.cpu_bytes == 64 * 2**30
    assert KVTierConfig.load(marked, env=None) == KVTierConfig.load(yaml_marked, env=None)
    assert KVTierConfig.load(marked, env=None) == expected
    # Only the one at the start is a mark: elsewhere it is still text TOML refuses.
    marked.write_bytes(text.encode() + b"\xef\xbb\xbf")
    with pytest.raises(ConfigError, match=f"config file {re.escape(str(marked))} is not valid"):
        KVTierConfig.load(marked, env=None)
