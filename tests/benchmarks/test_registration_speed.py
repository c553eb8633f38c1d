"""benchmarks/registration_speed.py: registration time of tensors split into many parts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import registration_speed
from kvtier.transfer import KVCacheRegistration


@pytest.mark.parametrize("arrangement", registration_speed.ARRANGEMENTS)
def test_each_arrangement_splits_into_its_parts_as_it_says(arrangement: str) -> None:
    kv = registration_speed.kv_tensor(6, arrangement)
    segments = kv.segments()
    assert len(segments) == 6
    strides = {s.stride for s in segments}
    if arrangement == "contiguous":  # one part's rows, then the next part's
        assert strides == {registration_speed.WIDTH}
        assert segments[1].address - segments[0].address == kv.num_blocks * strides.pop()
    else:  # every part's row of block b, then block b + 1's
        assert strides == {6 * registration_speed.WIDTH}
        assert segments[1].address - segments[0].address == registration_speed.WIDTH
        assert len(KVCacheRegistration([kv]).segments(0)) == 1  # merged into one


def test_the_table_has_a_row_per_case_and_matches_the_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.json"
    argv = ["registration_speed.py", "--parts", "8,32", "--repeats", "2", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    registration_speed.main()
    captured = capsys.readouterr()
    rows = json.loads(out.read_text())
    cases = [(p, a) for p in (8, 32) for a in registration_speed.ARRANGEMENTS]
    assert [(r["parts"], r["arrangement"]) for r in rows] == cases
    for r in rows:
        assert len(r["seconds"]) == 2 and min(r["seconds"]) <= r["median_seconds"]
        assert f"{r['parts']:>7} {r['arrangement']:<12} {r['median_seconds']:>9.3f}" in captured.out
    assert captured.err.splitlines() == ["8 parts ...", "32 parts ..."]  # one per size
