"""The worker side's shutdown with a host pool that refuses to close under a live worker."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import make_engine
from test_pipeline_stages import PROMPT_A, make_pipeline, page_bytes_per_layer
from test_pipeline_stages import stage_kv_cache_config as stage
from test_vllm import EXTRA, stores_held, vllm_loaded

from helpers import interrupt_once

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm


def test_ctrl_c_in_the_transfer_shutdown_is_raised_and_the_pool_stays_open(
    vllm_loaded: None,
) -> None:
    # The pool was closed in a `finally`: with copies still running it now refuses, and that
    # RuntimeError replaced the Ctrl-C (before the refusal, it unpinned under the copies).
    engine = make_engine("KVTierConnector", EXTRA)
    opened = stores_held(engine)
    ws = engine.kvtier_worker()
    transfer = ws.transfer
    pool = transfer.pool
    transfer.shutdown = interrupt_once(transfer.shutdown, "before")
    try:
        with pytest.raises(KeyboardInterrupt):
            ws.shutdown()
        assert not pool.closed
    finally:
        opened.set()
    ws.shutdown()  # again, as after any interrupted shutdown: now it stops and closes
    assert pool.closed


def test_a_pool_that_grows_closes_the_old_one_first(vllm_loaded: None) -> None:
    # The old pool (pinned where CUDA is) was left to the collector while the new one was
    # allocated beside it.
    slots = 6
    extra = {"cpu_bytes_to_use": 2 * slots * 2 * page_bytes_per_layer()}
    engine = make_pipeline(extra, [stage(range(0, 2)), stage(range(2, 5))])
    old = engine.workers[1].worker_side.transfer.pool
    assert old.num_slots < slots
    engine.add("a", PROMPT_A)
    engine.step()
    assert engine.workers[1].worker_side.transfer.pool.num_slots == slots
    assert old.closed
    engine.run_until(["a"])
