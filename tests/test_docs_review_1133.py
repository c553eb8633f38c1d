"""Lists and quoted messages in the docs that must follow the code: the demo's JSON keys, the
vLLM install and metric names, the policy names, the simulator's refusals and row fields."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.policies.base import registered_policies

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _text(name: str) -> str:
    return (ROOT / name).read_text()


def _table_names(text: str, header: str) -> list[str]:
    """The backticked names in the first column of the table under `header` (a line of it)."""
    lines = text[text.index(header) :].splitlines()[1:]
    names: list[str] = []
    for line in lines:
        if not line.startswith("|"):
            if names:
                break
            continue
        first = line.strip("|").split("|")[0]
        names += re.findall(r"`(\w+)`", first)
    return names


def test_hf_demo_json_keys_are_the_result_fields() -> None:
    """docs/hf.md's `--json` table names every key `kvtier demo` writes, in its order."""
    from kvtier.demo import LOGIT_RTOL, DemoOptions, DemoResult

    doc = _text("docs/hf.md")
    keys = _table_names(doc, "instead of the table. Its keys:")
    assert keys == [f.name for f in dataclasses.fields(DemoResult)]
    options = re.search(r"\| `options` \| the workload: ([^|]*)\|", doc)
    assert options is not None
    assert [n for n in re.findall(r"`(\w+)`", options.group(1)) if n != "null"] == [
        f.name for f in dataclasses.fields(DemoOptions)
    ]
    # The exit status's logit tolerance, as hf.md and the README state it.
    hf = re.search(r"within (\S+) × recomputation's largest", " ".join(doc.split()))
    readme_text = " ".join(_text("README.md").split())
    readme = re.search(r"every logit within (\S+) of the largest", readme_text)
    assert hf is not None and readme is not None
    assert float(hf.group(1)) == float(readme.group(1)) == LOGIT_RTOL


def test_vllm_cpu_install_commands_are_the_setup_scripts() -> None:
    """docs/vllm.md shows how setup.sh installs vLLM on CPU: the same pins, line for line."""
    doc = _text("docs/vllm.md")
    block = re.search(r"```bash\n(python -m pip install --no-deps \"vllm==.*?)```", doc, re.DOTALL)
    assert block is not None
    shown = block.group(1).strip().splitlines()
    setup = _text("scripts/setup.sh")
    done = [
        " ".join(line.split()).replace(" -q ", " ")
        for line in setup.splitlines()
        if "python -m pip install" in line
    ]
    for command in shown:
        assert command in done, command
    assert len(shown) == 3


def _dict_keys(path: Path, name: str) -> list[str]:
    """The keys of the module-level dict literal `name` in `path`, without importing it (the
    vLLM stats module imports vLLM)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.AnnAssign | ast.Assign) and isinstance(node.value, ast.Dict):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return [
                    k.value
                    for k in node.value.keys
                    if isinstance(k, ast.Constant) and isinstance(k.value, str)
                ]
    raise AssertionError(f"{name} not found in {path}")


def test_vllm_metrics_tables_name_every_counter_and_gauge() -> None:
    stats = ROOT / "src" / "kvtier" / "integrations" / "vllm" / "stats.py"
    counters, gauges = _dict_keys(stats, "COUNTERS"), _dict_keys(stats, "GAUGES")
    doc = _text("docs/vllm.md")
    table = _table_names(doc, "labels. The counters (`kvtier.integrations.vllm.stats`):")
    assert table == counters
    prose = " ".join(doc[doc.index("The gauges, sent with") :].split())
    prose = prose[: prose.index("is the tier's usage")]
    assert re.findall(r"`(\w+)` \(", prose) == gauges


def test_docs_name_every_registered_policy() -> None:
    names = list(registered_policies())
    vllm = " ".join(_text("docs/vllm.md").split())
    listed = re.search(r"\(`kvtier_lru`[^)]*\)", vllm)
    assert listed is not None
    assert sorted(re.findall(r"`kvtier_(\w+)`", listed.group(0))) == names
    row = re.search(r"\| kvtier cache policy: ([^|]*?), or `pkg\.module:Class`", vllm)
    assert row is not None and sorted(re.findall(r"`(\w+)`", row.group(1))) == names
    config = _text("docs/configuration.md")
    row = re.search(r"a registered name \(([^;]*);", config)
    assert row is not None and sorted(re.findall(r"`(\w+)`", row.group(1))) == names


def test_configuration_names_the_variables_that_are_not_settings() -> None:
    from kvtier.config import _ENV_NOT_SETTINGS

    doc = " ".join(_text("docs/configuration.md").split())
    start = doc.index("Besides `KVTIER_CONFIG`, five environment variables")
    part = doc[start : doc.index("A misspelt one is an unknown key", start)]
    named = set(re.findall(r"`(KVTIER_[A-Z_]+)", part)) - {"KVTIER_CONFIG"}
    assert named == set(_ENV_NOT_SETTINGS) - {"KVTIER_CONFIG"}
    assert len(named) == 5


def test_simulate_model_shape_presets_are_the_codes() -> None:
    from kvtier.sim import MODEL_PRESETS

    doc = " ".join(_text("docs/simulate.md").split())
    match = re.search(r"`--model-shape` takes a preset \(([^)]*)\)", doc)
    assert match is not None
    assert re.findall(r"`([\w.-]+)`", match.group(1)) == list(MODEL_PRESETS)


def _trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    rows = [{"input_length": 32, "hash_ids": [i, i + 1]} for i in range(5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_simulate_row_fields_are_written_and_the_last_come_last(tmp_path: Path) -> None:
    doc = _text("docs/simulate.md")
    fields = _table_names(doc, "## What a row reports")
    out = tmp_path / "rows.json"
    argv = ["simulate", str(_trace(tmp_path)), "--policies", "lru", "--capacities", "2"]
    assert main([*argv, "--block-tokens", "16", "--jobs", "1", "-q", "--json", str(out)]) == 0
    (row, _infinite) = json.loads(out.read_text())
    assert set(fields) <= set(row), set(fields) - set(row)
    last = re.search(r"`(\w+)`, `(\w+)` and `(\w+)` come last", " ".join(doc.split()))
    assert last is not None and list(row)[-3:] == list(last.groups())


def test_simulate_quoted_messages_are_the_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = " ".join(_text("docs/simulate.md").split())
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    # "A file without a line to read is "the trace is empty" whatever `--format` says".
    said = re.search(r'A file without a line to read is "([^"]+)" whatever `--format` says', doc)
    assert said is not None
    for fmt in ("auto", "mooncake", "tokens"):
        argv = ["simulate", str(empty), "--format", fmt, "--capacities", "1", "-q"]
        assert main([*argv, "--jobs", "1"]) == 2
        assert f"{empty}: {said.group(1)};" in capsys.readouterr().err
    # "(`cannot write to --csv file 'r.csv': ...` ..., exit 2)", on a disk that is full.
    quoted = re.search(r"\(`(cannot write to --csv file )'r\.csv'(: )\.\.\.`", doc)
    assert quoted is not None
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full to fail a write")
    argv = ["simulate", str(_trace(tmp_path)), "--policies", "lru", "--capacities", "2", "-q"]
    assert main([*argv, "--jobs", "1", "--csv", "/dev/full"]) == 2
    err = capsys.readouterr().err
    assert f"{quoted.group(1)}'/dev/full'{quoted.group(2)}" in err
