"""`kvtier simulate --advise --model-shape`: the answer in host memory, the number the question
"how much memory is worth giving the tier" is about. Before, the shape was accepted and its
bytes shown nowhere."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.sim.shapes import parse_model_shape


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    # A shared head block and 40 users, each back for a second turn: reuse to size for.
    rows = [{"input_length": 1000, "hash_ids": [0, 1 + i % 40]} for i in range(80)]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_advise_with_a_model_shape_gives_each_answer_in_bytes(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    block_bytes = parse_model_shape("llama-3-8b").block_bytes(512)
    out = tmp_path / "a.csv"
    args = ["simulate", str(trace), "--advise", "--policies", "lru,opt", "--jobs", "1", "-q"]
    assert main([*args, "--model-shape", "llama-3-8b", "--json", "-", "--csv", str(out)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in rows] == ["lru", "opt"]
    for row in rows:
        assert row["capacity_blocks"] >= 1
        assert row["capacity_bytes"] == row["capacity_blocks"] * block_bytes
    written = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [int(r["capacity_bytes"]) for r in written] == [r["capacity_bytes"] for r in rows]
    # The table shows the same in GiB.
    assert main([*args, "--model-shape", "llama-3-8b"]) == 0
    table = capsys.readouterr().out
    assert "GiB" in table
    gib = rows[0]["capacity_blocks"] * block_bytes / 2**30
    assert f"{gib:,.1f}" in table


def test_advise_without_a_shape_has_no_byte_column(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["simulate", str(trace), "--advise", "--policies", "lru", "--jobs", "1", "-q"]
    assert main([*args, "--json", "-"]) == 0
    assert "capacity_bytes" not in json.loads(capsys.readouterr().out)[0]
    assert main(args) == 0
    assert "GiB" not in capsys.readouterr().out
