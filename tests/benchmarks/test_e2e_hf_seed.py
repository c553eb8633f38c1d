"""`benchmarks/e2e_hf.py --seed` refuses a seed torch cannot take in one line, before the run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from helpers import refused_argv

pytest.importorskip("transformers")


def _must_not_run(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the benchmark started its run before refusing its arguments")


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--seed", str(10**30)], f"--seed: '{10**30}' is invalid"),
        (["--seed", "-1"], "--seed: '-1' is invalid"),
        (["--seed", "x"], "--seed: 'x' is invalid"),
        # Valid alone, but part 1 seeds with seed + prefix length, past torch's range.
        (["--seed", str(2**64 - 1)], f"--seed {2**64 - 1} plus the longest of --prefixes"),
    ],
)
def test_a_seed_torch_cannot_take_is_one_line_before_the_run(
    argv: list[str],
    names: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import e2e_hf

    monkeypatch.setattr(e2e_hf, "make_demo_model", _must_not_run)
    err = refused_argv(e2e_hf.main, ["e2e_hf.py", *argv], monkeypatch, capsys)
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("e2e_hf.py: error: ") and names in last, err


def test_the_largest_seed_with_no_part_1_is_accepted(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import e2e_hf

    class Reached(Exception):
        pass

    def reached(*args: Any, **kwargs: Any) -> Any:
        raise Reached

    monkeypatch.setattr(e2e_hf, "make_demo_model", reached)
    monkeypatch.setattr(sys, "argv", ["e2e_hf.py", "--prefixes", "", "--seed", str(2**64 - 1)])
    with pytest.raises(Reached):
        e2e_hf.main()
