"""`release_finished_blocks` inside vLLM's `MultiConnector`: a load by another connector into
blocks a released request's kvtier store still reads must wait for that store.

`MultiConnector` gives the connector it chose for a request's load the real
`update_state_after_alloc` call, and every other connector the request's blocks with
`num_external_tokens=0`. The request waits for that load, so it is in no step's output until
the load is done: kvtier fenced only blocks of loads it planned itself, and the other
connector's load overwrote the blocks while kvtier's store copied them, so the released
request's keys got the loaded request's KV. Two kvtier connectors stand in for the pair (each
has its own transfer thread, as two connectors have their own streams on a GPU)."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import BLOCK_SIZE, Engine, make_engine
from test_vllm import (
    EXTRA,
    MODULE,
    PROMPT,
    _swap_transfer,
    expect_loaded,
    step_until_running,
    vllm_loaded,
)

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm

Z = list(range(2000, 2069))  # 4 full blocks, stored by both connectors first


def _kvtier(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def _settled_step(engine: Any) -> Any:
    """A step once both connectors' transfers submitted so far are done (`Engine.step` waits
    for the first connector's only), so each job is reported the next step."""
    for w in engine.worker._connectors:
        w.worker_side.transfer.wait(list(w.worker_side._jobs))
    return engine.step()


def test_another_connectors_load_waits_for_a_released_store(vllm_loaded: None) -> None:
    from vllm.v1.request import RequestStatus

    connectors = {"connectors": [_kvtier(EXTRA), _kvtier(EXTRA)]}
    engine = make_engine("MultiConnector", connectors, module_path=None, num_gpu_blocks=16)
    first, second = engine.scheduler.connector._connectors
    w_second = engine.worker._connectors[1]
    engine.add("z", Z)
    engine.run_until(["z"])
    _settled_step(engine)  # the second connector's stores of z are reported too
    assert engine.scheduler.reset_prefix_cache()
    for t in engine.kv_caches.values():
        t.zero_()
    engine.add("f", list(range(3000, 3142)), max_tokens=8)  # 9 blocks: c must reuse a's
    opened = threading.Event()

    def hold(job_id: int, kind: str) -> None:
        opened.wait(60)

    _swap_transfer(cast(Engine, SimpleNamespace(worker=w_second)), hold)
    engine.add("a", PROMPT, max_tokens=8)
    so = engine.step(settle=False)
    a_stores = [
        j.job_id for j in so.kv_connector_metadata.metadata[1].step.stores if j.req_id == "a"
    ]
    a_blocks = engine.scheduler.kv_cache_manager.get_block_ids("a")[0]
    engine.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert a_stores and "a" not in engine.scheduler.requests  # released, its store held

    # c's prefix is z's: the first connector loads it, into blocks a's store still reads.
    timer = threading.Timer(1.0, opened.set)
    timer.start()
    engine.add("c", [*Z, 5])
    so = engine.step(settle=False)
    timer.join()
    first_meta, second_meta = so.kv_connector_metadata.metadata
    (load,) = first_meta.step.loads
    assert set(load.device_blocks.tolist()) & set(a_blocks), "expected c to reuse a's blocks"
    assert set(a_stores) <= set(second_meta.step.wait_for)
    step_until_running(engine, "c")
    expect_loaded(engine, "c", Z, 4 * BLOCK_SIZE)
    engine.run_until(["c", "f"])
    _settled_step(engine)

    # a's prefix from the second connector alone holds a's KV, not the KV loaded for c.
    first.reset_cache()
    assert engine.scheduler.reset_prefix_cache()
    for t in engine.kv_caches.values():
        t.zero_()
    d = engine.add("d", [*PROMPT, 5])
    for _ in range(10):
        _settled_step(engine)
        if d.status == RequestStatus.RUNNING:
            break
    assert second.scheduler_side.manager.get_stats().loads == 4
    expect_loaded(engine, "d", PROMPT, 4 * BLOCK_SIZE)
