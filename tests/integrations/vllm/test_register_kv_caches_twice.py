"""A second `register_kv_caches` on a worker-side KVTierConnector is refused, and the first
registration keeps running: its jobs in flight finish and are reported, its host pool keeps
the chunks the scheduler counts as stored. A first one that failed may be retried."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import make_engine, make_kv_caches
from test_vllm import EXTRA, PROMPT, stores_held, vllm_loaded
from test_vllm import _b_loads_what_a_stored as b_loads_what_a_stored

from kvtier.transfer.factory import transfer_worker_from_config

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm


def test_a_second_registration_is_refused_and_the_first_keeps_its_jobs(
    vllm_loaded: None,
) -> None:
    engine = make_engine("KVTierConnector", EXTRA)
    opened = stores_held(engine)
    ws = engine.kvtier_worker()
    transfer, jobs = ws.transfer, dict(ws._jobs)

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


def test_a_registration_whose_transfer_worker_failed_to_start_can_be_retried(
    vllm_loaded: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    engine = make_engine("KVTierConnector", EXTRA, with_worker=False)
    sched = engine.scheduler
    worker: Any = KVConnectorFactory.create_connector(
        config=sched.vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=sched.kv_cache_config
    )
    calls: list[int] = []

    def fails_once(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("cannot pin the host pool")
        return transfer_worker_from_config(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(
        "kvtier.integrations.vllm.worker_side.transfer_worker_from_config", fails_once
    )
    kv_caches = make_kv_caches(sched.kv_cache_config)
    with pytest.raises(RuntimeError, match="cannot pin the host pool"):
        worker.register_kv_caches(kv_caches)
    # Was refused as "called a second time", though nothing was registered.
    worker.register_kv_caches(kv_caches)
    assert len(calls) == 2 and worker.worker_side is not None
    assert worker.worker_side.transfer is not None
    worker.shutdown()
