"""Worker half of `KVTierConnector`: vLLM's KV-cache tensors registered with kvtier's
transfer engine, each step's jobs run in a KV-safe order, completions reported as vLLM
expects (loads in `finished_recving`, held requests in `finished_sending`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvtier.base import TransferResult
from kvtier.connector import OffloadingWorker
from kvtier.connector.metadata import StepMetadata, TransferJob
from kvtier.integrations.vllm.metadata import KVTierConnectorMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.setup import VllmSetup
from kvtier.transfer import (
    HostPool,
    KVCacheRegistration,
    KVTensor,
    TransferWorker,
)
from kvtier.transfer.factory import transfer_worker_from_config

logger = logging.getLogger(__name__)


def block_rows(tensor: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A layer's KV cache as a `(num_blocks, page_bytes)` uint8 view, no copy.

    vLLM puts a layer's device blocks in dimension 0 (possibly split into kernel blocks);
    every layout it uses for offloading keeps one block's bytes in one contiguous run, in any
    order of heads, tokens and K/V. Raises ValueError for a tensor that does not.
    """
    t = tensor
    if t.dim() < 2 or t.shape[0] % num_blocks:
        raise ValueError(
            f"KV tensor of shape {tuple(t.shape)}: expected dimension 0 to hold the "
            f"{num_blocks} device blocks (or a multiple, for kernel blocks)"
        )
    if t.shape[0] != num_blocks:
        t = t.view(num_blocks, -1, *t.shape[1:])
    item = t.element_size()
    dims = sorted((t.stride(d), t.shape[d]) for d in range(1, t.dim()) if t.shape[d] != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            raise ValueError(
                f"KV tensor of shape {tuple(t.shape)} and strides {tuple(t.stride())}: a "
                "device block's data is not one contiguous run; expected a block-contiguous "
                "layout such as LBHNC"
            )
        expected *= size
    page = expected * item
    block_stride = t.stride(0) * item
    if num_blocks > 1 and block_stride < page:
        raise ValueError(f"KV tensor of shape {tuple(t.shape)}: blocks overlap")
    view = torch.empty(0, dtype=torch.uint8, device=t.device)
    return view.set_(
        t.untyped_storage(), t.storage_offset() * item, (num_blocks, page), (block_stride, 1)
    )


class KVTierWorkerSide:
    """Runs the scheduler's jobs on one worker and reports them back."""

    def __init__(self, setup: VllmSetup, layer_groups: Mapping[str, int], rank: int = 0) -> None:
        if not 0 <= rank < setup.num_workers:
            raise ValueError(
                f"rank={rank!r} is invalid; expected a worker index in [0, {setup.num_workers})"
            )
        self.setup = setup
        self.rank = rank
        self.layer_groups = dict(layer_groups)
        self.transfer: TransferWorker | None = None
        self._worker: OffloadingWorker | None = None
        self._jobs: dict[int, tuple[str, bool, list[int]]] = {}  # id -> (req, is_load, blocks)
        self._in_flight: dict[str, int] = {}  # req id -> jobs in flight on this worker
        self._loads_in_flight: dict[str, int] = {}
        # Requests with a failed load job, and its blocks: load errors only once the request's
        # last load job ended (a hybrid model's groups may end in different passes, and a
        # caller of `get_finished` reads them in the pass that reports the request).
        self._failed: dict[str, list[int]] = {}
        self._held: set[str] = set()
        self._results: list[tuple[int, bool, int, int, float]] = []
        self._load_errors: set[int] = set()
        self._registration: KVCacheRegistration | None = None
        # KV-cache groups with layers on this worker, and results of jobs of the others.
        self._groups_here: frozenset[int] = frozenset()
        self._done_here: list[TransferResult] = []
        # The step metadata whose loads, and whose stores, were submitted last: the same
        # metadata handed over again submits nothing twice. `_unsaved` is the metadata a step
        # started with and whose `wait_for_save` has not come yet.
        self._loaded: KVTierConnectorMetadata | None = None
        self._saved: KVTierConnectorMetadata | None = None
        self._unsaved: KVTierConnectorMetadata | None = None
        # The metadata whose scheduler-side failed loads were taken up last (once each).
        self._noted: KVTierConnectorMetadata | None = None
        self._failed_at_alloc: list[str] = []

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Register every offloaded layer's tensor and allocate the host pool (once).

        A second call is refused, leaving the first registration running: its host pool holds
        the chunks the scheduler counts as stored, and its transfer worker the jobs in flight.
        Replacing them would lose both, and a later load would serve an empty slot as good."""
        if self._registration is not None:
            transfer = self.transfer
            raise RuntimeError(
                f"kvtier: register_kv_caches() called a second time on worker {self.rank}, "
                f"with {len(self._jobs)} jobs in flight and a host pool of "
                f"{transfer.pool.num_slots if transfer is not None else 0} slots the scheduler "
                "counts on; the first registration stays in use. Expected one call per "
                "connector (vLLM's sleep mode does not re-register); to change the KV caches, "
                "shut this connector down and build a new one"
            )
        missing = sorted(set(self.layer_groups) - set(kv_caches))
        if missing:
            raise ValueError(f"vLLM gave no KV cache for layers {missing}")
        n = self.setup.num_device_blocks
        tensors = [
            KVTensor(block_rows(kv_caches[name], n), 0, group)
            for name, group in self.layer_groups.items()
        ]
        self._registration = KVCacheRegistration(tensors)
        self._groups_here = frozenset(self._registration.groups)
        try:
            self._start_transfer(self.setup.num_slots)
        except BaseException:
            # Nothing is registered (no pool, no worker): a retry, after freeing memory say,
            # is a first registration, not a second one.
            self._registration, self._groups_here = None, frozenset()
            raise

    def _start_transfer(self, num_slots: int) -> None:
        registration = self._registration
        assert registration is not None
        cfg = self.setup.config
        pool = HostPool(
            registration,
            self.setup.blocks_per_chunk,
            num_slots=num_slots,
            pin=cfg.pin_memory,
        )
        try:
            self.transfer = transfer_worker_from_config(registration, pool, cfg)
        except BaseException:
            pool.close()  # unpinned now (it may be many GiB), not whenever the collector gets to it
            raise
        self._worker = OffloadingWorker(self.transfer)
        path = getattr(self.transfer, "copy_path", None)
        if path and getattr(self.transfer, "coalesce_depth", 0):
            path += f", coalescing behind {self.transfer.coalesce_depth} batches a lane"  # type: ignore[attr-defined]
        where = getattr(self.transfer, "copy_cpus", None) or (
            "any, off the submitter's" if getattr(self.transfer, "avoid_submitter_cpu", False)
            else "any"
        )  # fmt: skip
        logger.info(
            "kvtier: worker registered %d KV tensors on %s (%s), host pool %d slots x %d bytes "
            "(%.2f GiB, pinned=%s), %s transfer backend (%s)",
            len(registration.tensors),
            registration.device,
            ", ".join(
                f"group {g}: {registration.page_bytes(g)} B/block" for g in registration.groups
            ),
            pool.num_slots,
            pool.slot_bytes,
            pool.nbytes / 2**30,
            pool.pinned,
            type(self.transfer).__name__,
            f"copy path: {path}" if path else f"copy threads on CPUs {where}",
        )

    def fit_pool(self, num_slots: int) -> None:
        """Hold `num_slots` slots, the scheduler's count (0: not given, nothing to do).

        The scheduler sizes `cpu_bytes_to_use` from the first worker's KV pages, which is all
        vLLM gives it; a pipeline stage with more layers than the first computes fewer slots
        of its larger share of a chunk, and would refuse every job naming a slot beyond them.
        Its pool grows here, before its first job, so that every worker keeps as many chunks
        as the scheduler hands out (at a little more than its share of the bytes)."""
        transfer = self.transfer
        if transfer is None or num_slots <= transfer.pool.num_slots:
            return
        if self._jobs:
            raise RuntimeError(
                f"kvtier: the scheduler's host tier has {num_slots} slots but this worker's "
                f"pool has {transfer.pool.num_slots}, with jobs in flight; expected the "
                "scheduler to give its slot count before the first job"
            )
        logger.warning(
            "kvtier: worker %d's host pool grows from %d to %d slots (%.2f GiB): the "
            "scheduler sized cpu_bytes_to_use from the first worker's KV pages, and this "
            "worker holds more bytes per chunk (a pipeline stage with more layers); set "
            "num_slots instead of cpu_bytes_to_use to size every worker alike",
            self.rank,
            transfer.pool.num_slots,
            num_slots,
            num_slots * transfer.pool.slot_bytes / 2**30,
        )
        # Free the old pool before allocating the new one: unpinned here, not whenever the last
        # reference to it goes (a finalizer's arguments hold it until its worker is collected).
        self.transfer = None
        self._worker = None
        transfer.shutdown()
        transfer.pool.close()
        del transfer
        self._start_transfer(num_slots)

    def _check(self) -> OffloadingWorker:
        if self._worker is None:
            raise RuntimeError("register_kv_caches() was not called before the first step")
        return self._worker

    # -- step --------------------------------------------------------------------------------

    def _begin(self, meta: KVTierConnectorMetadata) -> None:
        """Start the step of `meta`: take up the loads the scheduler failed before any job
        ran (reported by the next `get_transfer_results`), and first submit the stores of an
        earlier step whose `wait_for_save` never came.

        vLLM 0.33 with speculative decoding defers `wait_for_save` until after the drafter,
        in `sample_tokens`, which returns early on every pipeline stage but the last: there
        it is never called. That step's stores (their KV was written by the forward pass
        before this step's) would never run nor be reported, and its held requests never
        reach `finished_sending`, so vLLM would keep their blocks forever."""
        self.fit_pool(meta.num_slots)
        if meta.failed_loads and meta is not self._noted:
            self._noted = meta
            self._failed_at_alloc.extend(meta.failed_loads)
            for blocks in meta.failed_loads.values():
                self._load_errors.update(blocks)
        unsaved = self._unsaved
        if unsaved is not None and unsaved is not meta:
            logger.debug("kvtier: wait_for_save of the previous step never came; saving now")
            self.wait_for_save(unsaved)
        self._unsaved = meta

    def handle_preemptions(self, meta: KVTierConnectorMetadata) -> None:
        """Wait for transfers that read blocks vLLM is about to reuse."""
        self._begin(meta)
        if meta.step.wait_for:
            self._check().transfer.wait(meta.step.wait_for)

    def start_load_kv(self, meta: KVTierConnectorMetadata) -> None:
        """Submit the step's loads (they fill blocks of requests not computed this step)."""
        self._begin(meta)
        step = meta.step
        if not step.loads or meta is self._loaded:
            return
        worker = self._check()
        self._loaded = meta
        for job in step.loads:
            self._track(job.job_id, job.req_id, True, job.device_blocks.tolist())
        loads = self._jobs_here(step.loads)
        if loads is not step.loads:
            step = StepMetadata(loads=loads, wait_for=step.wait_for)
        worker.start_step(step)

    def wait_for_save(self, meta: KVTierConnectorMetadata) -> None:
        """Submit the step's stores, after the forward pass that produced their KV."""
        self.fit_pool(meta.num_slots)
        if self._unsaved is meta:
            self._unsaved = None
        if meta is self._saved:
            return
        self._saved = meta
        step = meta.step
        self._held.update(meta.held)
        if not step.stores:
            return
        worker = self._check()
        for job in step.stores:
            self._track(job.job_id, job.req_id, False, [])
        stores = self._jobs_here(step.stores)
        if stores is not step.stores:
            step = StepMetadata(stores=stores, wait_for=step.wait_for)
        worker.finish_step(step)

    def _jobs_here(self, jobs: list[TransferJob]) -> list[TransferJob]:
        """`jobs` of the KV-cache groups with layers on this worker; the others succeed now.

        vLLM gives a pipeline stage every KV-cache group, with only the stage's own layers: a
        group may have none here (a drafter's layers, on the last stage). Its jobs move
        nothing on this worker, and fail nothing either."""
        groups = self._groups_here
        if all(job.group in groups for job in jobs):
            return jobs
        here = []
        for job in jobs:
            if job.group in groups:
                here.append(job)
            else:
                self._done_here.append(TransferResult(job.job_id, True))
        return here

    def _track(self, job_id: int, req_id: str, is_load: bool, blocks: list[int]) -> None:
        self._jobs[job_id] = (req_id, is_load, blocks)
        self._in_flight[req_id] = self._in_flight.get(req_id, 0) + 1
        if is_load:
            self._loads_in_flight[req_id] = self._loads_in_flight.get(req_id, 0) + 1

    def get_transfer_results(self) -> KVConnectorTransferResults:
        """Loads finished (or failed) and held requests whose jobs are all done."""
        out = KVConnectorTransferResults()
        if self._failed_at_alloc:
            # Loads the scheduler failed before any job ran: finished, and failed.
            out.finished_recving.update(self._failed_at_alloc)
            out.failed_recving.update(self._failed_at_alloc)
            self._failed_at_alloc = []
        if self._worker is not None:
            finished = self._worker.get_finished()
            if self._done_here:
                finished = self._done_here + finished
                self._done_here = []
            for r in finished:
                self._results.append((r.job_id, r.success, self.rank, r.bytes, r.seconds))
                req_id, is_load, blocks = self._jobs.pop(r.job_id)
                left = self._in_flight[req_id] - 1
                if left:
                    self._in_flight[req_id] = left
                else:
                    del self._in_flight[req_id]
                if not is_load:
                    continue
                if not r.success:
                    self._failed.setdefault(req_id, []).extend(blocks)
                loads_left = self._loads_in_flight[req_id] - 1
                if loads_left:
                    self._loads_in_flight[req_id] = loads_left
                    continue
                del self._loads_in_flight[req_id]
                out.finished_recving.add(req_id)
                failed_blocks = self._failed.pop(req_id, None)
                if failed_blocks is not None:
                    self._load_errors.update(failed_blocks)
                    out.failed_recving.add(req_id)
        if self._held:
            done = [req_id for req_id in self._held if req_id not in self._in_flight]
            self._held.difference_update(done)
            out.finished_sending.update(done)
        return out

    def take_load_errors(self) -> set[int]:
        """Device blocks that failed loads left without valid KV, since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_worker_meta(self) -> KVTierWorkerMetadata | None:
        """This worker's finished jobs for the scheduler half, or None when there are none."""
        if not self._results:
            return None
        results, self._results = self._results, []
        return KVTierWorkerMetadata(results)

    def shutdown(self) -> None:
        """Stop the transfer worker (jobs not started are reported failed) and unpin its host
        pool: it may be many GiB, and the collector may not get to it before the engine ends."""
        if self.transfer is not None:
            # The pool is unpinned only once the worker has stopped: interrupted, its copies
            # may still run, and the pool refuses to close under them (`HostPool.close`).
            self.transfer.shutdown()
            self.transfer.pool.close()
