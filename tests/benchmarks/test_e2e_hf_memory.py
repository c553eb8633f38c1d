"""`benchmarks/e2e_hf.py` refuses runs whose KV cannot fit in memory in one line, before
building the model (before, a huge --prefixes or --fresh-tokens failed allocating, with a
traceback, after minutes of other work)."""

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
    "argv",
    [
        ["--prefixes", str(16 * 10**9)],
        ["--fresh-tokens", str(10**11)],
        ["--size", "1b", "--prefixes", str(16 * 10**8)],
    ],
)
def test_runs_past_the_machines_memory_are_one_line(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import e2e_hf

    monkeypatch.setattr(e2e_hf, "make_demo_model", _must_not_run)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = refused_argv(e2e_hf.main, ["e2e_hf.py", *argv], monkeypatch, capsys)
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("e2e_hf.py: error: --prefixes ") and "more than this machine" in last


def test_the_default_runs_fit_a_small_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    import e2e_hf

    args = argparse.Namespace(size="demo", dtype="float32", tail=64, repeats=7,
                              fresh_tokens=1024, new_tokens=16)  # fmt: skip
    assert e2e_hf._kv_bytes(args, [1024, 4096, 8192]) < 2**30
    args.size, args.dtype = "1b", "bfloat16"
    assert e2e_hf._kv_bytes(args, [1024, 4096, 8192]) < 8 * 2**30
