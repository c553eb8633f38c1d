"""kvtier's transfer and tier counters in vLLM's connector metrics: the periodic "KV Transfer
metrics" log line, Prometheus counters (`vllm:kvtier_*_total`) and gauges of the host tier's
slots (`vllm:kvtier_*_slots`).

vLLM polls the scheduler-side connector every step (`get_kv_connector_stats`), merges the
result with the workers' (kvtier's workers report nothing of their own: their byte counts and
copy times reach the scheduler side with their job reports), and ships `to_dict()` to the
front end, which rebuilds the object with `build_kv_connector_stats` to log and export it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from prometheus_client import Counter, Gauge
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

from kvtier.base import ManagerStats

# Counter name -> Prometheus help text. Every value is a count (or seconds) since the last
# interval; the front end sums intervals and workers.
COUNTERS: dict[str, str] = {
    "loaded_tokens": (
        "Prompt tokens kvtier offered from its host tier and vLLM planned to load instead of "
        "computing, including loads that then failed"
    ),
    "loaded_bytes": "Bytes copied host to device by successful load jobs, summed over workers",
    "stored_bytes": "Bytes copied device to host by successful store jobs, summed over workers",
    "load_seconds": "Copy time of successful load jobs, summed over workers",
    "store_seconds": "Copy time of successful store jobs, summed over workers",
    "failed_load_jobs": (
        "Load jobs that failed on any worker, and loads whose chunks were gone when vLLM "
        "allocated their blocks (one per KV-cache group); vLLM then fails the request under "
        "kv_load_failure_policy=fail (its default) or recomputes the tokens under recompute"
    ),
    "failed_store_jobs": "Store jobs that failed; their chunks are never served",
    "lookup_hits": (
        "Chunks (times KV-cache groups) found in the host tier when vLLM scheduled a request, "
        "once per scheduling however many steps it waited, including found chunks not loaded "
        "(a drafter's proof chunks); loaded_tokens counts the tokens vLLM planned to load"
    ),
    "lookup_misses": (
        "Scheduled requests whose host-tier lookup ended at a missing chunk (at most one per "
        "scheduling: a request's lookups stop at its first miss)"
    ),
    "stored_chunks": "Chunks written to the host tier",
    "skipped_chunks": (
        "Chunks offered for storing that admission or a full tier turned away (a full tier's "
        "at each try: such chunks are offered again)"
    ),
    "evicted_chunks": (
        "Chunks evicted from the host tier to make room; a cache reset's removals are not counted"
    ),
}

# Gauge name -> Prometheus help text. Each value is the latest reading, not a sum: the counters
# cannot tell what the tier holds (a reset removes chunks without evicting them).
GAUGES: dict[str, str] = {
    "used_slots": (
        "Host slots in use: chunks stored, being written or being read, and slots a cache "
        "reset holds until the transfers still using them end"
    ),
    "pinned_slots": "Host slots whose chunks loads in flight are reading (not evictable)",
    "writing_slots": "Host slots that stores in flight are writing (not yet readable)",
    "num_slots": "Host slots of the tier: its capacity, one chunk of one KV-cache group each",
}


@dataclass
class KVTierConnectorStats(KVConnectorStats):
    """Counters of `COUNTERS` since the last interval and the latest readings of `GAUGES`, as
    a flat `{name: number}` dict. Aggregating sums the counters and keeps the later gauges."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, KVTierConnectorStats):
            raise TypeError(f"cannot aggregate {type(other).__name__} into KVTierConnectorStats")
        for name, value in other.data.items():
            self.data[name] = value if name in GAUGES else self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counters that moved and every gauge, with copy bandwidths (GiB/s per worker)
        where there were copies."""
        out: dict[str, int | float] = {
            k: round(v, 6) if isinstance(v, float) else v
            for k, v in self.data.items()
            if v or k in GAUGES
        }
        for kind, moved in (("load", "loaded_bytes"), ("store", "stored_bytes")):
            seconds = self.data.get(f"{kind}_seconds", 0.0)
            nbytes = self.data.get(moved, 0)
            if seconds > 0 and nbytes:
                out[f"{kind}_GiB_per_s"] = round(nbytes / seconds / 2**30, 2)
        return out

    def is_empty(self) -> bool:
        # A gauge reading of 0 is news (the tier emptied): vLLM drops empty stats.
        return not any(v or k in GAUGES for k, v in self.data.items())


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Cumulative counters of the scheduler side, to difference per interval, and its gauges."""

    values: dict[str, int | float]
    gauges: dict[str, int] = field(default_factory=dict)

    @classmethod
    def take(cls, sched: Any, manager: ManagerStats, loaded_tokens: int) -> Snapshot:
        return cls(
            {
                "loaded_tokens": loaded_tokens,
                "loaded_bytes": sched.bytes_loaded,
                "stored_bytes": sched.bytes_stored,
                "load_seconds": sched.load_seconds,
                "store_seconds": sched.store_seconds,
                "failed_load_jobs": sched.load_jobs_failed,
                "failed_store_jobs": sched.store_jobs_failed,
                "lookup_hits": sched.lookup_hits,
                "lookup_misses": sched.lookup_misses,
                "stored_chunks": manager.stores,
                "skipped_chunks": manager.stores_skipped + manager.stores_no_room,
                "evicted_chunks": manager.evictions,
            },
            {
                "used_slots": manager.used_slots,
                "pinned_slots": manager.pinned,
                "writing_slots": manager.pending_writes,
                "num_slots": manager.num_slots,
            },
        )

    def since(self, earlier: Snapshot) -> KVTierConnectorStats | None:
        """The counters' growth since `earlier` and the gauges now, or None if nothing moved."""
        data: dict[str, int | float] = {k: v - earlier.values[k] for k, v in self.values.items()}
        if not any(data.values()) and self.gauges == earlier.gauges:
            return None
        data.update(self.gauges)
        return KVTierConnectorStats(data=data)


class KVTierPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per entry of `COUNTERS` and one gauge per entry of `GAUGES`,
    with vLLM's engine labels."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter_cls = metric_types[Counter]
        self._counters: dict[tuple[int, str], Any] = {}
        for name, help_text in COUNTERS.items():
            counter = counter_cls(
                name=f"vllm:kvtier_{name}", documentation=help_text, labelnames=labelnames
            )
            for engine, labelvalues in per_engine_labelvalues.items():
                self._counters[engine, name] = counter.labels(*labelvalues)
        # Gauge, or a stand-in taking its keywords (vLLM's Ray wrapper); typed as Gauge.
        gauge_cls = cast("type[Gauge]", metric_types[Gauge])
        self._gauges: dict[tuple[int, str], Any] = {}
        for name, help_text in GAUGES.items():
            # As vLLM's own gauges: with several API servers, the latest write is the reading.
            gauge = gauge_cls(
                name=f"vllm:kvtier_{name}",
                documentation=help_text,
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
            for engine, labelvalues in per_engine_labelvalues.items():
                self._gauges[engine, name] = gauge.labels(*labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            gauge = self._gauges.get((engine_idx, name))
            if gauge is not None:
                gauge.set(value)
                continue
            counter = self._counters.get((engine_idx, name))
            if counter is not None and value > 0:
                counter.inc(value)
