"""kvtier's transfer and tier counters in vLLM's connector metrics: the periodic "KV Transfer
metrics" log line and Prometheus counters (`vllm:kvtier_*_total`).

vLLM polls the scheduler-side connector every step (`get_kv_connector_stats`), merges the
result with the workers' (kvtier's workers report nothing of their own: their byte counts and
copy times reach the scheduler side with their job reports), and ships `to_dict()` to the
front end, which rebuilds the object with `build_kv_connector_stats` to log and export it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter
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
    "failed_load_jobs": "Load jobs that failed; vLLM recomputes their tokens",
    "failed_store_jobs": "Store jobs that failed; their chunks are never served",
    "lookup_hits": "Chunk lookups that found the chunk in the host tier",
    "lookup_misses": "Chunk lookups that did not",
    "stored_chunks": "Chunks written to the host tier",
    "skipped_chunks": "Chunks offered for storing that admission or a full tier turned away",
    "evicted_chunks": "Chunks evicted from the host tier",
}


@dataclass
class KVTierConnectorStats(KVConnectorStats):
    """Counters of `COUNTERS` since the last interval, as a flat `{name: number}` dict."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, KVTierConnectorStats):
            raise TypeError(f"cannot aggregate {type(other).__name__} into KVTierConnectorStats")
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counters, with copy bandwidths (GiB/s per worker) where there were copies."""
        out: dict[str, int | float] = {
            k: round(v, 6) if isinstance(v, float) else v for k, v in self.data.items() if v
        }
        for kind, moved in (("load", "loaded_bytes"), ("store", "stored_bytes")):
            seconds = self.data.get(f"{kind}_seconds", 0.0)
            nbytes = self.data.get(moved, 0)
            if seconds > 0 and nbytes:
                out[f"{kind}_GiB_per_s"] = round(nbytes / seconds / 2**30, 2)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Cumulative counters of the scheduler side, to difference per interval."""

    values: dict[str, int | float]

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
                "lookup_hits": manager.hits,
                "lookup_misses": manager.misses,
                "stored_chunks": manager.stores,
                "skipped_chunks": manager.stores_skipped + manager.stores_no_room,
                "evicted_chunks": manager.evictions,
            }
        )

    def since(self, earlier: Snapshot) -> KVTierConnectorStats | None:
        """The counters' growth since `earlier`, or None if nothing moved."""
        data = {k: v - earlier.values[k] for k, v in self.values.items()}
        if not any(data.values()):
            return None
        return KVTierConnectorStats(data=data)


class KVTierPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per entry of `COUNTERS`, with vLLM's engine labels."""

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

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            counter = self._counters.get((engine_idx, name))
            if counter is not None and value > 0:
                counter.inc(value)
