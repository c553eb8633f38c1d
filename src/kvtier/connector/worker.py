"""Worker half of a connector: runs each step's jobs on a transfer worker."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvtier.base import TransferResult
from kvtier.connector.metadata import StepMetadata


class TransferBackend(Protocol):
    """What the worker half needs from a transfer worker (`kvtier.transfer.TransferWorker`)."""

    def submit_store(
        self,
        job_id: int,
        device_blocks: npt.NDArray[np.int64],
        slots: npt.NDArray[np.int64],
        group: int = 0,
    ) -> None: ...

    def submit_load(
        self,
        job_id: int,
        slots: npt.NDArray[np.int64],
        device_blocks: npt.NDArray[np.int64],
        group: int = 0,
        skip_blocks: int = 0,
    ) -> None: ...

    def get_finished(self) -> list[TransferResult]: ...

    def wait(self, job_ids: Iterable[int]) -> None: ...


class OffloadingWorker:
    """Feeds one step's `StepMetadata` to a transfer worker in the order that keeps KV valid.

    Call `start_step` before the forward pass (waits for jobs whose blocks are about to be
    reused, then starts loads), `wait_for_loads` where the engine needs the loaded KV, and
    `finish_step` after the forward pass (starts stores of the KV it just produced).
    """

    def __init__(self, transfer: TransferBackend) -> None:
        self.transfer = transfer

    def start_step(self, meta: StepMetadata) -> None:
        """Wait for `meta.wait_for`, then submit the step's loads."""
        if meta.wait_for:
            self.transfer.wait(meta.wait_for)
        for job in meta.loads:
            self.transfer.submit_load(
                job.job_id, job.slots, job.device_blocks, job.group, job.skip_blocks
            )

    def wait_for_loads(self, meta: StepMetadata) -> None:
        """Block until the step's loads are done (their results still come from get_finished)."""
        if meta.loads:
            self.transfer.wait([job.job_id for job in meta.loads])

    def finish_step(self, meta: StepMetadata) -> None:
        """Submit the step's stores; call after the forward pass that produced their KV."""
        for job in meta.stores:
            self.transfer.submit_store(job.job_id, job.device_blocks, job.slots, job.group)

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call, for the scheduler half's `on_worker_results`."""
        return self.transfer.get_finished()
