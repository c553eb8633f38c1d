"""`release_finished_blocks` through vLLM 0.33's real Scheduler: a finished request's device
blocks go back to vLLM at once while its stores still read them, and a step that gives one of
them to another request waits (in the workers' `handle_preemptions`, before anything writes
the block) for those stores. Without that wait the other request's KV would be copied into
the host slots under the finished request's keys, and served later as its prefix."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
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
    assert_no_leaks,
    expect_loaded,
    gate,
    kvtier_side,
    step_until_running,
    vllm_loaded,
)

__all__ = ["vllm_loaded"]

RELEASE = {**EXTRA, "release_finished_blocks": True}  # the default, spelled out
OTHER = list(range(1000, 1000 + 13 * BLOCK_SIZE))  # 13 blocks: needs some of a's 5


def _abort_with_stores_held(engine: Any) -> tuple[threading.Event, list[int]]:
    """Request "a" prefilled, its 4 stores held at the gate, then aborted."""
    from vllm.v1.request import RequestStatus

    opened = gate(engine)
    engine.add("a", PROMPT, max_tokens=8)
    so = engine.step(settle=False)
    jobs = [j.job_id for j in so.kv_connector_metadata.step.stores]
    assert jobs
    a_blocks = set(engine.scheduler.kv_cache_manager.get_block_ids("a")[0])
    engine.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert "a" not in engine.scheduler.requests  # released at once, nothing held
    assert not engine.scheduler.connector.has_pending_block_frees()
    assert kvtier_side(engine).scheduler.job_ids_in_flight() == jobs
    return opened, sorted(a_blocks)


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "fence-disabled"])
def test_a_reused_block_waits_for_the_store_that_reads_it(
    vllm_loaded: None, monkeypatch: pytest.MonkeyPatch, fenced: bool
) -> None:
    from kvtier.connector import OffloadingScheduler

    if not fenced:
        # The negative control: what the fence prevents.
        monkeypatch.setattr(OffloadingScheduler, "blocks_allocated", lambda self, ids: None)
    engine = make_engine("KVTierConnector", RELEASE, num_gpu_blocks=16)
    opened, a_blocks = _abort_with_stores_held(engine)
    timer = threading.Timer(1.0, opened.set)  # a fenced step waits for this
    timer.start()
    engine.add("b", OTHER, max_tokens=2)
    start = time.monotonic()
    so = engine.step(settle=False)
    waited = time.monotonic() - start
    timer.join()
    b_blocks = set(engine.scheduler.kv_cache_manager.get_block_ids("b")[0])
    assert b_blocks & set(a_blocks), "expected b to be given some of a's blocks"
    wait_for = so.kv_connector_metadata.step.wait_for
    if fenced:
        assert wait_for and waited >= 0.9
    else:
        assert not wait_for and waited < 0.9
    engine.run_until(["b"])
    # Load a's prefix from the host tier alone: right bytes only if the stores copied a's KV.
    assert engine.scheduler.reset_prefix_cache()
    for t in engine.kv_caches.values():
        t.zero_()
    engine.add("c", [*PROMPT, 5])
    step_until_running(engine, "c")
    if fenced:
        expect_loaded(engine, "c", PROMPT, 4 * BLOCK_SIZE)
    else:
        with pytest.raises(AssertionError):
            expect_loaded(engine, "c", PROMPT, 4 * BLOCK_SIZE)
    engine.run_until(["c"])
    assert_no_leaks(engine)


def test_a_finished_requests_stores_complete_and_serve_later_requests(vllm_loaded: None) -> None:
    """The common case: requests finish with their stores in flight, blocks released, and a
    later request loads what they stored."""
    engine = make_engine("KVTierConnector", EXTRA, num_gpu_blocks=32)  # the default
    engine.add("a", PROMPT)
    engine.run_until(["a"])
    side = kvtier_side(engine)
    assert side.manager.get_stats().stores == 4
    assert engine.scheduler.reset_prefix_cache()
    for t in engine.kv_caches.values():
        t.zero_()
    engine.add("b", [*PROMPT, 900])
    step_until_running(engine, "b")
    expect_loaded(engine, "b", PROMPT, 4 * BLOCK_SIZE)
    engine.run_until(["b"])
    assert_no_leaks(engine)


def test_a_prefix_hit_on_released_blocks_does_not_wait(vllm_loaded: None) -> None:
    """A next turn that finds a finished request's blocks in vLLM's prefix cache only reads
    them, as the stores do: no fence, no stall (vLLM's own connector waits here)."""
    engine = make_engine("KVTierConnector", RELEASE, num_gpu_blocks=32)
    opened, a_blocks = _abort_with_stores_held(engine)
    engine.add("b", [*PROMPT, 7, 8, 9])
    start = time.monotonic()
    so = engine.step(settle=False)
    assert time.monotonic() - start < 0.9
    b_table = engine.scheduler.kv_cache_manager.get_block_ids("b")[0]
    assert set(b_table[:4]) <= set(a_blocks)  # b read a's four full blocks from the cache
    assert so.kv_connector_metadata.step.wait_for == []
    opened.set()
    engine.run_until(["b"])
    assert kvtier_side(engine).manager.get_stats().stores == 4
    assert_no_leaks(engine)


def test_a_load_into_a_released_block_waits_for_its_store(vllm_loaded: None) -> None:
    """A load is planned for a request vLLM does not schedule in that step (it waits for the
    load), so its blocks are not in the step's output: they are fenced when allocated."""
    engine = make_engine("KVTierConnector", RELEASE, num_gpu_blocks=16)
    z = list(range(2000, 2069))
    engine.add("z", z)
    engine.run_until(["z"])
    assert engine.scheduler.reset_prefix_cache()
    for t in engine.kv_caches.values():
        t.zero_()
    engine.add("f", list(range(3000, 3142)), max_tokens=8)  # 9 blocks, no new one for a while
    opened, a_blocks = _abort_with_stores_held(engine)
    a_jobs = kvtier_side(engine).scheduler.job_ids_in_flight()
    timer = threading.Timer(1.0, opened.set)
    timer.start()
    engine.add("c", [*z, 5])
    so = engine.step(settle=False)
    timer.join()
    c_blocks = engine.scheduler.kv_cache_manager.get_block_ids("c")[0]
    assert set(c_blocks[:4]) & set(a_blocks), "expected c's load to reuse a's blocks"
    step = so.kv_connector_metadata.step
    assert step.loads and set(step.wait_for) & set(a_jobs)
    step_until_running(engine, "c")
    expect_loaded(engine, "c", z, 4 * BLOCK_SIZE)
    engine.run_until(["c", "f"])
    assert_no_leaks(engine)


def test_the_blocks_a_step_writes_are_fenced_and_those_it_only_reads_are_not() -> None:
    from types import SimpleNamespace

    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

    from kvtier.integrations.vllm.scheduler_side import _allocated_blocks

    out = SimpleNamespace(
        # 2 groups; 32 tokens computed before the step: the first 2 blocks of each are hits.
        scheduled_new_reqs=[SimpleNamespace(num_computed_tokens=32, block_ids=([1, 2, 3], [4, 5]))],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=["run", "back", "idle"],
            resumed_req_ids={"back"},
            num_computed_tokens=[100, 16, 7],
            # A running request's list is its new blocks only; a resumed one's its whole table.
            new_block_ids=[([6],), ([7, 8],), None],
        ),
        kv_cache_block_copies=[KVCacheBlockCopy(9, 10)],
        new_block_ids_to_zero=[11],
    )
    assert sorted(_allocated_blocks(out, 16)) == [3, 6, 8, 10, 11]  # type: ignore[arg-type]


def test_the_engine_keeps_stepping_until_a_released_requests_stores_are_collected(
    vllm_loaded: None,
) -> None:
    """No request is left, but the stores of the last one are still in flight: vLLM must keep
    stepping (`has_pending_push_work`) to collect them, or they stay pending writes, never
    announced, until the next request arrives."""
    engine = make_engine("KVTierConnector", RELEASE)
    opened = gate(engine)
    engine.add("a", PROMPT, max_tokens=1)
    engine.step(settle=False)  # prefilled, its one token sampled: finished, stores in flight
    assert "a" in engine.finished and "a" not in engine.scheduler.requests
    engine.step(settle=False)  # the finish reaches the workers; the stores are still held
    assert kvtier_side(engine).scheduler.num_jobs_in_flight() > 0
    assert engine.scheduler.has_requests()  # only the stores keep it stepping
    opened.set()
    for _ in range(10):
        if not engine.scheduler.has_requests():
            break
        engine.step()
    assert not engine.scheduler.has_requests()
    stats = kvtier_side(engine).manager.get_stats()
    assert stats.ready == 4 and stats.pending_writes == 0
    assert_no_leaks(engine)
