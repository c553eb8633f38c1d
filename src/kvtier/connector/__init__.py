"""Engine-agnostic connector halves: the scheduler plans jobs, the worker runs them."""

from kvtier.connector.metadata import FinishedRequests, JobKind, StepMetadata, TransferJob
from kvtier.connector.scheduler import OffloadingScheduler, StepProgress
from kvtier.connector.worker import OffloadingWorker, TransferBackend

__all__ = [
    "FinishedRequests",
    "JobKind",
    "OffloadingScheduler",
    "OffloadingWorker",
    "StepMetadata",
    "StepProgress",
    "TransferBackend",
    "TransferJob",
]
