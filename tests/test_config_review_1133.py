"""A setting given twice in a config file, and other surprises of the file-loading path.

A key written twice in one YAML mapping was already refused; these cover what still passed
silently or was reported without what a user needs to find the fault:

- `<<: [{cpu_bytes: 64GiB}, {cpu_bytes: 8GiB}]` gave 8GiB (YAML gives the first mapping
  precedence; PyYAML 6.0.4's choice depends on whether the two key strings are one object), and
  `<<` written twice kept one of the two silently.
- TOML's duplicate reported "Cannot overwrite a value (at line 3, column 19)", naming no key.
- A tab, which PyYAML refuses after `key:` though YAML 1.2 allows it there, got only
  "found character '\\t' that cannot start any token".
- A file holding a string (`cpu_bytes=64GiB`, another format's line) said "holds a str" without
  showing it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import ConfigError, KVTierConfig


def _load(tmp_path: Path, name: str, text: str) -> KVTierConfig:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return KVTierConfig.load(path, env={})


def test_a_key_in_two_merged_mappings_is_an_error_naming_it_and_its_line(tmp_path: Path) -> None:
    text = "cache_policy: arc\n<<: [{cpu_bytes: 64GiB},\n      {cpu_bytes: 8GiB}]\n"
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, "kvtier.yaml", text)
    message = str(info.value)
    assert "kvtier.yaml is not valid YAML" in message
    assert "found key 'cpu_bytes' in two of the mappings merged by '<<'" in message
    assert "line 3, column 8" in message  # the second one
    # Kept, as YAML defines it: the mapping's own key overrides a merged one, in any position,
    # and a merged mapping may merge in turn.
    text = (
        "cpu_bytes: 8GiB\n"
        "<<: [{cpu_bytes: 64GiB, cache_policy: arc}, {store_threshold: 2}]\n"
        "chunk_tokens: 256\n"
    )
    cfg = _load(tmp_path, "own.yaml", text)
    assert (cfg.cpu_bytes, cfg.cache_policy, cfg.store_threshold) == (8 * 2**30, "arc", 2)
    nested = "<<: &base {<<: {cpu_bytes: 1GiB}, cache_policy: arc}\nstore_threshold: 3\n"
    cfg = _load(tmp_path, "nested.yaml", nested)
    assert (cfg.cpu_bytes, cfg.cache_policy, cfg.store_threshold) == (2**30, "arc", 3)


def test_merge_key_written_twice_is_an_error(tmp_path: Path) -> None:
    text = "<<: {cpu_bytes: 64GiB}\nstore_threshold: 2\n<<: {cpu_bytes: 8GiB}\n"
    with pytest.raises(ConfigError, match=r"(?s)found merge key '<<' twice.*line 3, column 1"):
        _load(tmp_path, "kvtier.yaml", text)


def test_toml_key_set_twice_names_the_key(tmp_path: Path) -> None:
    text = 'cpu_bytes = "64GiB"\ncache_policy = "arc"\ncpu_bytes = "8GiB"\n'
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, "kvtier.toml", text)
    message = str(info.value)
    assert message.startswith(f"config file {tmp_path / 'kvtier.toml'} is not valid TOML: ")
    assert "(at line 3, column 19)" in message
    assert 'cpu_bytes = "8GiB"' in message


def test_toml_table_declared_twice_quotes_the_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"Cannot declare .* twice \(at line 4.*'\[x\]'$"):
        _load(tmp_path, "kvtier.toml", 'cpu_bytes = "64GiB"\n\n[x]\n[x]\n')


@pytest.mark.parametrize("text", ["cpu_bytes:\t64GiB\n", "\tcpu_bytes: 64GiB\n"])
def test_a_tab_in_yaml_says_to_use_spaces(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match=r"(?s)line 1.*put a space, not a tab, after 'key:'"):
        _load(tmp_path, "kvtier.yaml", text)


@pytest.mark.parametrize(
    ("text", "shown"),
    [("cpu_bytes=64GiB\n", "'cpu_bytes=64GiB'"), ("- cpu_bytes: 1GiB\n", "[{'cpu_bytes'")],
)
def test_a_file_without_a_mapping_shows_what_it_holds(
    tmp_path: Path, text: str, shown: str
) -> None:
    with pytest.raises(ConfigError, match=r"expected a mapping of setting names") as info:
        _load(tmp_path, "kvtier.yaml", text)
    assert f"not {shown}" in str(info.value)
