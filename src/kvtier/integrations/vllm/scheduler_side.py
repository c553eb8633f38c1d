"""Scheduler half of `KVTierConnector`: vLLM's requests and steps onto `OffloadingScheduler`.

vLLM's `Request.block_hashes` (one per device block) are kvtier's block hashes as they are;
the KV-cache group index completes the key. The per-step path does one dict look-up and one
small object per scheduled request; block tables are read from vLLM only when a store is due.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

from kvtier.base import TransferResult
from kvtier.connector import OffloadingScheduler, StepProgress
from kvtier.cpu import CPUOffloadingManager
from kvtier.integrations.vllm.events import ChunkPayloads, to_vllm_events
from kvtier.integrations.vllm.metadata import KVTierConnectorMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.setup import VllmSetup
from kvtier.integrations.vllm.stats import KVTierConnectorStats, Snapshot

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class _LazyBlockIds(Sequence[Sequence[int]]):
    """A request's block table per group, fetched from vLLM on first use (stores only)."""

    __slots__ = ("_get", "_req_id", "_table")

    def __init__(self, get: Callable[[str], tuple[list[int], ...]], req_id: str) -> None:
        self._get = get
        self._req_id = req_id
        self._table: tuple[list[int], ...] | None = None

    def _resolve(self) -> tuple[list[int], ...]:
        if self._table is None:
            self._table = self._get(self._req_id)
        return self._table

    @overload
    def __getitem__(self, index: int) -> Sequence[int]: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Sequence[int]]: ...
    def __getitem__(self, index: int | slice) -> Any:
        return self._resolve()[index]

    def __len__(self) -> int:
        return len(self._resolve())

    def __iter__(self) -> Iterator[Sequence[int]]:
        return iter(self._resolve())


def _allocated_blocks(out: SchedulerOutput, tokens_per_block: int) -> Iterator[int]:
    """Device blocks a scheduler step gives to requests to write: new and resumed requests'
    blocks past their prefix hit (blocks they only read need no fence), running requests' new
    ones, the targets of copy-on-write copies, and blocks the workers zero."""
    for new in out.scheduled_new_reqs:
        hit = new.num_computed_tokens // tokens_per_block
        for ids in new.block_ids:
            yield from ids[hit:]
    cached = out.scheduled_cached_reqs
    resumed = cached.resumed_req_ids
    for i, group_ids in enumerate(cached.new_block_ids):
        if group_ids is None:
            continue
        # A resumed request's list is its whole block table, prefix hits first.
        hit = (
            cached.num_computed_tokens[i] // tokens_per_block if cached.req_ids[i] in resumed else 0
        )
        for ids in group_ids:
            yield from ids[hit:]
    for copy in out.kv_cache_block_copies or ():
        yield copy.dst_block_id
    # Zeroed by the workers before the forward pass (a hybrid model's new blocks): written too.
    yield from out.new_block_ids_to_zero or ()


class KVTierSchedulerSide:
    """Adapts vLLM's scheduler-side connector calls to kvtier's `OffloadingScheduler`."""

    def __init__(self, setup: VllmSetup) -> None:
        cfg = setup.config
        self.setup = setup
        self.manager = CPUOffloadingManager.from_config(
            setup.num_slots, cfg, enable_events=setup.events
        )
        self.scheduler = OffloadingScheduler(
            self.manager,
            tokens_per_block=setup.tokens_per_block,
            blocks_per_chunk=setup.blocks_per_chunk,
            groups=setup.groups,
            num_workers=setup.num_workers,
            # offload_prompt_only is applied in build_connector_meta, from vLLM's current
            # prompt length, which a streaming-input session's next input extends. Under RSWA
            # the scheduler applies it from the length given at add_request (the first turn's):
            # RSWA frees a turn's output blocks behind the window, and the next input makes
            # them prompt with their KV gone (vLLM's null block in the block table).
            offload_prompt_only=cfg.offload_prompt_only and setup.rswa,
            proof_chunks=setup.proof_chunks,
            # vLLM recomputes the last token of a full hit loaded asynchronously (kvtier's
            # loads always are), as its own OffloadingConnector relies on. Not under RSWA,
            # whose prefix replay rewinds a hit by a window, nor with a drafter proof.
            full_prompt_hits=not setup.rswa and not setup.proof_chunks,
        )
        self._live_prompt_only = cfg.offload_prompt_only and not setup.rswa
        # A finished request's blocks go back to vLLM at once; a step given one that a store
        # still reads waits for it first (the workers' `handle_preemptions`, before anything
        # writes the block), as vLLM's own OffloadingConnector fences reused blocks.
        self._release = cfg.release_finished_blocks
        self._allocated: list[int] = []  # blocks vLLM gave out this step, if any is fenced
        # The device prefix hit each request was last asked about (its blocks are only read).
        self._local_hits: dict[str, int] = {}
        self._requests: dict[str, Request] = {}
        self._get_block_ids: Callable[[str], tuple[list[int], ...]] | None = None
        # Requests with a load in flight: vLLM frees their blocks on `finished_recving`, so
        # they must never also be reported as `finished_sending`.
        self._loads: dict[int, list[Any]] = {}  # job id -> [req id, reports left]
        self._loading: dict[str, int] = {}  # req id -> load jobs in flight
        self._held: list[str] = []
        # Loads failed at allocation, for the next step's workers to report (request id ->
        # the device blocks the load would have filled).
        self._failed_at_alloc: dict[str, list[int]] = {}
        # Requests whose load was planned since the last build_connector_meta, which sends it:
        # vLLM plans a deferred load from update_from_output, and an abort may come before the
        # next step (`request_finished`).
        self._unsent_loads: set[str] = set()
        # Preemptions (vLLM's `Request.num_preemptions`) already handed to the scheduler, for
        # requests preempted at least once.
        self._preemptions: dict[str, int] = {}
        # The token count a preempted request's lookups may reach, as last given to the
        # scheduler (`_extend_lookup`).
        self._lookup_limits: dict[str, int] = {}
        self._loaded_tokens = 0  # offered and accepted by vLLM, for the connector stats
        self._payloads = (
            ChunkPayloads(setup.tokens_per_block, setup.blocks_per_chunk, setup.group_kinds)
            if setup.self_describing
            else None
        )
        if cfg.self_describing_kv_events and not setup.events:
            logger.warning(
                "kvtier: self_describing_kv_events is set but KV events are off "
                "(--kv-events-config, or enable_events=false): no events are sent"
            )
        self._stats_mark = self._snapshot()
        logger.info(
            "kvtier: scheduler side ready: %d host slots of %d blocks x %d tokens "
            "(%.2f GiB), cache policy %s, %d KV-cache group(s), %d worker(s), KV events %s",
            setup.num_slots,
            setup.blocks_per_chunk,
            setup.tokens_per_block,
            setup.num_slots * setup.slot_bytes / 2**30,
            cfg.cache_policy,
            len(setup.groups),
            setup.num_workers,
            ("self-describing" if setup.self_describing else "on") if setup.events else "off",
        )

    def _snapshot(self) -> Snapshot:
        return Snapshot.take(self.scheduler, self.manager.get_stats(), self._loaded_tokens)

    def get_stats(self) -> KVTierConnectorStats | None:
        """The counters' growth since the last call (None if nothing moved), for vLLM's
        connector metrics."""
        now = self._snapshot()
        stats, self._stats_mark = now.since(self._stats_mark), now
        return stats

    def bind_block_ids(self, get_block_ids: Callable[[str], tuple[list[int], ...]]) -> None:
        """Where to read a request's block table (vLLM's `KVCacheManager.get_block_ids`)."""
        self._get_block_ids = get_block_ids

    # -- vLLM scheduler calls ----------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """Track a request from its arrival; its block hash list is shared, not copied."""
        self._requests[request.request_id] = request
        self.scheduler.add_request(
            request.request_id,
            request.block_hashes,
            request.num_prompt_tokens,
            request.kv_transfer_params,
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens kvtier can load (asynchronously); `(None, False)` means ask again."""
        if request.num_preemptions:
            self._note_preemption(request)
            if not self.setup.rswa:
                self._extend_lookup(request)
        # Prompt logprobs, or a pooling task over every token: vLLM computes the whole prompt
        # and drops any offer, which looked up would count as hits the tier never served.
        n = self.scheduler.get_num_new_matched_tokens(
            request.request_id, num_computed_tokens, read=not request.skip_reading_prefix_cache
        )
        self._local_hits[request.request_id] = num_computed_tokens
        if n is None:
            return None, False
        return n, n > 0

    def _extend_lookup(self, request: Request) -> None:
        """Let a preempted request's hit reach every token it had computed.

        The scheduler loads no further than a request's prompt (less its last token). A
        resumed request computed its generated tokens too, and their chunks may be in the
        tier (stored with offload_prompt_only=False, or as another request's prompt): as
        vLLM's own prefix cache and OffloadingConnector do, its hit may reach all its tokens
        but the last. A streaming session's prompt has grown since add_request as well. With
        a drafter proof the limit stays the prompt: the scheduler reads tokens beyond it as a
        decoding tail, whose last chunk is not stored. Stores do not follow the limit:
        offload_prompt_only caps them at vLLM's own prompt length (`build_connector_meta`).
        (Not called under RSWA, where that turn's earlier output may be vLLM's null block and
        the first turn's prompt stays the limit, as for stores.)"""
        req_id = request.request_id
        limit = request.num_prompt_tokens if self.setup.proof_chunks else request.num_tokens
        # Never below a limit given before: a streaming session's next turn drops the last
        # token sampled, and the scheduler refuses a limit that shrinks.
        if limit > self._lookup_limits.get(req_id, 0):
            self._lookup_limits[req_id] = limit
            self.scheduler.extend_prompt(req_id, limit)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan the load into the blocks vLLM allocated for the matched tokens."""
        local = self._local_hits.pop(request.request_id, None)
        if self._release and self.scheduler.has_fences():
            # Its blocks past the device hit are written by a load, kvtier's or, inside a
            # MultiConnector that chose another connector, that one's (kvtier is then told
            # num_external_tokens=0), and a request waiting for a load is not in the step's
            # output. Not looked up in this pass (resumed after a load, a streaming session's
            # next input): its computed tokens are the hit.
            hit = request.num_computed_tokens if local is None else local
            first = hit // self.setup.tokens_per_block
            self._allocated.extend(b for ids in blocks.get_block_ids() for b in ids[first:])
        if num_external_tokens == 0:
            self.scheduler.update_state_after_alloc(request.request_id, (), 0)
            return
        req_id = request.request_id
        self.scheduler.update_state_after_alloc(req_id, blocks.get_block_ids(), num_external_tokens)
        self._loaded_tokens += num_external_tokens
        # The chunks offered may be gone by now: vLLM 0.33 defers this call past the offer's
        # step when it defers async loads (HiSparse with overlapping batches), and that step's
        # stores may evict them or a reset drop them. The scheduler then fails the load at
        # once, with no job: only the workers can tell vLLM, in the next step's metadata.
        finished = self.scheduler.take_finished()
        if req_id in finished.failed_loads:
            self._failed_at_alloc[req_id] = sorted(finished.failed_load_blocks)
        else:
            self._unsent_loads.add(req_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierConnectorMetadata:
        """Turn one scheduler step into kvtier's step metadata."""
        sched = self.scheduler
        requests = self._requests
        for req_id in scheduler_output.preempted_req_ids or ():
            request = requests.get(req_id)
            if request is not None:
                self._note_preemption(request)
        get = self._get_block_ids
        if get is None:
            raise RuntimeError("bind_block_ids() was not called before the first step")
        # vLLM's num_computed_tokens counts this step's tokens only after build_connector_meta.
        # With offload_prompt_only the bound is vLLM's `num_prompt_tokens`, read each step:
        # a streaming-input session's next input chunk extends the prompt by the previous
        # turn's kept output and the new tokens (Scheduler._update_request_as_session).
        prompt_only = self._live_prompt_only
        progress = []
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(req_id)
            if request is None:
                continue
            computed = request.num_computed_tokens + n
            if prompt_only and computed > request.num_prompt_tokens:
                computed = request.num_prompt_tokens
            progress.append(StepProgress(req_id, _LazyBlockIds(get, req_id), computed))
        if self._release and sched.has_fences():
            self._allocated.extend(_allocated_blocks(scheduler_output, self.setup.tokens_per_block))
            sched.blocks_allocated(b for b in self._allocated if b)  # 0: vLLM's null block
        self._allocated.clear()
        step = sched.build_step_metadata(progress)
        self._unsent_loads.clear()  # every job planned is in `step` now
        for job in step.loads:
            self._loads[job.job_id] = [job.req_id, self.setup.num_workers]
            self._loading[job.req_id] = self._loading.get(job.req_id, 0) + 1
        if self._payloads is not None:
            for job in step.stores:
                # Stores are planned for this step's scheduled requests, all of them tracked.
                request = requests[job.req_id]
                self._payloads.plan(job.job_id, request, sched.store_chunks(job.job_id))
        held, self._held = self._held, []
        failed, self._failed_at_alloc = self._failed_at_alloc, {}
        return KVTierConnectorMetadata(step, held, failed_loads=failed)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Record the jobs the workers finished this step."""
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, KVTierWorkerMetadata) or not meta.results:
            return
        by_worker: dict[int, list[TransferResult]] = {}
        for job_id, ok, rank, nbytes, seconds in meta.results:
            by_worker.setdefault(rank, []).append(TransferResult(job_id, ok, nbytes, seconds))
        # One worker's reports at a time, each applied whole with its bookkeeping here, so a
        # report refused (a worker's bug) leaves both halves agreeing on what is in flight.
        for rank, results in by_worker.items():
            self.scheduler.on_worker_results(results, worker=rank)
            if self._loads:
                self._count_load_reports(results)
        # vLLM hears about finished requests from the workers' get_transfer_results.
        self.scheduler.take_finished()

    def _count_load_reports(self, results: list[TransferResult]) -> None:
        for r in results:
            entry = self._loads.get(r.job_id)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] == 0:
                del self._loads[r.job_id]
                left = self._loading[entry[0]] - 1
                if left:
                    self._loading[entry[0]] = left
                else:
                    del self._loading[entry[0]]

    def request_finished(self, request: Request) -> bool:
        """True when vLLM must keep the request's blocks until the workers report it."""
        req_id = request.request_id
        if self._requests.pop(req_id, None) is None:
            return False
        if request.num_preemptions:
            # A request preempted by a reset and aborted before the next step: vLLM freed its
            # blocks at the preemption, so holding them now holds nothing; its jobs in flight
            # go into the next step's wait_for instead.
            self._note_preemption(request)
            self._preemptions.pop(req_id, None)
            self._lookup_limits.pop(req_id, None)
        if req_id in self._unsent_loads:
            # The scheduler drops the load no worker has seen, but vLLM, which planned it, frees
            # the request's blocks only once a worker reports the load ended: the workers
            # report it (failed, with no block to recompute: the request is gone).
            self._unsent_loads.discard(req_id)
            self._failed_at_alloc[req_id] = []
        self._local_hits.pop(req_id, None)
        hold = self.scheduler.request_finished(req_id, release=self._release)
        if hold and req_id not in self._loading:
            self._held.append(req_id)
        return hold

    def _note_preemption(self, request: Request) -> None:
        """Hand a preemption to the scheduler as soon as kvtier can see it.

        vLLM lists a request preempted by `reset_prefix_cache(reset_running_requests=True)`,
        which runs between steps, only in the next step's `preempted_req_ids`, after that
        step's scheduling pass. By then the request may have been admitted again (its load
        planned in that pass must not be cancelled as a pre-preemption job) or finished (its
        jobs in flight must still be waited for): both are seen here first."""
        n = request.num_preemptions
        if n != self._preemptions.get(request.request_id, 0):
            self._preemptions[request.request_id] = n
            self.scheduler.request_preempted(request.request_id)

    def has_held(self) -> bool:
        """Whether finished requests still hold blocks until their stores finish."""
        # The scheduler tracks running requests plus finished ones with jobs in flight.
        return self.scheduler.num_requests() > len(self._requests)

    def take_events(self) -> list[KVCacheEvent]:
        """KV events for chunks stored in or removed from the host tier since the last call
        (empty unless vLLM's KV events are enabled)."""
        events = to_vllm_events(self.manager.take_events(), self._payloads)
        if self._payloads is not None:
            # Every store of the jobs that ended is among the events just taken.
            self._payloads.forget_ended(self.scheduler.job_ids_in_flight())
        return events

    def reset_cache(self) -> None:
        """Empty the host tier; transfers in flight finish without touching the new contents."""
        self.scheduler.reset_cache()
        logger.info("kvtier: host cache reset")
