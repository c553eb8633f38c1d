"""Snippets of README.md, docs/configuration.md and docs/simulate.md run as written (the
connector, transfer and hf pages have their own test_docs.py)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.config import ConfigError, KVTierConfig

ROOT = Path(__file__).resolve().parents[1]


def _blocks(doc: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", doc.read_text(), flags=re.DOTALL)


def test_readme_manager_example_runs() -> None:
    (code,) = _blocks(ROOT / "README.md", "python")
    scope: dict[str, object] = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["out"] is not None  # an empty manager has room for two keys


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No KVTIER_ variable, and a working directory for relative config paths."""
    for name in [n for n in os.environ if n.startswith("KVTIER_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_configuration_snippets_run_and_show_what_they_say(clean_env: Path) -> None:
    doc = ROOT / "docs" / "configuration.md"
    (clean_env / "kvtier.yaml").write_text(_blocks(doc, "yaml")[0])
    load, vllm = _blocks(doc, "python")
    scope: dict[str, object] = {}
    exec(compile(load, str(doc), "exec"), scope)
    assert scope["cfg"] == KVTierConfig(cpu_bytes=68719476736)  # the last line's comment
    exec(compile(vllm, str(doc), "exec"), scope)
    cfg = scope["cfg"]
    assert isinstance(cfg, KVTierConfig)
    assert (cfg.cpu_bytes, cfg.cache_policy, cfg.chunk_tokens) == (64 * 2**30, "arc", 256)


def test_configuration_errors_read_as_quoted(clean_env: Path) -> None:
    (threshold, typo, both) = _blocks(ROOT / "docs" / "configuration.md", "text")[0].splitlines()
    with pytest.raises(ConfigError) as e:
        KVTierConfig.load(env={"KVTIER_STORE_THRESHOLD": "x"})
    assert str(e.value) == threshold
    (clean_env / "kvtier.yaml").write_text("cache_polcy: arc\n")
    with pytest.raises(ConfigError) as e:
        KVTierConfig.load("kvtier.yaml", env={})
    assert str(e.value).startswith(typo.removesuffix("..."))
    (clean_env / "kvtier.yaml").write_text("cpu_bytes: 64GiB\n")
    with pytest.raises(ConfigError) as e:
        KVTierConfig.load("kvtier.yaml", env={"KVTIER_NUM_SLOTS": "1000"})
    assert str(e.value) == both


def test_simulate_policy_module_runs_as_a_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (code, _) = _blocks(ROOT / "docs" / "simulate.md", "python")
    (tmp_path / "mypolicies.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mypolicies", raising=False)
    trace = tmp_path / "trace.jsonl"
    # Three requests sharing block 0; the third reuses blocks 0 and 1.
    requests = [[0, 1], [0, 2], [0, 1]]
    lines = [json.dumps({"input_length": 16 * len(ids), "hash_ids": ids}) for ids in requests]
    trace.write_text("\n".join(lines) + "\n")
    out = tmp_path / "rows.json"
    argv = ["simulate", str(trace), "--policies", "lru,mypolicies:Fifo", "--capacities", "2"]
    assert main([*argv, "--block-tokens", "16", "--jobs", "1", "-q", "--json", str(out)]) == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"lru", "mypolicies:Fifo", "infinite"}
    # LRU keeps the shared block 0 (hit twice); FIFO evicts it first, for one hit in all.
    assert rows["lru"]["block_hit_ratio"] == pytest.approx(2 / 6)
    assert rows["mypolicies:Fifo"]["block_hit_ratio"] == pytest.approx(1 / 6)
    monkeypatch.delitem(sys.modules, "mypolicies", raising=False)
