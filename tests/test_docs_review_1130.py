"""Defects found walking docs/simulate.md, configuration.md, hf.md, transfer.md and vllm.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.sim import TraceFormatError, read_trace
from kvtier.sim.readers import read_mooncake


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _late_big_block(tmp_path: Path) -> Path:
    """1,000 lines that allow any size of 100 tokens or more (512 is inferred), then one that
    needs blocks of 600 tokens or more: past the lines the size is inferred from."""
    rows: list[dict[str, object]] = [{"input_length": 100, "hash_ids": [i]} for i in range(1000)]
    rows.append({"input_length": 600, "hash_ids": [5000]})
    return _write(tmp_path / "late.jsonl", rows)


def test_a_line_past_the_inferred_block_size_names_it_and_the_option(tmp_path: Path) -> None:
    path = _late_big_block(tmp_path)
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    message = str(info.value)
    assert message.startswith(f"{path}:1001: input_length=600 does not fit 1 block of 512 ")
    assert "512 is the block size inferred from the trace's first lines" in message
    assert "this line fits blocks of 600 or more tokens" in message
    assert message.endswith("(--block-tokens)")
    # The suggestion works: with the size given, the same trace reads.
    assert read_trace(path, block_tokens=600).num_blocks == 1001
    # A size the caller chose is reported as before, without an inference to blame.
    for reading in (lambda: read_trace(path, block_tokens=512), lambda: list(read_mooncake(path))):
        with pytest.raises(TraceFormatError, match=r"late\.jsonl:1001: ") as given:
            reading()
        assert str(given.value).endswith("expected 1..512")


def test_the_cli_error_for_a_late_line_suggests_block_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _late_big_block(tmp_path)
    args = ["simulate", str(path), "--policies", "lru", "--capacities", "1", "-q", "--jobs", "1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{path}:1001: input_length=600 does not fit" in err
    assert "512 is the block size inferred" in err and "(--block-tokens)" in err


def test_the_hint_gives_the_range_of_sizes_a_multi_block_line_fits(tmp_path: Path) -> None:
    # Line 1 pins the size to 2 tokens (3 tokens in 2 blocks); line 2 needs 33..49 (3 blocks).
    rows: list[dict[str, object]] = [
        {"input_length": 3, "hash_ids": [1, 2]},
        {"input_length": 99, "hash_ids": [3, 4, 5]},
    ]
    path = _write(tmp_path / "pinned.jsonl", rows)
    with pytest.raises(TraceFormatError, match=r"pinned\.jsonl:2: ") as info:
        read_trace(path)
    assert "2 is the block size inferred" in str(info.value)
    assert "this line fits blocks of 33..49 tokens" in str(info.value)
    # An input_length of 0 with ids fits no block size: --block-tokens would not help there.
    rows.append({"input_length": 0, "hash_ids": [6]})
    zero = _write(tmp_path / "zero.jsonl", [rows[0], rows[2]])
    with pytest.raises(TraceFormatError, match=r"zero\.jsonl:2: input_length=0 does not fit") as e:
        read_trace(zero)
    assert "--block-tokens" not in str(e.value)


def test_policies_help_names_the_bounds_it_lists(capsys: pytest.CaptureFixture[str]) -> None:
    # `kvtier policies` also prints opt and infinite (docs/simulate.md): its help says so.
    assert main(["policies"]) == 0
    assert "simulator bounds" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        main(["policies", "--help"])
    assert done.value.code == 0
    assert "and the simulator's bounds" in capsys.readouterr().out
