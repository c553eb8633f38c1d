"""What the scheduler half tells the worker half each step, and what comes back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvtier.base import OffloadKey


class JobKind(enum.Enum):
    """Direction of a transfer job."""

    LOAD = "load"
    STORE = "store"


@dataclass(slots=True)
class TransferJob:
    """One batch of chunk transfers of one request and one KV-cache group.

    For a load, `device_blocks` are filled from the concatenated chunks of `slots`, starting
    `skip_blocks` blocks into the first chunk. A store writes whole chunks.
    """

    job_id: int
    kind: JobKind
    req_id: str
    group: int
    slots: npt.NDArray[np.int64]
    device_blocks: npt.NDArray[np.int64]
    skip_blocks: int = 0

    def __eq__(self, other: object) -> bool:
        # The generated comparison took the truth value of `array == array`: comparing two
        # jobs of several blocks (a StepMetadata with its pickled copy) raised ValueError.
        if not isinstance(other, TransferJob):
            return NotImplemented
        return (
            (self.job_id, self.kind, self.req_id, self.group, self.skip_blocks)
            == (other.job_id, other.kind, other.req_id, other.group, other.skip_blocks)
            and bool(np.array_equal(self.slots, other.slots))
            and bool(np.array_equal(self.device_blocks, other.device_blocks))
        )


@dataclass(slots=True)
class StepMetadata:
    """The worker's instructions for one engine step.

    The worker first waits for `wait_for` (jobs whose device blocks the engine is about to
    reuse, e.g. a preempted request's stores), then starts `loads`, and submits `stores` only
    after the step's forward pass produced their KV.
    """

    loads: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)
    wait_for: list[int] = field(default_factory=list)


@dataclass(slots=True)
class FinishedRequests:
    """Requests whose transfers ended, as the engine needs to hear it.

    `sending`: finished requests whose device blocks may now be freed (their stores and loads
    are all done). `recving`: requests whose asynchronous load ended (successfully or not).
    `failed_loads`: requests whose load failed; the engine must recompute those tokens.
    `failed_load_blocks`: the device blocks that a failed load left without valid KV.
    """

    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    failed_loads: set[str] = field(default_factory=set)
    failed_load_blocks: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _Job:
    """Scheduler-side record of a job in flight."""

    spec: TransferJob
    keys: list[OffloadKey]
    generation: int
    reports_left: int
    # Set once the job is in a StepMetadata: before that no worker can have run it, and a
    # report of it (stale, or meant for another job) would release its pins and announce its
    # request received while the job is still to be sent and run.
    sent: bool = False
    success: bool = True
    bytes: int = 0  # moved by the workers that reported success so far
    seconds: float = 0.0  # their copy time, summed
    reporters: set[int] = field(default_factory=set)  # workers that named themselves
    # Set once the manager has the job's outcome and the counters count it. The job stays in
    # flight until its request's bookkeeping is done too, so that an interrupt part-way leaves
    # it to `fail_unreported`, which finishes it without applying anything twice.
    applied: bool = False
    attempted: bool = False  # the manager was asked to complete it (an interrupt may follow)
