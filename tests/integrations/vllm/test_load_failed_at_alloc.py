"""A load whose offered chunks are gone by the time vLLM allocates for it.

vLLM 0.33 defers `update_state_after_alloc` past the step that offered the load when it
defers async loads: a HiSparse host pool (`KVCacheConfig.hisparse_host_num_blocks`) with
overlapping batches (async scheduling or pipeline parallelism) and a consumer connector
(`Scheduler.defer_async_loads`). It calls it from `update_from_output` of the batch in flight
(`_drain_deferred_loads`); a reset of the host tier, or that batch's stores, may have dropped
the chunks in between. kvtier fails the load with no job, and only its workers can tell vLLM
that a load ended: the request must come back failed, never wait forever.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any, Literal

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_async_scheduling
from engine import (
    BLOCK_SIZE,
    make_kv_cache_config,
    make_vllm_config,
    step_until_output,
    token_value,
)
from test_async_scheduling import PROMPT, AsyncEngine, vllm_loaded

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_async_scheduling


def deferring_engine(
    monkeypatch: pytest.MonkeyPatch, policy: Literal["recompute", "fail"]
) -> AsyncEngine:
    """The AsyncEngine of test_async_scheduling, on a KV-cache config with a HiSparse host
    pool, so that vLLM's own scheduler decides to defer async loads."""

    def config(connector: str, extra: dict[str, Any], num_blocks: int, module: str) -> Any:
        return make_vllm_config(connector, extra, num_blocks, module, load_failure_policy=policy)

    def kv_cache_config(num_blocks: int) -> Any:
        cfg = make_kv_cache_config(num_blocks)
        cfg.hisparse_host_num_blocks = num_blocks
        return cfg

    monkeypatch.setattr(test_async_scheduling, "make_vllm_config", config)
    monkeypatch.setattr(test_async_scheduling, "make_kv_cache_config", kv_cache_config)
    engine = AsyncEngine({"cpu_bytes_to_use": "8MiB"})
    assert engine.scheduler.defer_async_loads
    return engine


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_load_gone_before_its_deferred_allocation_comes_back_failed(
    vllm_loaded: None, monkeypatch: pytest.MonkeyPatch, policy: Literal["recompute", "fail"]
) -> None:
    engine = deferring_engine(monkeypatch, policy)
    sched = engine.scheduler
    side = sched.connector.scheduler_side
    engine.add("a", PROMPT, max_tokens=2)
    engine.run_until_idle()
    assert side.manager.get_stats().stores == 4
    assert sched.reset_prefix_cache()
    for t in engine.kv_caches.values():
        t.zero_()  # only a load from kvtier could bring the bytes back

    engine.add("x", list(range(500, 540)), max_tokens=4)
    engine.step()  # x's batch in flight, not yet processed
    tokens = [*PROMPT, 8]
    b = engine.add("b", tokens, max_tokens=4)
    so = sched.schedule()  # offers b 4 blocks; vLLM defers the load behind x's batch
    assert "b" in sched.deferred_loads and b.status.name == "WAITING_FOR_REMOTE_KVS"
    engine.queue.append((so, engine._execute(so)))
    # The host tier is emptied before vLLM gets to the allocation.
    sched.reset_prefix_cache(reset_connector=True)
    engine._process_oldest()  # x's output: vLLM now runs b's update_state_after_alloc
    assert "b" not in sched.deferred_loads
    assert side.scheduler.load_jobs_failed == 1

    if policy == "recompute":
        step_until_output(engine, b)
        # vLLM recomputed b's prompt: its KV is the stand-in model's, never the zeros.
        table = sched.kv_cache_manager.get_block_ids("b")
        for name, t in engine.kv_caches.items():
            layer = int(name.split(".")[2])
            for p in range(len(PROMPT)):
                got = t[table[0][p // BLOCK_SIZE], :, p % BLOCK_SIZE, :]
                assert bool((got == token_value(tokens, p, layer)).all()), (name, p)
    engine.run_until_idle()  # the old adapter dropped the failure: b waited forever
    assert {"b", "x"} <= engine.finished
    if policy == "recompute":
        assert b.num_output_tokens == 4
    else:
        assert b.status.name == "FINISHED_ERROR"
    assert side.manager.get_stats().loads == 0
    assert side.scheduler.num_jobs_in_flight() == 0
    assert side.scheduler.num_requests() == 0
    assert side.manager.get_stats().pinned == 0
    assert not (side._requests or side._loads or side._loading)
    assert not side._failed_at_alloc
    assert not engine.worker.worker_side._jobs
    assert not sched.requests
