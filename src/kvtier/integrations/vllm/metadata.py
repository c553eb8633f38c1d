"""What kvtier's vLLM connector sends between its halves each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier.connector.metadata import StepMetadata


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers: the step's jobs, the finished requests whose blocks vLLM holds
    until the workers report their stores done (`finished_sending`), the host tier's slot
    count as the scheduler sized it (0: not given), which every worker's pool must hold, and
    the loads that ended on the scheduler side before any job ran (failed at allocation, or
    dropped unsent as their request finished; request id -> device blocks they left without
    valid KV), which every worker reports as failed loads: vLLM hears of a load's end only
    from its workers."""

    step: StepMetadata
    held: list[str] = field(default_factory=list)
    num_slots: int = 0
    failed_loads: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker(s) -> scheduler: finished jobs as `(job_id, success, worker rank, bytes,
    seconds)`, one entry per worker; the rank lets the scheduler refuse a worker that reports
    a job twice, and the bytes and copy time feed the connector stats."""

    results: list[tuple[int, bool, int, int, float]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Concatenate two workers' reports; the scheduler counts one report per worker."""
        if not isinstance(other, KVTierWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into KVTierWorkerMetadata")
        return KVTierWorkerMetadata(self.results + other.results)
