"""`KVTierConnector`: kvtier as a vLLM 0.33 KV connector (`KVConnectorBase_V1`, `SupportsHMA`).

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": "64GiB"}}'

The scheduler role wraps kvtier's `OffloadingScheduler` (kvtier.integrations.vllm.scheduler_side),
the worker role kvtier's transfer engine (worker_side). docs/vllm.md is the user guide.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.integrations.vllm.metadata import KVTierConnectorMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.scheduler_side import KVTierSchedulerSide
from kvtier.integrations.vllm.setup import resolve_setup
from kvtier.integrations.vllm.stats import KVTierConnectorStats, KVTierPromMetrics
from kvtier.integrations.vllm.worker_side import KVTierWorkerSide

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """Offloads vLLM's KV cache to kvtier's host tier and loads it back on prefix hits.

    Configured by `kv_connector_extra_config`, parsed by `kvtier.config`: an unknown key or a
    bad value raises `kvtier.config.ConfigError` here, when the engine starts.
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        setup = resolve_setup(vllm_config, kv_cache_config)
        self.scheduler_side: KVTierSchedulerSide | None = None
        self.worker_side: KVTierWorkerSide | None = None
        # A failed load was dropped from get_finished's answer: its blocks must be reported.
        self._failures_by_block = False
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = KVTierSchedulerSide(setup)
        else:
            layer_groups = {
                name: index
                for index, group in enumerate(kv_cache_config.kv_cache_groups)
                for name in group.layer_names
            }
            # vLLM's rank may count across data-parallel engines laid out one after another;
            # the scheduler wants this worker's index within its own engine.
            rank = vllm_config.parallel_config.rank % setup.num_workers
            self.worker_side = KVTierWorkerSide(setup, layer_groups, rank)

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a store lost to preemption is only a future miss."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Layer-major pages, so a layer's device block is one contiguous run of bytes."""
        return "LBHNC"

    # -- worker role -------------------------------------------------------------------------

    def _worker(self) -> KVTierWorkerSide:
        if self.worker_side is None:
            raise RuntimeError("worker-side call on the scheduler-side KVTierConnector")
        return self.worker_side

    def _meta(self) -> KVTierConnectorMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVTierConnectorMetadata):
            raise TypeError(f"expected KVTierConnectorMetadata, got {type(meta).__name__}")
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register vLLM's per-layer KV tensors with kvtier's transfer engine."""
        self._worker().register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Wait for stores reading blocks that preemption hands to other requests."""
        if not isinstance(kv_connector_metadata, KVTierConnectorMetadata):
            raise TypeError(
                f"expected KVTierConnectorMetadata, got {type(kv_connector_metadata).__name__}"
            )
        self._worker().handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Submit this step's loads (asynchronous; reported through get_finished)."""
        self._worker().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request and asynchronous: nothing to wait for per layer."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Stores are submitted once per step in wait_for_save."""

    def wait_for_save(self) -> None:
        """Submit this step's stores; they run after the forward pass that wrote the KV."""
        self._worker().wait_for_save(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished loads (failed ones too) and held requests whose stores are done."""
        return self._worker().get_transfer_results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """`(finished_sending, finished_recving)`, for callers that know no `failed_recving`
        (vLLM 0.33 itself calls get_transfer_results).

        A failed load is in `finished_recving` (vLLM must stop waiting for it) and its blocks
        in the next `get_block_ids_with_load_errors`, the one report of the failure such a
        caller reads: for hybrid models too, which vLLM 0.33's scheduler refuses loudly rather
        than compute on blocks that were never loaded."""
        results = self.get_transfer_results(finished_req_ids)
        if results.failed_recving:
            self._failures_by_block = True
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks that failed loads left invalid: for single-group models, and for hybrid
        models when `get_finished` dropped the failed requests; otherwise hybrid models get
        only the request in `failed_recving`, since vLLM cannot map block ids across groups."""
        errors = self._worker().take_load_errors()
        if len(self._kv_cache_config.kv_cache_groups) == 1:
            return errors
        if self._failures_by_block:
            self._failures_by_block = False
            logger.warning(
                "kvtier: failed loads reported through get_finished, which has no "
                "failed_recving: reporting their %d blocks of a hybrid model as load errors",
                len(errors),
            )
            return errors
        return set()

    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        """This worker's finished jobs, for the scheduler side."""
        return self.worker_side.build_worker_meta() if self.worker_side is not None else None

    def shutdown(self) -> None:
        """Stop the transfer worker and unpin its host pool."""
        if self.worker_side is not None:
            self.worker_side.shutdown()

    # -- scheduler role ----------------------------------------------------------------------

    def _scheduler(self) -> KVTierSchedulerSide:
        if self.scheduler_side is None:
            raise RuntimeError("scheduler-side call on the worker-side KVTierConnector")
        return self.scheduler_side

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Read block tables from vLLM's cache manager when a store is due."""
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler().bind_block_ids(kv_cache_manager.get_block_ids)

    def on_new_request(self, request: Request) -> None:
        """Start tracking a request."""
        self._scheduler().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond `num_computed_tokens` kvtier can load; `None` means ask again."""
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan the load of the matched tokens into the blocks vLLM allocated."""
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Plan this step's stores and hand the workers every job due."""
        side = self._scheduler()
        meta = side.build_connector_meta(scheduler_output)
        # The scheduler sizes the tier from the first worker's KV pages (vLLM gives it that
        # worker's config); a pipeline stage with more layers sizes its own pool smaller, and
        # grows it to this count before its first job (worker_side.fit_pool).
        meta.num_slots = side.setup.num_slots
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Record the workers' finished jobs."""
        self._scheduler().update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """True: vLLM keeps the blocks until the workers report the request finished."""
        return self._scheduler().request_finished(request), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """As request_finished, for every KV-cache group at once (hybrid models)."""
        return self._scheduler().request_finished(request), None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """BlockStored / BlockRemoved events (medium "CPU") of the host tier since the last
        step; vLLM publishes them when its KV events are enabled."""
        if self.scheduler_side is None:
            return ()
        return self.scheduler_side.take_events()

    def has_pending_push_work(self) -> bool:
        """Jobs in flight: vLLM keeps stepping to collect them though no request is left
        (a released request's stores, with `release_finished_blocks`), or their chunks would
        stay pending writes, unannounced, until the next request arrives."""
        side = self.scheduler_side
        return side is not None and side.scheduler.num_jobs_in_flight() > 0

    def has_pending_block_frees(self) -> bool:
        """Stores in flight will hand blocks back, so vLLM may wait instead of preempting."""
        return self.scheduler_side is not None and self.scheduler_side.has_held()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Scheduler side: kvtier's counters since the last call (bytes and copy time of
        finished jobs, tokens loaded, failures, lookups, stores, evictions); the workers
        report theirs through their job reports, so they return None."""
        if self.scheduler_side is None:
            return None
        return self.scheduler_side.get_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        """Rebuild the stats from the dict vLLM ships to its loggers."""
        return KVTierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        """Prometheus counters `vllm:kvtier_<counter>_total` (`stats.COUNTERS`)."""
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def reset_cache(self) -> bool | None:
        """Empty kvtier's host tier (transfers in flight finish harmlessly)."""
        self._scheduler().reset_cache()
        return True


def _register() -> None:
    """Put KVTierConnector in vLLM's connector registry. A `MultiConnector` front end rebuilds
    each child's stats by class name (`get_connector_class_by_name`), which finds only
    registered connectors; it imports this module first, through the child's
    `kv_connector_module_path`, when it builds its Prometheus metrics."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    name = KVTierConnector.__name__
    with contextlib.suppress(ValueError):  # "already registered": imported before
        KVConnectorFactory.register_connector(name, __name__, name)


_register()
