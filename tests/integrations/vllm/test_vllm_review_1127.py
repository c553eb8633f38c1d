"""Review fixes for KVTierConnector in vLLM 0.33, each through the real vLLM Scheduler (and the
worker loop of engine.py where bytes move)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any, Literal

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import make_engine
from test_async_scheduling import PROMPT
from test_load_failed_at_alloc import deferring_engine
from test_vllm import EXTRA, vllm_loaded

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm


def test_a_prefix_match_unit_finer_than_the_block_is_named(vllm_loaded: None) -> None:
    """With two KV-cache groups vLLM hashes blocks of `prefix_match_unit` tokens when it is set;
    kvtier needs one hash per device block and refuses at start-up. The error named neither
    the setting nor what to set it to ("vLLM hashes blocks of 8 tokens but KV blocks hold 16")."""
    from kvtier.config import ConfigError

    def finer_hashes(cfg: Any) -> None:
        cfg.cache_config.prefix_match_unit = 8

    with pytest.raises(ConfigError) as info:
        make_engine(
            "KVTierConnector", EXTRA, num_groups=2, with_worker=False, configure=finer_hashes
        )
    assert "prefix_match_unit=8" in str(info.value)
    assert "expected it unset or 16" in str(info.value)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_an_abort_before_a_deferred_load_is_sent_frees_the_request(
    vllm_loaded: None, monkeypatch: pytest.MonkeyPatch, policy: Literal["recompute", "fail"]
) -> None:
    """vLLM plans a deferred load from `update_from_output` (`_drain_deferred_loads`); kvtier
    sends its job with the next step. An abort between the two (aborts come between engine
    steps) made kvtier drop the unsent job and report nothing, while vLLM, for which the load
    had started, kept the request and its blocks until a worker reported the load ended:
    forever, and the engine never went idle."""
    from vllm.v1.request import RequestStatus

    engine = deferring_engine(monkeypatch, policy)
    sched = engine.scheduler
    side = sched.connector.scheduler_side
    free_blocks = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    engine.add("a", PROMPT, max_tokens=2)
    engine.run_until_idle()
    assert sched.reset_prefix_cache()

    engine.add("x", list(range(500, 540)), max_tokens=4)
    engine.step()  # x's batch in flight, not yet processed
    engine.add("b", [*PROMPT, 8], max_tokens=4)
    so = sched.schedule()  # offers b 4 blocks; vLLM defers the load behind x's batch
    assert "b" in sched.deferred_loads
    engine.queue.append((so, engine._execute(so)))
    engine._process_oldest()  # vLLM plans b's load: kvtier's job waits for the next step
    assert "b" not in sched.deferred_loads and side.scheduler.num_jobs_in_flight() == 1
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert "b" in sched.requests  # vLLM holds b's blocks until a worker reports its load

    engine.run_until_idle()
    assert not sched.requests
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == free_blocks
    assert side.scheduler.num_jobs_in_flight() == 0 and side.scheduler.num_requests() == 0
    assert side.manager.get_stats().pinned == 0
    assert not (side._requests or side._loads or side._loading or side._unsent_loads)
    assert not engine.worker.worker_side._jobs
    engine.worker.shutdown()
