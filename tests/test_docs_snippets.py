"""Snippets of README.md, docs/configuration.md, docs/policies.md and docs/simulate.md run as
written (the connector, transfer and hf pages have their own test_docs.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.base import ReqContext, make_offload_key
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


def test_policies_admission_example_runs() -> None:
    (code,) = _blocks(ROOT / "docs" / "policies.md", "python")
    scope: dict[str, object] = {}
    exec(compile(code, "docs/policies.md", "exec"), scope)
    manager: Any = scope["manager"]
    long = [make_offload_key(bytes([9, i]) * 16, 0) for i in range(8)]
    ctx = ReqContext("req-2", key_positions={k: 256 * (i + 1) for i, k in enumerate(long)})
    assert manager.prepare_store(long, ctx).keys_to_store == long  # 2,048 tokens: stored
    assert manager.get_stats().stores_skipped == 2  # the short prompt's chunks


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


def test_configuration_toml_example_is_the_yaml_example(clean_env: Path) -> None:
    """The TOML block says it is "the same in TOML": each key it sets loads as the YAML's."""
    doc = ROOT / "docs" / "configuration.md"
    (clean_env / "kvtier.yaml").write_text(_blocks(doc, "yaml")[0])
    (toml,) = _blocks(doc, "toml")
    (clean_env / "kvtier.toml").write_text(toml)
    from_yaml = KVTierConfig.load("kvtier.yaml", env={}).to_dict()
    from_toml = KVTierConfig.load("kvtier.toml", env={}).to_dict()
    keys = {line.split("=")[0].strip() for line in toml.splitlines() if "=" in line}
    assert keys and {k: from_toml[k] for k in keys} == {k: from_yaml[k] for k in keys}
    assert (from_yaml["cpu_bytes"], from_yaml["chunk_tokens"]) == (64 * 2**30, 256)


def test_configuration_override_example_overrides_the_file(clean_env: Path) -> None:
    """`export KVTIER_CONFIG=...` then `KVTIER_X=... python serve.py`: the variables win."""
    doc = ROOT / "docs" / "configuration.md"
    (clean_env / "kvtier.yaml").write_text(_blocks(doc, "yaml")[0])
    (override,) = _blocks(doc, "bash")
    env: dict[str, str] = {}
    for word in override.split():
        name, eq, value = word.removeprefix("export ").partition("=")
        if eq and name.startswith("KVTIER_"):
            env[name] = value
    assert env.pop("KVTIER_CONFIG") == "/etc/kvtier/kvtier.yaml"
    cfg = KVTierConfig.load(env={**env, "KVTIER_CONFIG": str(clean_env / "kvtier.yaml")})
    assert (cfg.cache_policy, cfg.store_threshold) == ("lru", 0)  # from the variables
    assert (cfg.cpu_bytes, cfg.chunk_tokens) == (64 * 2**30, 256)  # from the file


def test_readme_commands_are_the_scripts_they_name() -> None:
    commands = [block.strip() for block in _blocks(ROOT / "README.md", "bash")]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    assert 'kvtier demo "$@"' in demo  # "Extra arguments go to `kvtier demo`"
    test = (ROOT / "scripts" / "test.sh").read_text()
    # "runs ruff, mypy and pytest (extra arguments go to pytest)"
    assert "ruff check" in test and "\nmypy" in test and 'pytest -q "$@"' in test


def test_demo_script_passes_relative_paths_from_where_it_was_called(tmp_path: Path) -> None:
    # setup.sh moves to the repository root; `--model mymodel` named the caller's directory.
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "activate").write_text(f'export PATH="{venv}:$PATH"\n')
    stubs = {"python": "exit 0", "kvtier": 'echo "$PWD" "$@"'}  # installs skipped
    for name, body in stubs.items():
        (venv / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (venv / name).chmod(0o755)
    caller = tmp_path / "caller"
    caller.mkdir()
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "demo.sh"), "--model", "mymodel"],
        cwd=caller,
        env={**os.environ, "KVTIER_VENV": str(venv.parent), "KVTIER_WITH_VLLM": "0"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == [str(caller), "demo", "--model", "mymodel"]


def test_readme_vllm_transfer_config_builds_a_config() -> None:
    import ast
    import importlib.util

    readme = (ROOT / "README.md").read_text()
    match = re.search(r"--kv-transfer-config '(\{.*?\})'", readme, flags=re.DOTALL)
    assert match is not None
    transfer = json.loads(match.group(1))
    cfg = KVTierConfig.from_vllm_extra_config(transfer["kv_connector_extra_config"])
    assert cfg.cpu_bytes == 64 * 2**30
    # The module and class it names exist (without importing vLLM, which takes seconds).
    spec = importlib.util.find_spec(transfer["kv_connector_module_path"])
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    exported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert transfer["kv_connector"] in exported


def test_configuration_table_matches_the_code() -> None:
    """Each row's default, env var and vLLM alias are the code's, and every field has a row."""
    import dataclasses

    import yaml

    from kvtier.config import _VLLM_ALIASES

    text = (ROOT / "docs" / "configuration.md").read_text()
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("| `")
    ]
    fields = {f.name: f.default for f in dataclasses.fields(KVTierConfig)}
    aliases = {name: alias for alias, name in _VLLM_ALIASES.items()}
    documented = []
    for key, _type, default, env, alias, _meaning in rows:
        name = key.strip("`")
        documented.append(name)
        assert yaml.safe_load(default.strip("`")) == fields[name], name
        assert env == f"`KVTIER_{name.upper()}`", name
        assert alias.strip("`") == aliases.get(name, ""), name
    assert documented == list(fields)


def test_every_kvtier_variable_the_docs_name_is_read_or_left_alone() -> None:
    """A variable the docs tell users to set must not make `load()` fail as an unknown key."""
    names = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        names |= set(re.findall(r"\bKVTIER_[A-Z0-9_]*[A-Z0-9]", doc.read_text()))
    names -= {"KVTIER_STORE_TRESHOLD", "KVTIER_CONFIG"}  # the typo example; the file's name
    assert "KVTIER_WITH_VLLM" in (ROOT / "scripts" / "setup.sh").read_text()
    for name in sorted(names | {"KVTIER_WITH_VLLM", "KVTIER_VENV"}):
        try:
            KVTierConfig.load(env={name: "1"})
        except ConfigError as e:
            assert "unknown key" not in str(e), name


def test_readme_scheduler_side_needs_only_the_base_dependencies() -> None:
    """README: the scheduler-side modules need numpy, msgspec, pyyaml and rich, not torch."""
    import subprocess

    readme = " ".join((ROOT / "README.md").read_text().split())
    match = re.search(r"The scheduler side \(([^)]*)\) needs only", readme)
    assert match is not None
    modules = re.findall(r"`(\w+)`", match.group(1))
    assert modules == ["base", "hashing", "config", "policies", "admission", "cpu", "sim"]
    code = (
        "import sys\n"
        + "".join(f"import kvtier.{m}\n" for m in modules)
        + "import kvtier.sim.command, kvtier.sim.runner, kvtier.cli\n"
        + "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[]\n"


def test_simulate_from_python_snippet_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The "From Python" snippet as written, on the first 200 requests of the trace it names
    (the whole trace takes seconds); then the streaming replay the text after it describes."""
    from kvtier.sim import iter_trace, make_manager, read_trace, replay_engine, replay_flat

    doc = ROOT / "docs" / "simulate.md"
    (_, code) = _blocks(doc, "python")
    path = "data/traces/mooncake_conversation/conversation_trace.jsonl"
    assert f'read_trace("{path}")' in code
    with (ROOT / path).open() as f:
        head = [next(f) for _ in range(200)]
    (tmp_path / path).parent.mkdir(parents=True)
    (tmp_path / path).write_text("".join(head))
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(doc), "exec"), {})
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert [row[0] for row in rows] == ["lru", "opt", "infinite"]
    lru, opt, infinite = (float(row[1]) for row in rows)
    assert 0 < lru <= opt <= infinite  # block hit ratios, each bounded by the next

    # "`replay_flat(iter_trace(path), manager)` reads one line at a time": the same result.
    trace = read_trace(path)
    streamed = replay_flat(iter_trace(path), make_manager("lru", 100))
    assert streamed.block_hit_ratio == replay_flat(trace, make_manager("lru", 100)).block_hit_ratio
    engine = replay_engine(trace, make_manager("lru", 100), device_blocks=20)
    assert 0 <= engine.block_hit_ratio <= infinite
