"""Through vLLM's real scheduler: a preempted request offers its chunks for storing again when
it runs again, from the first, as vLLM's own OffloadingConnector does. Before, a chunk offered
once (then evicted, or turned away for room) was never offered by that request again."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import BLOCK_SIZE, Engine, make_engine
from test_vllm import assert_no_leaks, expect_loaded, kvtier_side, step_until_running, vllm_loaded

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm


def test_chunks_evicted_while_it_ran_are_stored_again_after_a_preemption(
    vllm_loaded: None,
) -> None:
    """A 4-slot tier: "a" stores its 2 prompt chunks, "c" stores 4 and evicts them, then "a"
    is preempted and recomputes its prompt. Its chunks are offered again and stored (before:
    never, as they had been offered once), and serve a later request."""
    engine = make_engine("KVTierConnector", {"cpu_bytes_to_use": "64KiB"})
    side = kvtier_side(engine)
    assert side.manager.get_stats().num_slots == 4
    prompt = list(range(1, 2 * BLOCK_SIZE + 9))  # 40 tokens: 2 full chunks
    a = engine.add("a", prompt, max_tokens=40)
    while a.num_output_tokens < 2:
        engine.step()
    assert side.manager.get_stats().stores == 2
    engine.add("c", list(range(1000, 1000 + 4 * BLOCK_SIZE + 1)), max_tokens=1)
    _run_until_finished(engine, "c")
    engine.step()  # c's stores end: a finished request holding blocks would block the reset
    assert side.manager.get_stats().evictions == 2  # a's chunks
    assert engine.scheduler.reset_prefix_cache(reset_running_requests=True)
    assert a.num_preemptions == 1
    engine.run_until(["a"])
    assert side.manager.get_stats().stores == 2 + 4 + 2
    assert engine.scheduler.reset_prefix_cache()
    for t in engine.kv_caches.values():
        t.zero_()  # only a load from kvtier can bring the bytes back
    engine.add("b", [*prompt, 900])
    step_until_running(engine, "b")
    expect_loaded(engine, "b", [*prompt, 900], 2 * BLOCK_SIZE)
    engine.run_until(["b"])
    assert_no_leaks(engine)
    engine.worker.shutdown()


def _run_until_finished(engine: Engine, req_id: str) -> None:
    for _ in range(50):
        if req_id in engine.finished:
            return
        engine.step()
    raise AssertionError(f"{req_id} did not finish")
