"""benchmarks/manager_ops.py: what its calls/s counts, and policies measured in turn."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import manager_ops
from kvtier.base import LookupResult, ReqContext
from kvtier.cpu import CPUOffloadingManager


def test_the_policies_take_turns_round_by_round(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each policy's repeats ran back to back, so the machine's drift between policies went into
    # their ratio (kvaware against LRU, say) instead of reaching every policy alike.
    order: list[str] = []

    def replay(workload: Any, policy: str, num_slots: int) -> tuple[int, int, float, float]:
        order.append(policy)
        return 10, 20, 0.5, 0.25

    monkeypatch.setattr(manager_ops, "replay_kvtier", replay)
    workload = [[manager_ops._key(i) for i in range(4)]]
    rows = manager_ops.run({"w": workload}, ["lru", "arc", "sieve"], 3)
    assert order == ["lru", "arc", "sieve", "arc", "sieve", "lru", "sieve", "lru", "arc"]
    assert [r["policy"] for r in rows] == ["lru", "arc", "sieve"]
    assert all(r["calls_per_s"] == 20 and r["seconds_median"] == 0.5 for r in rows)


def test_calls_counts_every_call_after_on_new_request() -> None:
    # What the docstring and docs/benchmarks.md say calls/s counts.
    made: list[str] = []

    class Counting:
        def __init__(self) -> None:
            self.inner = CPUOffloadingManager(40, "lru", enable_events=True)

        def __getattr__(self, name: str) -> Any:
            method = getattr(self.inner, name)

            def call(*args: Any, **kwargs: Any) -> Any:
                made.append(name)
                return method(*args, **kwargs)

            return call

    workload = manager_ops.zipf_workload(30)
    calls, _, _, _ = manager_ops.replay(workload, Counting(), ReqContext, LookupResult.HIT)
    assert made.count("on_new_request") == len(workload)
    assert calls == len(made) - len(workload)
