"""benchmarks/vs_vllm.py `--max-batched-tokens`: vLLM prefills the prompts over several steps,
and kvtier's LRU still keeps each prompt's head (the connector's `prefix_extended`)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from helpers import vs_vllm_reuse_trace


def _child(trace: Path, capsys: pytest.CaptureFixture[str], *options: str) -> dict[str, Any]:
    """Window 0's run of a scheduler child, in this process: a host tier of 283 slots, so the
    shared 20-block prompt comes back when 280 new blocks have been stored since."""
    import vs_vllm

    argv = ["--scheduler-child", f"--trace={trace}", "--sched-requests=46", "--capacity=0.33"]
    argv.append("--sched-offsets=0")
    assert vs_vllm.main([*argv, "--sched-policy=lru", *options]) == 0
    (run,) = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert run["num_slots"] == 283
    return dict(run)


def test_a_prompt_prefilled_over_several_steps_keeps_its_head_in_kvtiers_lru(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = vs_vllm_reuse_trace(tmp_path / "reuse.jsonl", second_window=True)
    run = _child(trace, capsys, "--max-batched-tokens=64")  # 4 blocks a step
    assert run["batch_tokens"] == 64
    # Stored 4 chunks a step, the shared prompt's head was the oldest of its chunks, and the
    # LRU evicted it first: kvtier served none of it (0.0), though vLLM's LRU, which ranks a
    # request's chunks together, serves part (how much depends on PYTHONHASHSEED, see
    # compare_schedulers; kvtier's figure does not).
    assert run["vllm_hit_ratio"] > 0
    assert run["kvtier_hit_ratio"] > 0.04
    one_step = _child(trace, capsys)  # each prompt prefilled in one step
    assert one_step["batch_tokens"] == 8192
    assert one_step["kvtier_hit_ratio"] > 0.04
