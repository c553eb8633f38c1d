"""Lifecycle faults of KVTierConnector through the real vLLM Scheduler: requests preempted
by a reset between steps, then admitted again or aborted."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import BLOCK_SIZE, make_engine
from test_vllm import (
    EXTRA,
    PROMPT,
    _swap_transfer,
    assert_no_leaks,
    expect_loaded,
    kvtier_side,
    step_until_running,
    vllm_loaded,
)

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm


def test_request_preempted_by_a_reset_loads_when_admitted_again(vllm_loaded: None) -> None:
    """vLLM names a request preempted by `reset_prefix_cache(reset_running_requests=True)` in
    the next step's `preempted_req_ids`, after that step admitted it again with a kvtier load:
    the load must be sent, not cancelled as a job of the preempted request (which would leave
    the request waiting for remote KV forever)."""
    engine = make_engine("KVTierConnector", EXTRA)
    a = engine.add("a", PROMPT, max_tokens=12)
    side = kvtier_side(engine)
    for _ in range(3):
        engine.step()
    assert a.status.name == "RUNNING"
    assert side.manager.get_stats().stores == 4
    assert side.scheduler.num_jobs_in_flight() == 0
    assert engine.scheduler.reset_prefix_cache(reset_running_requests=True)
    for t in engine.kv_caches.values():
        t.zero_()  # only a load from kvtier can bring a's prefix back
    so = engine.step()
    assert a.request_id in so.preempted_req_ids
    assert [job.req_id for job in so.kv_connector_metadata.step.loads] == ["a"]
    step_until_running(engine, "a")
    expect_loaded(engine, "a", PROMPT, 4 * BLOCK_SIZE)
    engine.run_until(["a"], max_steps=60)
    assert_no_leaks(engine)
    assert not side._preemptions


def test_request_aborted_after_a_reset_preempted_it_fences_its_stores(vllm_loaded: None) -> None:
    """A request preempted by a reset (its blocks freed at once) and aborted before the next
    step: its stores in flight still read those blocks, so the next step's workers must wait
    for them before another request's forward pass overwrites the blocks. Otherwise the host
    tier keeps the other request's KV under the aborted request's hashes, and serves it."""
    from vllm.v1.request import RequestStatus

    engine = make_engine("KVTierConnector", EXTRA, num_gpu_blocks=16)
    # Stores are held until a worker waits for them or the forward pass after the abort ran:
    # whichever comes first decides which bytes they copy.
    release = threading.Event()

    def hold_stores(job_id: int, kind: str) -> None:
        if kind == "store":
            release.wait(60)

    _swap_transfer(engine, hold_stores)
    transfer = engine.worker.worker_side.transfer
    wait = transfer.wait
    forward = engine._forward

    def waiting(job_ids: Any) -> None:
        release.set()
        wait(job_ids)

    def forward_then_release(so: Any) -> None:
        forward(so)
        release.set()

    engine.add("a", PROMPT, max_tokens=8)
    first = engine.step(settle=False)
    store_ids = [job.job_id for job in first.kv_connector_metadata.step.stores]
    assert store_ids
    transfer.wait = waiting
    engine._forward = forward_then_release  # type: ignore[method-assign]
    a_blocks = set(engine.scheduler.kv_cache_manager.get_block_ids("a")[0])
    assert engine.scheduler.reset_prefix_cache(reset_running_requests=True)
    engine.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)

    b_prompt = [500 + i for i in range(15 * BLOCK_SIZE - 10)]  # every free block
    engine.add("b", b_prompt)
    so = engine.step(settle=False)
    b_blocks = set(engine.scheduler.kv_cache_manager.get_block_ids("b")[0])
    assert a_blocks <= b_blocks  # b's forward overwrote a's former blocks
    assert so.kv_connector_metadata.step.wait_for == store_ids
    engine.run_until(["b"], max_steps=60)
    assert kvtier_side(engine).manager.get_stats().stores >= 4

    # a's prefix, from the host tier: the bytes a computed, not b's.
    engine.scheduler.reset_prefix_cache()
    for t in engine.kv_caches.values():
        t.zero_()
    engine.add("c", [*PROMPT, 5])
    step_until_running(engine, "c")
    expect_loaded(engine, "c", [*PROMPT, 5], 4 * BLOCK_SIZE)
    engine.run_until(["c"], max_steps=60)
    assert_no_leaks(engine)
    assert not kvtier_side(engine)._preemptions
