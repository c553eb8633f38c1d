"""`kvtier simulate`'s tables never cut a number or a policy name short: rich elided what did
not fit the console (`52,…` on an 80-column terminal, two long `module:Class` specs that
differ only at the end printed identically when piped)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli import main

_PACKAGE = "averylongpackagename_for_policies"
_MODULE = """
from kvtier.policies.lru import LRUPolicy


class FifoVariantA(LRUPolicy):
    def touch(self, keys, ctx):
        pass


class FifoVariantB(LRUPolicy):
    pass
"""
_SPECS = [f"{_PACKAGE}.experimental_module:FifoVariant{v}" for v in "AB"]


@pytest.fixture
def trace(tmp_path: Path, trace_file: Callable[[Path, list[dict[str, object]]], Path]) -> Path:
    return trace_file(
        tmp_path / "trace.jsonl",
        [{"input_length": 3000, "hash_ids": [0, 1, i, i + 1000]} for i in range(2, 300)],
    )


@pytest.fixture
def long_specs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    package = tmp_path / "pol" / _PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "experimental_module.py").write_text(_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path / "pol"))
    for name in [m for m in sys.modules if m.startswith(_PACKAGE)]:
        monkeypatch.delitem(sys.modules, name)
    return _SPECS


def _cells(row: dict[str, Any]) -> list[str]:
    """What the table prints of `row`, as text that must appear whole."""
    return [
        row["policy"],
        f"{row['capacity_blocks']:,}",
        f"{100 * row['block_hit_ratio']:.2f}",
        f"{row['loads']:,}",
        f"{row['stores']:,}",
        f"{row['evictions']:,}",
        f"{row['prefill_tokens_saved']:,}",
    ]


def _simulate(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[str, list[dict[str, Any]]]:
    rows_path = tmp_path / "rows.json"
    argv = ["simulate", str(trace), "-q", "--jobs", "1", "--json", str(rows_path), *args]
    assert main(argv) == 0
    return capsys.readouterr().out, json.loads(rows_path.read_text())


@pytest.mark.parametrize("width", [40, 80, 150])
def test_a_narrow_terminal_gets_every_number_whole(
    trace: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    width: int,
) -> None:
    from kvtier.sim import command

    monkeypatch.setattr(command, "_table_width", lambda: width)
    engine = ["--mode", "engine", "--model-shape", "llama-3-70b"]
    out, rows = _simulate(
        trace, tmp_path, capsys, "--policies", "lru,opt", "--capacities", "1%,25%", *engine
    )
    assert "…" not in out
    for row in rows:
        for cell in _cells(row):
            assert cell in out, (cell, out)
    assert "evictions" in out and "prefill" in out  # headers wrap between words, never cut


def test_piped_long_specs_are_printed_whole(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], long_specs: list[str]
) -> None:
    """Piped, the table was 200 columns: both specs printed as
    `averylongpackagename_for_policies.experim…`."""
    engine = ["--mode", "engine", "--model-shape", "llama-3-70b"]
    out, rows = _simulate(
        trace, tmp_path, capsys, "--policies", ",".join(long_specs), "--capacities", "1%", *engine
    )
    assert "…" not in out
    for spec in long_specs:
        assert spec in out
    for row in rows:
        for cell in _cells(row):
            assert cell in out


def test_advise_table_keeps_long_specs_whole(
    trace: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    long_specs: list[str],
) -> None:
    from kvtier.sim import command

    monkeypatch.setattr(command, "_table_width", lambda: 60)
    argv = ["simulate", str(trace), "-q", "--jobs", "1", "--advise"]
    assert main([*argv, "--policies", ",".join(long_specs)]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    for spec in long_specs:
        assert spec in out
