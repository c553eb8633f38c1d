"""What an operator reads from kvtier's connector metrics, checked against what the engine did.

Each test runs kvtier under vLLM's real `Scheduler`, feeds the stats payloads it produced to
vLLM's own `KVConnectorProm` and `KVConnectorLogging` (test_connector_stats.py's helper), and
checks the exported metric and its help text against the behaviour behind it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import Engine, make_engine
from test_connector_stats import through_vllm_loggers
from test_events import events_config, host_events
from test_vllm import (
    EXTRA,
    PROMPT,
    _swap_transfer,
    fail_loads,
    gate,
    kvtier_side,
    store_a_then_forget_on_device,
    stores_held,
    vllm_loaded,
)

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm

LABELS = {"model_name": "tiny", "engine": "0"}


def exported(engine: Engine) -> tuple[CollectorRegistry, list[str]]:
    """Every stats payload of `engine` so far through vLLM's Prometheus exporter and log line."""
    payloads = [s.kv_connector_stats for s in engine.stats if s.kv_connector_stats]
    return through_vllm_loggers(engine.scheduler.vllm_config, payloads)


def sample(registry: CollectorRegistry, name: str) -> float | None:
    return registry.get_sample_value(name, LABELS)


def help_of(registry: CollectorRegistry, name: str) -> str:
    (text,) = [m.documentation for m in registry.collect() if m.name == f"vllm:kvtier_{name}"]
    return text


def test_failed_load_help_says_what_vllms_default_policy_does(vllm_loaded: None) -> None:
    """Under vLLM's default `kv_load_failure_policy` ("fail") a failed load fails its request;
    the help of `failed_load_jobs` said vLLM recomputes the tokens, so an operator took a
    growing counter for lost speed when requests were erroring."""
    from vllm.config import KVTransferConfig

    default = KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both")
    assert default.kv_load_failure_policy == "fail"
    engine = make_engine("KVTierConnector", EXTRA, load_failure_policy="fail")
    store_a_then_forget_on_device(engine)

    _swap_transfer(engine, fail_loads)
    b = engine.add("b", [*PROMPT, 8])
    engine.run_until(["b"])
    assert b.status.name == "FINISHED_ERROR"  # failed, not recomputed

    registry, _ = exported(engine)
    assert sample(registry, "vllm:kvtier_failed_load_jobs_total") == 1
    text = help_of(registry, "failed_load_jobs")
    assert "fails the request under kv_load_failure_policy=fail (its default)" in text, text
    assert "recomputes the tokens under recompute" in text, text


def test_a_waiting_request_counts_its_lookups_once(vllm_loaded: None) -> None:
    """A request waiting for device blocks is looked up again every step: its four chunks,
    loaded once, used to count dozens of hits. They count once, when vLLM schedules it."""
    engine = make_engine("KVTierConnector", {"num_slots": 16}, num_gpu_blocks=12)
    store_a_then_forget_on_device(engine)
    engine.add("hog", list(range(500, 600)), max_tokens=30)  # holds most device blocks
    engine.step()
    engine.step()
    engine.add("b", [*PROMPT, 5])
    for _ in range(5):
        engine.step()
    assert engine.scheduler.requests["b"].status.name == "WAITING"  # asked, not scheduled
    side = kvtier_side(engine)
    assert side.manager.get_stats().hits >= 5 * 4  # the tier saw every step's lookups
    engine.run_until(["b", "hog"])

    registry, _ = exported(engine)
    loaded_chunks = (sample(registry, "vllm:kvtier_loaded_tokens_total") or 0) // 16
    assert loaded_chunks == 4
    assert sample(registry, "vllm:kvtier_lookup_hits_total") == loaded_chunks
    # "a" and "hog" found nothing; "b"'s lookups ended at its prompt, not at a miss.
    assert sample(registry, "vllm:kvtier_lookup_misses_total") == 2
    assert "once per scheduling" in help_of(registry, "lookup_hits")


def test_a_reset_is_announced_but_not_counted_as_evictions(vllm_loaded: None) -> None:
    """A cache reset announces the removal of every chunk in KV events but moves no
    `evicted_chunks`: stored minus evicted no longer tells what the tier holds, and the help
    said nothing of it."""
    engine = make_engine("KVTierConnector", {"num_slots": 4}, kv_events_config=events_config())
    try:
        engine.add("a", PROMPT)
        engine.run_until(["a"])
        assert engine.scheduler.reset_prefix_cache(reset_connector=True)
        engine.step()
        removed = [
            h for kind, hashes, _ in host_events(engine) if kind == "BlockRemoved" for h in hashes
        ]
        assert len(removed) == 4
        registry, _ = exported(engine)
        assert sample(registry, "vllm:kvtier_stored_chunks_total") == 4
        assert sample(registry, "vllm:kvtier_evicted_chunks_total") == 0
        text = help_of(registry, "evicted_chunks")
        assert "a cache reset's removals are not counted" in text, text
    finally:
        engine.scheduler.shutdown()


def test_the_host_tiers_slots_are_exported_as_gauges(vllm_loaded: None) -> None:
    """vLLM's OffloadingConnector exports how full its CPU cache is; kvtier exported counters
    only, and no sum of them tells what the tier holds (a reset removes chunks and moves
    none). The gauges follow the manager: stores in flight, stored chunks, then a reset."""
    engine = make_engine("KVTierConnector", {"num_slots": 8})
    opened = stores_held(engine)
    registry, _ = exported(engine)
    assert sample(registry, "vllm:kvtier_writing_slots") == 4
    assert sample(registry, "vllm:kvtier_used_slots") == 4
    assert sample(registry, "vllm:kvtier_num_slots") == 8
    opened.set()
    engine.run_until(["a"])
    registry, lines = exported(engine)
    assert sample(registry, "vllm:kvtier_writing_slots") == 0
    assert sample(registry, "vllm:kvtier_pinned_slots") == 0
    assert sample(registry, "vllm:kvtier_used_slots") == 4
    assert sample(registry, "vllm:kvtier_stored_chunks_total") == 4
    (line,) = lines
    assert "used_slots=4" in line and "writing_slots=0" in line, line
    kinds = {m.name: m.type for m in registry.collect()}
    assert kinds["vllm:kvtier_used_slots"] == "gauge"  # goes down: not a counter

    # A reset moves no counter, but the tier is empty now: the next step says so.
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    engine.step()
    registry, _ = exported(engine)
    assert sample(registry, "vllm:kvtier_used_slots") == 0
    assert sample(registry, "vllm:kvtier_evicted_chunks_total") == 0
    assert engine.scheduler.connector.scheduler_side.manager.get_stats().used_slots == 0


def test_loads_in_flight_show_as_pinned_slots(vllm_loaded: None) -> None:
    """Slots that loads in flight read (vLLM's read usage) are `pinned_slots` until done."""
    engine = make_engine("KVTierConnector", {"num_slots": 8})
    store_a_then_forget_on_device(engine)
    opened = gate(engine)
    engine.add("b", [*PROMPT, 5])
    so = engine.step(settle=False)
    assert so.kv_connector_metadata.step.loads
    registry, _ = exported(engine)
    assert sample(registry, "vllm:kvtier_pinned_slots") == 4
    opened.set()
    engine.run_until(["b"])
    registry, _ = exported(engine)
    assert sample(registry, "vllm:kvtier_pinned_slots") == 0
    assert sample(registry, "vllm:kvtier_used_slots") == 4


def test_gauges_keep_the_latest_reading_through_vllms_aggregation(vllm_loaded: None) -> None:
    """vLLM sums a log interval's stats with `aggregate`; a gauge summed over steps would
    report a tier several times its size. Counters still sum, and a reading of an empty tier
    is not an empty payload (vLLM drops those)."""
    import pickle

    from kvtier.integrations.vllm import KVTierConnector
    from kvtier.integrations.vllm.stats import KVTierConnectorStats

    build = KVTierConnector.build_kv_connector_stats
    stats = build({"stored_chunks": 4, "used_slots": 4, "num_slots": 8})
    stats.aggregate(
        build({"stored_chunks": 1, "evicted_chunks": 1, "used_slots": 4, "num_slots": 8})
    )
    stats.aggregate(build({"used_slots": 0, "num_slots": 8}))
    assert stats.data == {"stored_chunks": 5, "evicted_chunks": 1, "used_slots": 0, "num_slots": 8}
    assert stats.reduce() == stats.data  # a gauge of 0 is a reading, not a counter at rest
    empty_tier = KVTierConnectorStats(data={"used_slots": 0})
    assert not empty_tier.is_empty()
    assert KVTierConnectorStats(data={"stored_chunks": 0}).is_empty()
    # As a process boundary would carry it.
    assert pickle.loads(pickle.dumps(stats)) == stats
