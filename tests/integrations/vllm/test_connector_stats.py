"""kvtier's counters in vLLM's connector metrics: the scheduler side's stats, shipped through
`SchedulerStats` as vLLM's engine core does, rebuilt and logged by vLLM's own
`KVConnectorLogging` and exported by its `KVConnectorProm`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import BLOCK_SIZE, make_engine
from test_vllm import (
    EXTRA,
    PROMPT,
    _swap_transfer,
    fail_loads,
    kvtier_side,
    store_a_then_forget_on_device,
    vllm_loaded,
)

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm


def through_vllm_loggers(config: Any, payloads: list[Any]) -> tuple[CollectorRegistry, list[str]]:
    """Feed stats payloads to vLLM's own Prometheus exporter (a private registry) and log
    line; the registry and the lines logged."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorLogging,
        KVConnectorProm,
    )

    registry = CollectorRegistry()

    class Prom(KVConnectorProm):
        _gauge_cls = staticmethod(lambda **kw: Gauge(registry=registry, **kw))  # type: ignore[assignment]
        _counter_cls = staticmethod(lambda **kw: Counter(registry=registry, **kw))  # type: ignore[assignment]
        _histogram_cls = staticmethod(lambda **kw: Histogram(registry=registry, **kw))  # type: ignore[assignment]

    prom = Prom(config, ["model_name", "engine"], {0: ["tiny", "0"]})
    logging = KVConnectorLogging(config.kv_transfer_config)
    for data in payloads:
        prom.observe(data)
        logging.observe(data)
    lines: list[str] = []
    logging.log(lambda fmt, *args: lines.append(fmt % args))  # type: ignore[no-untyped-call]
    return registry, lines


def test_counters_reach_vllms_log_line_and_prometheus(vllm_loaded: None) -> None:
    engine = make_engine("KVTierConnector", EXTRA)
    side = kvtier_side(engine)
    store_a_then_forget_on_device(engine)
    engine.add("b", [*PROMPT, 5])
    engine.run_until(["b"])
    payloads = [s.kv_connector_stats for s in engine.stats if s.kv_connector_stats]
    assert len(payloads) >= 2  # one interval per step that moved a counter

    registry, lines = through_vllm_loggers(engine.scheduler.vllm_config, payloads)

    # Everything the tier did over the run, from its own counters.
    block_bytes = sum(t[0].numel() * t.element_size() for t in engine.kv_caches.values())
    expected: dict[str, Any] = {
        "loaded_tokens": 4 * BLOCK_SIZE,
        "loaded_bytes": 4 * block_bytes,
        "stored_bytes": 4 * block_bytes,
        "stored_chunks": 4,
        "lookup_hits": 4,  # b's chunks
        "lookup_misses": 1,  # a's first chunk
    }
    assert side.scheduler.bytes_loaded == expected["loaded_bytes"]

    def sample(name: str) -> float | None:
        labels = {"model_name": "tiny", "engine": "0"}
        return registry.get_sample_value(f"vllm:kvtier_{name}_total", labels)

    for name, value in expected.items():
        assert sample(name) == value, name
    assert sample("failed_load_jobs") == 0 and sample("evicted_chunks") == 0
    assert (sample("load_seconds") or 0) > 0 and (sample("store_seconds") or 0) > 0

    (line,) = lines
    assert line.startswith("KV Transfer metrics: ")
    logged = dict(kv.split("=") for kv in line.removeprefix("KV Transfer metrics: ").split(", "))
    for name in ("loaded_tokens", "loaded_bytes", "stored_bytes", "stored_chunks"):
        assert int(logged[name]) == expected[name], name
    assert float(logged["load_GiB_per_s"]) > 0 and "failed_load_jobs" not in logged


def total(engine: Any) -> dict[str, float]:
    from kvtier.integrations.vllm import KVTierConnector

    stats = KVTierConnector.build_kv_connector_stats()
    for s in engine.stats:
        if s.kv_connector_stats:
            stats.aggregate(KVTierConnector.build_kv_connector_stats(s.kv_connector_stats))
    return dict(stats.data)


def test_a_failed_load_is_counted_and_moves_no_bytes(vllm_loaded: None) -> None:
    engine = make_engine("KVTierConnector", EXTRA, load_failure_policy="recompute")
    store_a_then_forget_on_device(engine)
    before = total(engine)

    _swap_transfer(engine, fail_loads)
    engine.add("b", [*PROMPT, 8])
    engine.run_until(["b"])
    after = total(engine)
    assert after["failed_load_jobs"] - before.get("failed_load_jobs", 0) == 1
    assert after.get("loaded_bytes", 0) == before.get("loaded_bytes", 0) == 0
    assert after["loaded_tokens"] == 4 * BLOCK_SIZE  # offered and planned, then recomputed


def test_stats_sum_over_intervals_and_log_only_what_moved(vllm_loaded: None) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

    from kvtier.integrations.vllm.stats import KVTierConnectorStats

    stats = KVTierConnectorStats(data={"failed_load_jobs": 1, "loaded_bytes": 0})
    assert not stats.is_empty() and stats.reduce() == {"failed_load_jobs": 1}
    stats.aggregate(KVTierConnectorStats(data={"failed_load_jobs": 2, "stored_bytes": 2**30}))
    stats.aggregate(KVTierConnectorStats(data={"store_seconds": 0.5}))
    assert stats.data == {
        "failed_load_jobs": 3,
        "loaded_bytes": 0,
        "stored_bytes": 2**30,
        "store_seconds": 0.5,
    }
    assert stats.reduce()["store_GiB_per_s"] == 2.0
    assert KVTierConnectorStats(data={"loaded_bytes": 0}).is_empty()
    with pytest.raises(TypeError, match="cannot aggregate KVConnectorStats"):
        stats.aggregate(KVConnectorStats())


@pytest.mark.parametrize(("groups", "slots"), [(1, 2), (2, 3)])
def test_chunks_turned_away_for_want_of_room_are_skipped_chunks(
    vllm_loaded: None, groups: int, slots: int
) -> None:
    """A 69-token prompt offers four chunks a group; the tier holds fewer. Such chunks counted
    nowhere; with two groups the rollback of the first group's reservation counted as failed
    stores, which vLLM never sees."""
    engine = make_engine("KVTierConnector", {"num_slots": slots}, num_groups=groups)
    engine.add("a", PROMPT)
    engine.run_until(["a"])
    stats = total(engine)
    assert stats.get("stored_chunks", 0) == 0
    assert stats["skipped_chunks"] == 4 * groups
    manager = kvtier_side(engine).manager.get_stats()
    assert (manager.stores_no_room, manager.failed_stores) == (4 * groups, 0)
