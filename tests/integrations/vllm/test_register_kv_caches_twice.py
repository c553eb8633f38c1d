"""A second `register_kv_caches` on a worker-side KVTierConnector is refused, and the first
registration keeps running: its jobs in flight finish and are reported, its host pool keeps
the chunks the scheduler counts as stored."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install 'kvtier[vllm]')", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import make_engine, make_kv_caches
from test_vllm import EXTRA, PROMPT, gate, vllm_loaded
from test_vllm import _b_loads_what_a_stored as b_loads_what_a_stored

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm


def test_a_second_registration_is_refused_and_the_first_keeps_its_jobs(
    vllm_loaded: None,
) -> None:
    engine = make_engine("KVTierConnector", EXTRA)
    opened = gate(engine)  # every transfer waits until the gate opens
    engine.add("a", PROMPT)
    for _ in range(3):
        engine.step(settle=False)
    ws = engine.kvtier_worker()
    transfer, jobs = ws.transfer, dict(ws._jobs)
    assert jobs, "expected a's stores in flight"

    fresh = make_kv_caches(engine.scheduler.kv_cache_config)
    with pytest.raises(RuntimeError, match=r"register_kv_caches\(\) called a second time") as e:
        engine.worker.register_kv_caches(fresh)
    assert f"{len(jobs)} jobs in flight" in str(e.value)
    assert ws.transfer is transfer and ws._jobs == jobs

    opened.set()
    engine.run_until(["a"])
    side = engine.scheduler.connector.scheduler_side
    assert side.manager.get_stats().stores == 4
    assert side.scheduler.store_jobs_failed == 0
    # The chunks stored through the first registration load back byte for byte into its
    # tensors (the refused ones were never written).
    assert engine.scheduler.reset_prefix_cache()
    for t in engine.kv_caches.values():
        t.zero_()  # only a load from kvtier can bring the bytes back
    engine.add("b", [*PROMPT, 3])
    b_loads_what_a_stored(engine)  # and nothing leaks
    assert all(not t.any() for t in fresh.values())
