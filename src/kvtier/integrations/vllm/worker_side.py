"""Worker half of `KVTierConnector`: vLLM's KV-cache tensors registered with kvtier's
transfer engine, each step's jobs run in a KV-safe order, completions reported as vLLM
expects (loads in `finished_recving`, held requests in `finished_sending`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvtier.connector import OffloadingWorker
from kvtier.integrations.vllm.metadata import KVTierConnectorMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.setup import VllmSetup
from kvtier.transfer import (
    HostPool,
    KVCacheRegistration,
    KVTensor,
    TransferWorker,
    make_transfer_worker,
)

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
        self._failed: set[str] = set()
        self._held: set[str] = set()
        self._results: list[tuple[int, bool, int]] = []
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Register every offloaded layer's tensor and allocate the host pool."""
        missing = sorted(set(self.layer_groups) - set(kv_caches))
        if missing:
            raise ValueError(f"vLLM gave no KV cache for layers {missing}")
        n = self.setup.num_device_blocks
        tensors = [
            KVTensor(block_rows(kv_caches[name], n), 0, group)
            for name, group in self.layer_groups.items()
        ]
        registration = KVCacheRegistration(tensors)
        cfg = self.setup.config
        pool = HostPool(
            registration,
            self.setup.blocks_per_chunk,
            num_slots=self.setup.num_slots,
            pin=cfg.pin_memory,
        )
        self.transfer = make_transfer_worker(
            registration,
            pool,
            cfg.transfer_backend,
            copy_cpus=cfg.transfer_cpus,
            avoid_submitter_cpu=cfg.transfer_avoid_submitter_cpu,
            coalesce_depth=cfg.transfer_coalesce_depth,
        )
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
            len(tensors),
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

    def _check(self) -> OffloadingWorker:
        if self._worker is None:
            raise RuntimeError("register_kv_caches() was not called before the first step")
        return self._worker

    # -- step --------------------------------------------------------------------------------

    def handle_preemptions(self, meta: KVTierConnectorMetadata) -> None:
        """Wait for transfers that read blocks vLLM is about to reuse."""
        if meta.step.wait_for:
            self._check().transfer.wait(meta.step.wait_for)

    def start_load_kv(self, meta: KVTierConnectorMetadata) -> None:
        """Submit the step's loads (they fill blocks of requests not computed this step)."""
        step = meta.step
        if not step.loads:
            return
        worker = self._check()
        for job in step.loads:
            self._track(job.job_id, job.req_id, True, job.device_blocks.tolist())
        worker.start_step(step)

    def wait_for_save(self, meta: KVTierConnectorMetadata) -> None:
        """Submit the step's stores, after the forward pass that produced their KV."""
        step = meta.step
        self._held.update(meta.held)
        if not step.stores:
            return
        worker = self._check()
        for job in step.stores:
            self._track(job.job_id, job.req_id, False, [])
        worker.finish_step(step)

    def _track(self, job_id: int, req_id: str, is_load: bool, blocks: list[int]) -> None:
        self._jobs[job_id] = (req_id, is_load, blocks)
        self._in_flight[req_id] = self._in_flight.get(req_id, 0) + 1
        if is_load:
            self._loads_in_flight[req_id] = self._loads_in_flight.get(req_id, 0) + 1

    def get_transfer_results(self) -> KVConnectorTransferResults:
        """Loads finished (or failed) and held requests whose jobs are all done."""
        out = KVConnectorTransferResults()
        if self._worker is not None:
            for r in self._worker.get_finished():
                self._results.append((r.job_id, r.success, self.rank))
                req_id, is_load, blocks = self._jobs.pop(r.job_id)
                left = self._in_flight[req_id] - 1
                if left:
                    self._in_flight[req_id] = left
                else:
                    del self._in_flight[req_id]
                if not is_load:
                    continue
                if not r.success:
                    self._failed.add(req_id)
                    self._load_errors.update(blocks)
                loads_left = self._loads_in_flight[req_id] - 1
                if loads_left:
                    self._loads_in_flight[req_id] = loads_left
                    continue
                del self._loads_in_flight[req_id]
                out.finished_recving.add(req_id)
                if req_id in self._failed:
                    self._failed.discard(req_id)
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
        """Stop the transfer worker (jobs not started are reported failed)."""
        if self.transfer is not None:
            self.transfer.shutdown()
