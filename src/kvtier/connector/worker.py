"""Worker half of a connector: runs each step's jobs on a transfer worker."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvtier.base import TransferResult
from kvtier.connector.metadata import JobKind, StepMetadata, TransferJob

logger = logging.getLogger(__name__)

# StepMetadata remembered for a second feeding: the current step's, and a few before it for a
# caller that starts a step before it finishes the previous one.
_RECENT_STEPS = 4


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

    def holds(self, job_id: int) -> bool:
        """Whether the job is queued, running, or finished and not yet returned by
        `get_finished`; after a submit that raised, whether it was queued all the same."""
        ...


class OffloadingWorker:
    """Feeds one step's `StepMetadata` to a transfer worker in the order that keeps KV valid.

    Call `start_step` before the forward pass (waits for jobs whose blocks are about to be
    reused, then starts loads), `wait_for_loads` where the engine needs the loaded KV, and
    `finish_step` after the forward pass (starts stores of the KV it just produced).
    """

    def __init__(self, transfer: TransferBackend) -> None:
        # Refused here: any other object (None before the transfer worker is built, the
        # factory function itself) had every job of the step logged and reported failed, as a
        # submit that raised is, before get_finished raised AttributeError. `holds` may be
        # missing: a backend that cannot answer is taken to have queued nothing (`_holds`).
        missing = [
            name
            for name in ("submit_store", "submit_load", "get_finished", "wait")
            if not callable(getattr(transfer, name, None))
        ]
        if missing:
            raise TypeError(
                f"transfer={transfer!r:.80} is a {type(transfer).__name__} without "
                f"{', '.join(missing)}; expected a transfer worker (make_transfer_worker)"
            )
        self.transfer = transfer
        # Jobs the transfer worker refused to queue, reported failed by the next get_finished.
        self._refused: list[TransferResult] = []
        # Jobs handed to the transfer worker and not yet returned by get_finished. A job fed
        # again (the same step's metadata twice) is skipped: the transfer worker would refuse
        # the duplicate id, and that refusal, reported as a failure, would release the pins
        # and slots of the copy that is still running.
        self._submitted: set[int] = set()
        # Jobs whose submit raised, to be reported failed by the next get_finished unless the
        # transfer worker queued them all the same (it reports those). Decided there, not in
        # the exception handler, where a second interrupt could lose the report.
        self._unsettled: set[int] = set()
        # The last few StepMetadata fed, each with the ids of its jobs handed over. A job
        # returned by get_finished leaves `_submitted`, so without this the same metadata fed
        # again (an error path that repeats a step) would run it a second time: a store
        # copying blocks the engine has since reused into a slot that may hold another chunk
        # by now (served as that chunk), a load overwriting another request's blocks, and a
        # second report that makes the scheduler half refuse its whole batch. Kept per
        # metadata object, not per id: ids repeat across schedulers fed to one worker.
        self._recent: list[tuple[StepMetadata, set[int]]] = []
        # Results taken from the transfer worker (and refusals) by a get_finished that an
        # interrupt cut short: the next call returns them first.
        self._taken: list[TransferResult] = []

    def start_step(self, meta: StepMetadata) -> None:
        """Wait for `meta.wait_for`, then submit the step's loads. Should the wait raise, the
        loads are reported failed by the next `get_finished` (the engine recomputes them),
        and the error propagates."""
        if meta.wait_for:
            try:
                self.transfer.wait(meta.wait_for)
            except BaseException:
                # Not submitted now, the loads were never reported either: their pins, device
                # blocks and request were held for good. Settled as a refused submit is (the
                # transfer worker holds none of them), and skipped if the step is fed again.
                fed = self._fed(meta)
                for job in meta.loads:
                    if job.job_id not in fed and job.job_id not in self._submitted:
                        self._unsettled.add(job.job_id)
                        fed.add(job.job_id)
                        self._submitted.add(job.job_id)
                raise
        if meta.loads:
            fed = self._fed(meta)
            for job in meta.loads:
                self._submit(job, fed)

    def wait_for_loads(self, meta: StepMetadata) -> None:
        """Block until the step's loads are done (their results still come from get_finished)."""
        if meta.loads:
            self.transfer.wait([job.job_id for job in meta.loads])

    def finish_step(self, meta: StepMetadata) -> None:
        """Submit the step's stores; call after the forward pass that produced their KV."""
        if meta.stores:
            fed = self._fed(meta)
            for job in meta.stores:
                self._submit(job, fed)

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call, for the scheduler half's `on_worker_results`."""
        if self._unsettled:
            self._settle()  # before the transfer's results: `holds` is False once returned
        # Results taken from the transfer worker stay in `_taken` until this call returns
        # them: an interrupt (Ctrl-C) in the loop below lost the batch, its jobs no longer
        # held by the transfer worker, and `fail_unreported` later failed them, good copies
        # included. The steps that move results have no call between them.
        taken = self._taken
        taken += self._refused
        self._refused = []
        taken += self.transfer.get_finished()
        submitted = self._submitted
        for r in taken:
            submitted.discard(r.job_id)
        self._taken = []
        return taken

    def _fed(self, meta: StepMetadata) -> set[int]:
        """Ids of `meta`'s jobs already handed over (to be added to), by identity."""
        for m, ids in self._recent:
            if m is meta:
                return ids
        ids = set()
        self._recent.append((meta, ids))
        if len(self._recent) > _RECENT_STEPS:
            del self._recent[0]
        return ids

    def _submit(self, job: TransferJob, fed: set[int]) -> None:
        if job.job_id in self._submitted or job.job_id in fed:
            logger.warning(
                "kvtier: %s job %d of request %s was already submitted; not submitted again",
                _kind(job),
                job.job_id,
                job.req_id,
            )
            return
        # A job the transfer worker cannot queue (out of memory, shut down) is a failed
        # transfer: reported so, its pins and slots are released and a failed load is
        # recomputed. Raising instead would strand the step's later jobs, never submitted and
        # never reported, with their pins and pending writes held forever.
        try:
            # Inside: an interrupt may come as an add returns. `fed` first: a job in it and
            # not in `_submitted` is still reported once, by `_settle`.
            fed.add(job.job_id)
            self._submitted.add(job.job_id)
            if job.kind is JobKind.LOAD:
                self.transfer.submit_load(
                    job.job_id, job.slots, job.device_blocks, job.group, job.skip_blocks
                )
            elif job.kind is JobKind.STORE:
                self.transfer.submit_store(job.job_id, job.device_blocks, job.slots, job.group)
            else:
                # Anything else ran as a store: a load given as "load" overwrote its slots'
                # chunks with the device blocks it was to fill, and was reported done.
                raise ValueError(f"kind={job.kind!r}; expected JobKind.LOAD or JobKind.STORE")
        except Exception:
            # A backend may raise after it queued the job (`holds` says so, per the protocol):
            # it reports the job then, and a refusal too would be a second report, which the
            # scheduler half refuses along with the rest of that batch. The next get_finished
            # decides (`_settle`); noted first, so that an interrupt during the logging cannot
            # lose the report.
            self._unsettled.add(job.job_id)
            logger.exception(
                "kvtier: submitting %s job %d of request %s raised; reported failed unless "
                "the transfer worker queued it all the same",
                _kind(job),
                job.job_id,
                job.req_id,
            )
        except BaseException:
            # An interrupt (Ctrl-C in a notebook, whose user goes on) propagates; the job is
            # reported exactly once all the same: by the transfer worker if it was queued (the
            # interrupt may come as the submit returns), else by the next get_finished, failed,
            # as a refusal is. Only noted here: the handler's first call, so no second
            # interrupt can land before it (asking `holds` here could be interrupted). It
            # stays marked submitted until reported, so that metadata fed again skips it.
            self._unsettled.add(job.job_id)
            raise

    def _settle(self) -> None:
        """Report failed each job whose submit raised and that the transfer worker did not
        queue. Safe to run again after an interrupt part-way: a job is refused at most once."""
        refused = {r.job_id for r in self._refused}
        for job_id in sorted(self._unsettled):
            if job_id not in refused and not self._holds(job_id):
                self._refused.append(TransferResult(job_id, False))
            self._unsettled.discard(job_id)

    def _holds(self, job_id: int) -> bool:
        """`transfer.holds(job_id)` for a job whose submit raised; a backend that cannot answer
        is taken to have queued nothing (the refusal is then its one report)."""
        try:
            return self.transfer.holds(job_id)
        except Exception:
            logger.exception("kvtier: holds(%d) raised after a failed submit", job_id)
            return False


def _kind(job: TransferJob) -> object:
    """The job's kind for a log line: its name, or what stands there instead of a JobKind."""
    return job.kind.value if isinstance(job.kind, JobKind) else repr(job.kind)
