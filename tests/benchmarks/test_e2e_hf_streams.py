"""`benchmarks/e2e_hf.py` reports progress on stderr; stdout keeps the tables."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

pytest.importorskip("transformers")


class _Model:
    def to(self, **kwargs: Any) -> _Model:
        return self


def test_progress_lines_go_to_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # They went through the tables' console, onto stdout between the results.
    import e2e_hf

    def bench_prefix(model: Any, p: int, tail: int, repeats: int, seed: int) -> dict[str, Any]:
        keys = ("ttft_recompute_s", "ttft_kvtier_s", "copy_gbps", "tail_forward_s", "bound_s",
                "kvtier_over_bound", "speedup_vs_recompute")  # fmt: skip
        return {"prefix_tokens": p, "bytes_loaded": 1 << 20, **dict.fromkeys(keys, 1.0)}

    def bench_fresh(*args: Any) -> dict[str, float]:
        log: Callable[[str], None] = args[-1]
        log("nothing repeats: round 1 of 1 done")
        out = {"kvtier_outside_model_s": 0.001, "bytes_stored_per_request": 1.0}
        for key in ("request", "ttft", "cpu"):
            for name in ("kvtier", "plain", "paged", "overhead", "overhead_paired", "own_work",
                         "own_work_paired"):  # fmt: skip
                out[f"{key}_{name}" + ("_s" if name in ("kvtier", "plain", "paged") else "")] = 0.5
        return out

    monkeypatch.setattr(e2e_hf, "make_demo_model", lambda *a, **k: (_Model(), None))
    monkeypatch.setattr(e2e_hf, "bench_prefix", bench_prefix)
    monkeypatch.setattr(e2e_hf, "bench_fresh", bench_fresh)
    monkeypatch.setattr(sys, "argv", ["e2e_hf.py", "--prefixes", "64,128"])
    e2e_hf.main()
    out, err = capsys.readouterr()
    assert "done" not in out
    assert "TTFT, cached prefix" in out and "nothing repeats" in out
    assert err.splitlines() == [
        "prefix 64: done",
        "prefix 128: done",
        "nothing repeats: round 1 of 1 done",
    ]
