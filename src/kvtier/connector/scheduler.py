"""Scheduler half of a connector: turns an engine's requests into load and store jobs.

Engine-agnostic: an engine adapter (vLLM, transformers, the simulator) calls these methods from
its step loop and ships each step's `StepMetadata` to the worker half. The rules that keep KV
correct live here:

- a request's load in flight is its only job: no store is planned beside it, nor beside
  jobs left from before a preemption; its stores of successive steps may overlap;
- a finished request's device blocks are held until its jobs are done (`request_finished`
  returns True), and a preempted request's jobs are waited for before the next step;
- a failed load is reported, so the engine recomputes instead of using the blocks, and the
  request is offered no hits again until the engine preempts it (one try per preemption);
- after `reset_cache`, late completions of older jobs do not touch the manager's chunks;
- the manager's policy hears of a request's end (`on_request_finished`) once the request has
  no job left, so no call naming the request follows it.
"""

from __future__ import annotations

import logging
import math
import operator
import reprlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.base import (
    BlockIDsLoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    ManagerStats,
    OffloadingManager,
    OffloadKey,
    ReqContext,
    TransferResult,
    checked_int,
)
from kvtier.base import make_offload_key as _make_key
from kvtier.connector.metadata import (
    FinishedRequests,
    JobKind,
    StepMetadata,
    TransferJob,
    _Job,
)

logger = logging.getLogger(__name__)


def _block_ids(spec: LoadStoreSpec) -> npt.NDArray[np.int64]:
    if not isinstance(spec, BlockIDsLoadStoreSpec):
        raise TypeError(f"the connector needs slot-addressed specs; the manager gave {spec!r}")
    return spec.block_ids


def _room(stats: ManagerStats) -> int:
    """Slots a store could have: free, or ready to be evicted (not those pinned, being
    written, or held since a reset until the transfers then in flight end)."""
    return stats.num_slots - stats.used_slots + stats.ready


@dataclass(slots=True)
class _Request:
    ctx: ReqContext
    block_hashes: Sequence[bytes]
    num_prompt_tokens: int
    keys: list[list[OffloadKey]]  # per group, per chunk; grown lazily
    next_store_chunk: int = 0
    # The tier's room (`_room`: slots a store could have) when the request's last store
    # found none, else -1: the store is planned again only once there is more.
    no_room_at: int = -1
    reused_chunks: int = 0  # leading chunks this request used: device hits, then loads
    # End chunk of the request's load in flight (else 0): reused once every group's job has
    # succeeded, or if the request ends while it is sent (its outcome unknown then).
    loading_chunks: int = 0
    touched_device_hits: bool = False
    # (first token, number of tokens, cache generation) of a load planned by
    # get_num_new_matched_tokens
    planned_load: tuple[int, int, int] | None = None
    # (hits, misses) of the chunk lookups behind the last offer: counted in `lookup_hits` /
    # `lookup_misses` only when the engine allocates for that offer, so a request looked up
    # again every step while it waits for device blocks counts once.
    looked_up: tuple[int, int] | None = None
    jobs: set[int] = field(default_factory=set)
    # Sent jobs whose device blocks the engine took back (a preemption) and may have given to
    # other requests: a failed load among them reports no blocks in `failed_load_blocks`.
    released_jobs: set[int] = field(default_factory=set)
    finished: bool = False
    load_failed: bool = False  # its last load failed: reported in `failed_loads`
    # A load of it failed and no preemption came since: it is offered no hits. The engine
    # recomputes those tokens and may ask again at once; an offer then could fail the same
    # way, step after step. A preemption ends this: kvtier never causes one (recomputing
    # needs no more device blocks), so a chunk that always fails costs at most one failed
    # load per preemption, never a loop.
    offers_stopped: bool = False


@dataclass(slots=True, frozen=True)
class StepProgress:
    """One scheduled request in a step: its device blocks (per KV-cache group) and how many of
    its tokens will have KV once the step's forward pass has run."""

    req_id: str
    block_ids: Sequence[Sequence[int]]
    num_computed_tokens: int


def _token_count(req_id: str, name: str, value: object) -> int:
    """A token count from the engine, or a ValueError naming the request and the value."""
    try:
        return checked_int(name, value, 0)
    except ValueError as e:
        raise ValueError(f"request {req_id!r}: {e}") from None


def _device_blocks(req_id: str, group: int, ids: Sequence[int]) -> npt.NDArray[np.int64]:
    """The device block ids a job uses, as int64, or a ValueError naming the request, the
    group and the bad id: a float was truncated to another block (whose KV a store then
    announced as this chunk's), and a negative id reached the worker, which failed the job."""
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.zeros(0, np.int64)
    bad: object = None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        if arr.ndim == 1 and arr.dtype.kind == "b":
            bad = ids[0]
        elif arr.ndim == 1:
            bad = next((x for x in ids if isinstance(x, bool) or not _is_index(x)), ids)
        else:
            bad = ids
    elif arr.min() < 0:
        bad = ids[int(np.argmin(arr))]
    if bad is not None:
        raise ValueError(
            f"request {req_id!r}: group {group} has device block id {bad!r}; expected integers >= 0"
        )
    return arr.astype(np.int64)  # a copy: the engine may reuse its block table


def _block_table(req_id: str, block_ids: Sequence[Sequence[int]], num_groups: int) -> list[int]:
    """The length of each group's device block ids in `block_ids`, or a ValueError naming the
    request and the table: a flat list of one group's ids, or None, raised a bare TypeError
    ("object of type 'int' has no len()") that named neither."""
    try:
        lengths = [len(ids) for ids in block_ids]
    except TypeError:
        lengths = None
    if lengths is None or isinstance(block_ids, (str, bytes)):
        raise ValueError(
            f"request {req_id!r}: block_ids={reprlib.repr(block_ids)} is invalid; expected one "
            f"sequence of device block ids per KV-cache group ({num_groups})"
        )
    if len(lengths) != num_groups:
        raise ValueError(
            f"request {req_id!r}: got block ids for {len(lengths)} groups; expected {num_groups}"
        )
    return lengths


def _is_index(x: object) -> bool:
    return hasattr(type(x), "__index__")


def _group_ids(groups: object) -> tuple[int, ...]:
    """`groups` as a tuple of distinct KV-cache group ids, or a ValueError naming it."""
    why = "expected a non-empty sequence of distinct KV-cache group ids"
    if isinstance(groups, (Sequence, np.ndarray)) and not isinstance(groups, (str, bytes)):
        ids: list[int] = []
        try:
            for g in groups:
                _make_key(b"", g)  # refuses what an offload key cannot hold, naming its range
                ids.append(operator.index(g))
        except (TypeError, ValueError) as e:
            why += f" ({e})"
        else:
            if ids and len(set(ids)) == len(ids):
                return tuple(ids)
    raise ValueError(f"groups={groups!r} is invalid; {why}")


def _check_result(r: TransferResult) -> None:
    """Refuses a report whose fields would be misread. A dataclass checks no types: a worker
    (or a deserializer) that gave `success="False"` had a failed load served as good data, as
    the string is true; negative or NaN figures corrupted the byte and time totals."""
    if not isinstance(r.success, (bool, np.bool_)):
        raise ValueError(
            f"worker result for job {r.job_id!r} has success={r.success!r}; expected a bool"
        )
    b, t = r.bytes, r.seconds
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 0:
        raise ValueError(
            f"worker result for job {r.job_id!r} has bytes={b!r}; expected an int >= 0"
        )
    if (
        isinstance(t, bool)
        or not isinstance(t, (int, float, np.integer, np.floating))
        or not (0 <= t < math.inf)
    ):
        raise ValueError(
            f"worker result for job {r.job_id!r} has seconds={t!r}; expected a finite number >= 0"
        )


@contextmanager
def _policy_errors() -> Iterator[list[Exception]]:
    """A list for the errors a cache policy raises as requests end during a batch of
    completions: the first is raised once the batch is applied, the others are logged (all of
    them, should the batch itself raise)."""
    errors: list[Exception] = []
    try:
        yield errors
    except BaseException:
        for e in errors:
            logger.error("kvtier: the cache policy failed to end a request", exc_info=e)
        raise
    for e in errors[1:]:
        logger.error("kvtier: the cache policy failed to end a request", exc_info=e)
    if errors:
        raise errors[0]


class OffloadingScheduler:
    """Plans transfers between an engine's device blocks and one offloading manager.

    `tokens_per_block` is the engine's block size; a chunk is `blocks_per_chunk` blocks.
    `groups` are the KV-cache groups offloaded (a chunk hits only if every group hits).
    `num_workers` workers must report a job before it completes.
    `proof_chunks` serves EAGLE/MTP drafter groups, whose KV at a position depends on the
    tokens after it: a chunk is loaded only if the next `proof_chunks` chunks of the request
    hit too (so those tokens match the request that stored it), and a decoding request's last
    `proof_chunks` computed chunks are not stored (a rejected draft may still rewrite them).
    A hit stops short of a prompt's last token, which the engine must compute for its logits;
    `full_prompt_hits` says the engine takes a hit of every prompt token and recomputes the
    last one itself (vLLM after an asynchronous load), so a prompt that fills its last chunk
    loads that chunk too.
    """

    def __init__(
        self,
        manager: OffloadingManager,
        *,
        tokens_per_block: int,
        blocks_per_chunk: int = 1,
        groups: Sequence[int] = (0,),
        num_workers: int = 1,
        offload_prompt_only: bool = False,
        proof_chunks: int = 0,
        full_prompt_hits: bool = False,
    ) -> None:
        for name, value, least in (
            ("tokens_per_block", tokens_per_block, 1),
            ("blocks_per_chunk", blocks_per_chunk, 1),
            ("num_workers", num_workers, 1),
            ("proof_chunks", proof_chunks, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                expected = "a positive integer" if least else "an integer >= 0"
                raise ValueError(f"{name}={value!r} is invalid; expected {expected}")
        # Checked here, not at the first lookup, where a bad id would raise mid-request.
        group_ids = _group_ids(groups)
        for flag, flag_value in (
            ("offload_prompt_only", offload_prompt_only),
            ("full_prompt_hits", full_prompt_hits),
        ):
            if not isinstance(flag_value, (bool, np.bool_)):
                raise ValueError(f"{flag}={flag_value!r} is invalid; expected a bool")
        self.manager = manager
        self.tokens_per_block = tokens_per_block
        self.blocks_per_chunk = blocks_per_chunk
        self.tokens_per_chunk = tokens_per_block * blocks_per_chunk
        self.groups = group_ids
        self.num_workers = num_workers
        self.offload_prompt_only = bool(offload_prompt_only)
        self.proof_chunks = proof_chunks
        # Prompt tokens a hit leaves for the engine to compute.
        self._unhit_tail = 0 if full_prompt_hits else 1
        self._requests: dict[str, _Request] = {}
        self._jobs: dict[int, _Job] = {}
        self._next_job_id = 0
        self._generation = 0
        self._jobs_before_reset = 0
        self._unsent: list[TransferJob] = []
        self.bytes_loaded = 0
        """Bytes moved by successful load jobs, summed over workers."""
        self.bytes_stored = 0
        """Bytes moved by successful store jobs, summed over workers."""
        self.load_seconds = 0.0
        """Copy time of successful load jobs as the workers report it, summed over workers."""
        self.store_seconds = 0.0
        """Copy time of successful store jobs as the workers report it, summed over workers."""
        self.load_jobs_failed = 0
        """Load jobs that failed on any worker, and loads (one per group) gone before they
        could be planned."""
        self.store_jobs_failed = 0
        """Store jobs that failed on any worker."""
        self.lookup_hits = 0
        """Chunk lookups (one per chunk and group) that hit, counted each time the engine
        schedules a request: those of the offer it allocated for, not of every time it asked."""
        self.lookup_misses = 0
        """Chunk lookups that missed, counted as `lookup_hits` are: at most one each time a
        request is scheduled, as its lookups stop at the first miss."""
        self._wait_for: list[int] = []
        # Device block -> store jobs in flight that read it, of requests finished with their
        # blocks released: the engine may give the block to another request, whose step must
        # first wait for them (`blocks_allocated`).
        self._fences: dict[int, set[int]] = {}
        # Job id -> its request, for requests finished that way: no longer tracked by id, so
        # that the engine may reuse the id while their stores run.
        self._released: dict[int, _Request] = {}
        self._finished = FinishedRequests()
        # Device blocks of failed loads (at allocation, or reported failed), per request, until
        # `take_finished` reports them: a preemption, or a finish that holds nothing, before
        # then gives the blocks back to the engine, which may give them to other requests.
        self._failed_blocks: dict[str, list[int]] = {}

    # -- request lifecycle ------------------------------------------------------------------

    def add_request(
        self,
        req_id: str,
        block_hashes: Sequence[bytes],
        num_prompt_tokens: int,
        kv_transfer_params: Mapping[str, Any] | None = None,
    ) -> None:
        """Start tracking a request. `block_hashes` (one per full device block) may be a list
        the engine keeps extending as tokens are generated; it is read, never copied."""
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} is already tracked")
        finished = self._finished
        if req_id in finished.sending:
            # The engine would read that report as the new request's, and free its blocks.
            raise ValueError(
                f"request {req_id!r} finished and its blocks are still to be released "
                "(take_finished().sending); expected a new request id, or take_finished() first"
            )
        # Read only at the first lookup, where a bad value would fail after side effects.
        prompt = _token_count(req_id, "num_prompt_tokens", num_prompt_tokens)
        if not isinstance(block_hashes, Sequence) or isinstance(
            block_hashes, (str, bytes, bytearray)
        ):
            # Kept and read lazily: None raised a bare TypeError ("object of type 'NoneType'
            # has no len()") at the first lookup, and a bytes hash was read as one block per
            # byte.
            raise ValueError(
                f"request {req_id!r}: block_hashes={reprlib.repr(block_hashes)} is invalid; "
                "expected a sequence of block hashes (bytes), one per full device block"
            )
        ctx = ReqContext(req_id, kv_transfer_params)
        # A finished request of this id that held nothing may still be due a report of a load
        # failed at allocation: it is about a request the engine has dropped, and would be
        # read as the new one's (received, and failed, before its own load was even sent).
        finished.recving.discard(req_id)
        finished.failed_loads.discard(req_id)
        self._requests[req_id] = _Request(ctx, block_hashes, prompt, [[] for _ in self.groups])
        self.manager.on_new_request(ctx)

    def extend_prompt(self, req_id: str, num_prompt_tokens: int) -> None:
        """A tracked request's prompt grew to `num_prompt_tokens` (vLLM's streaming input
        appends a turn's kept output and the next input chunk to the same request): lookups
        after a preemption, and stores with `offload_prompt_only`, reach the new length. A
        prompt never shrinks; a shorter one is a ValueError, with nothing changed."""
        req = self._get(req_id)
        prompt = _token_count(req_id, "num_prompt_tokens", num_prompt_tokens)
        if prompt < req.num_prompt_tokens:
            raise ValueError(
                f"request {req_id!r}: num_prompt_tokens={prompt} is shorter than the prompt "
                f"of {req.num_prompt_tokens} tokens already given; expected a prompt that grows"
            )
        req.num_prompt_tokens = prompt

    def request_finished(self, req_id: str, *, release: bool = False) -> bool:
        """The engine is done with a request. Returns True when its device blocks must be held
        until the request appears in `take_finished().sending` (transfers still use them).

        With `release`, a request whose jobs in flight are all stores gives its blocks back at
        once (returns False, and is never reported in `sending`): the engine may hand them to
        other requests, and must then tell `blocks_allocated`, which makes the next step wait
        for the stores that still read them (vLLM's own connector frees blocks this way). A
        load in flight (the request aborted mid-load) still holds its blocks.

        The reused prefix (device hits, loads that succeeded and a load still in flight; not
        a load that failed, was cancelled or was outlived by a preemption) is touched now; the
        manager hears of the end (`on_request_finished`) now if no job of the request is in
        flight, else when its last job completes. An error from the policy propagates, with
        the request ended all the same."""
        req = self._get(req_id)
        if req.finished:
            raise ValueError(f"request {req_id!r} already finished")
        req.finished = True
        # Commit the request's use of the prefix it reused at its end (tail before head, so the
        # head is the most recent). Chunks it only stored are not uses: a frequency-aware
        # policy such as ARC would otherwise count every new chunk as reused.
        try:
            try:
                try:
                    self._cancel_unsent(req)
                finally:
                    for g in range(len(self.groups)):
                        n = min(max(req.reused_chunks, req.loading_chunks), self._num_chunks(req))
                        used = self._chunk_keys(req, 0, n, g)
                        if used:
                            self.manager.touch(used, req.ctx)
            finally:
                # With jobs in flight the policy hears of the end when the last one completes
                # (`_complete`): their unpins and inserts carry this request's ctx, and a
                # policy that counts a key once per request would count them again.
                if not req.jobs:
                    self.manager.on_request_finished(req.ctx)
        finally:
            # Even when a cache policy raised above (a plugin's bug): a finished request with
            # no job left was otherwise tracked for good, as nothing else ends it.
            if not req.jobs:
                self._failed_blocks.pop(req_id, None)  # the engine frees its blocks now
                del self._requests[req_id]
        jobs = self._jobs
        if release and req.jobs and all(jobs[j].spec.kind is JobKind.STORE for j in req.jobs):
            # Every job left was sent (unsent ones were just cancelled) and only reads the
            # blocks: fence them instead of holding them.
            fences = self._fences
            for job_id in req.jobs:
                for block in jobs[job_id].spec.device_blocks.tolist():
                    fences.setdefault(block, set()).add(job_id)
                self._released[job_id] = req
            req.released_jobs.update(req.jobs)
            # The engine frees the blocks now: a failed load's, not yet taken, are not reported.
            self._failed_blocks.pop(req_id, None)
            # The release takes effect here, with no call after it (`_complete` holds a request
            # still tracked, should an interrupt stop this before).
            del self._requests[req_id]
            return False
        # With jobs, its blocks are held until `sending`, failed ones reported with it.
        return bool(req.jobs)

    def has_fences(self) -> bool:
        """Whether stores of released requests still read device blocks (`blocks_allocated`
        has work to do)."""
        return bool(self._fences)

    def blocks_allocated(self, block_ids: Iterable[int]) -> None:
        """The engine gave these device blocks (any group) to requests in the step being
        planned: stores of released requests that still read one are put in the step's
        `wait_for`, so the worker waits for them before anything writes the block."""
        fences = self._fences
        if not fences:
            return
        waits: set[int] = set()
        for block in block_ids:
            jobs = fences.get(block)
            if jobs:
                waits.update(jobs)
        if waits:
            known = set(self._wait_for)
            self._wait_for.extend(sorted(waits - known))

    def request_preempted(self, req_id: str) -> None:
        """The engine freed a request's device blocks to run others: jobs that still use them
        are waited for before the next step, the request's plans are dropped, and once it runs
        again its computed chunks are offered for storing from the first. Should a load
        among the jobs waited for fail, its blocks are not in `failed_load_blocks` (other
        requests may hold them by now), nor are those of a load that failed (reported, or at
        allocation) and is not yet taken (`take_finished`); the request is still reported in
        `recving` and `failed_loads`. A finished request is refused (`ValueError`)."""
        req = self._get(req_id)
        if req.finished:
            # Its blocks are held until `sending`; a preemption would drop the report of its
            # failed load's blocks, which the engine still holds.
            raise ValueError(f"request {req_id!r} already finished; it cannot be preempted")
        try:
            self._cancel_unsent(req)
        finally:
            # Even when a cache policy raised there: the preemption is the engine's fact.
            # Every job left was sent; no new one starts for the request until they end.
            req.released_jobs.update(req.jobs)
            self._failed_blocks.pop(req_id, None)
            # Readmitted, it is offered hits again, even after a failed load; one that fails
            # after this (among the jobs waited for) stops the offers until the next preemption.
            req.offers_stopped = False
            req.loading_chunks = 0  # the engine lost the blocks a load in flight writes
            self._wait_for.extend(sorted(req.jobs))
            req.planned_load = None
            # Readmitted, it offers every chunk again (as vLLM's connector does): one turned
            # away for room or by admission, or evicted since, gets another chance; held ones
            # are skipped by the manager. A load on readmission moves the start past what it
            # loads.
            req.next_store_chunk = 0
            req.no_room_at = -1

    # -- loads --------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, req_id: str, num_computed_tokens: int, *, read: bool = True
    ) -> int | None:
        """Tokens beyond `num_computed_tokens` (the device's own prefix hit) that can be loaded.

        `None` means "ask again next step": a chunk is still being written or located, or the
        request's own earlier transfers are still in flight. `read=False` is for a request
        that must compute its whole prompt (prompt logprobs): 0 once its transfers are done,
        and nothing is looked up, so the tier counts no hits it did not serve. After a failed
        load it is 0 until the request is preempted; after any load, until `take_finished` has
        reported it.
        """
        req = self._get(req_id)
        # A negative count would index chunks from the end of the request.
        num_computed_tokens = _token_count(req_id, "num_computed_tokens", num_computed_tokens)
        req.planned_load = req.looked_up = None
        if req.jobs:
            return None
        if req.offers_stopped or not read:
            return 0
        if req_id in self._finished.recving:
            # An earlier load's report (failed or not) is not yet taken (`take_finished`): the
            # engine would read it as the report of a load planned now, and use that load's
            # blocks while it still writes. No offer, rather than "ask again", so an engine
            # that takes reports only after its lookups never waits on itself.
            return 0
        tpc = self.tokens_per_chunk
        first_chunk = num_computed_tokens // tpc
        req.reused_chunks = max(req.reused_chunks, min(first_chunk, self._num_chunks(req)))
        if not req.touched_device_hits and first_chunk > 0:
            # The device prefix hit is a use of those chunks too: keep the policy informed, in
            # every group (a chunk hits only if every group still holds it).
            req.touched_device_hits = True
            hit_chunks = min(first_chunk, self._num_chunks(req))
            for g in range(len(self.groups)):
                self.manager.touch(self._chunk_keys(req, 0, hit_chunks, g), req.ctx)
        # At least one prompt token must be computed by the engine to produce logits: here, or
        # (`full_prompt_hits`) by the engine's own recompute of a full hit's last token.
        last_chunk = min(self._num_chunks(req), (req.num_prompt_tokens - self._unhit_tail) // tpc)
        end_chunk = first_chunk
        lookup = self.manager.lookup
        proof = self.proof_chunks
        # Proof chunks are looked up only for a chunk that could be loaded: with none, a
        # pending proof chunk would answer "ask again" for a load of nothing.
        stop = min(last_chunk + proof, self._num_chunks(req)) if first_chunk < last_chunk else 0
        hits = misses = 0
        for c in range(first_chunk, stop):
            for g in range(len(self.groups)):
                result = lookup(self._key(req, g, c), req.ctx)
                if result is LookupResult.HIT:
                    hits += 1
                    continue
                if result is LookupResult.MISS:
                    misses = 1
                    break
                return None  # HIT_PENDING or RETRY
            else:
                end_chunk = c + 1
                continue
            break
        req.looked_up = (hits, misses)
        if proof:
            end_chunk = max(first_chunk, min(end_chunk - proof, last_chunk))
        num_tokens = end_chunk * tpc - num_computed_tokens
        if num_tokens <= 0:
            return 0
        req.planned_load = (num_computed_tokens, num_tokens, self._generation)
        return num_tokens

    def update_state_after_alloc(
        self, req_id: str, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """The engine allocated device blocks (per group); plan the load of the matched tokens.

        If `reset_cache` ran since the tokens were offered, or another request's stores evicted
        an offered chunk since, they are gone: the load is reported failed at once
        (`take_finished`), and the engine recomputes those tokens. A request that finished, or
        had stores planned, since the offer is refused (`ValueError`)."""
        req = self._get(req_id)
        if num_external_tokens == 0:
            req.planned_load = None
            self._count_lookups(req)
            return
        if req.finished or req.jobs:
            # The offer is stale: stores planned since (or a finish) would put a load beside
            # them, into blocks the engine holds only until `sending`.
            why = "finished" if req.finished else "has transfers in flight"
            raise ValueError(
                f"request {req_id!r} {why}; expected one update_state_after_alloc per offer, "
                "after the get_num_new_matched_tokens that made it and before any step lists "
                "the request"
            )
        if req.planned_load is None or req.planned_load[1] != num_external_tokens:
            raise ValueError(
                f"request {req_id!r}: num_external_tokens={num_external_tokens} does not match "
                f"the {req.planned_load[1] if req.planned_load else 0} tokens offered"
            )
        lengths = _block_table(req_id, block_ids, len(self.groups))
        start, count, generation = req.planned_load
        tpb, bpc = self.tokens_per_block, self.blocks_per_chunk
        first_block, end_block = start // tpb, (start + count) // tpb
        first_chunk, end_chunk = first_block // bpc, -(-end_block // bpc)
        devices: list[npt.NDArray[np.int64]] = []
        for g, group in enumerate(self.groups):
            if lengths[g] < end_block:
                raise ValueError(
                    f"request {req_id!r}: group {group} has {lengths[g]} device blocks; "
                    f"the load needs {end_block}"
                )
            devices.append(_device_blocks(req_id, group, block_ids[g][first_block:end_block]))
        req.planned_load = None  # only now: a call refused above leaves the offer standing
        self._count_lookups(req)
        req.load_failed = False  # a new load: an earlier one's failure is reported already
        keys = [self._chunk_keys(req, first_chunk, end_chunk, g) for g in range(len(self.groups))]
        slots: list[npt.NDArray[np.int64]] = []
        if generation == self._generation:
            try:
                for g_keys in keys:
                    slots.append(_block_ids(self.manager.prepare_load(g_keys, req.ctx)))
            except ValueError as e:
                # The offer was only a lookup, not a pin: another request's stores may have
                # evicted an offered chunk since. Unpin the groups pinned so far and fail the
                # load, as after a reset, rather than raise with half of it pinned.
                logger.warning("kvtier: load of request %s is gone since offered: %s", req_id, e)
                for g_keys in keys[: len(slots)]:
                    self.manager.complete_load(g_keys, req.ctx)
                slots = []
        if not slots:
            self.load_jobs_failed += len(self.groups)
            req.load_failed = req.offers_stopped = True
            self._finished.recving.add(req_id)
            self._finished.failed_loads.add(req_id)
            self._failed_blocks[req_id] = [b for d in devices for b in d.tolist()]
            return
        for g, group in enumerate(self.groups):
            job = TransferJob(
                job_id=self._new_job_id(),
                kind=JobKind.LOAD,
                req_id=req_id,
                group=group,
                slots=slots[g],
                device_blocks=devices[g],
                skip_blocks=first_block - first_chunk * bpc,
            )
            self._track(req, job, keys[g])
        req.next_store_chunk = max(req.next_store_chunk, end_chunk)
        # Not reused yet: a load that fails, is cancelled, or is outlived by a preemption
        # serves nothing, and by the request's end its chunks may be the request's own stores.
        req.loading_chunks = end_chunk

    # -- stores and steps ---------------------------------------------------------------------

    def build_step_metadata(self, progress: Iterable[StepProgress] = ()) -> StepMetadata:
        """Plan stores for newly completed chunks of the scheduled requests and hand the
        worker everything due this step."""
        tpc = self.tokens_per_chunk
        due: dict[str, tuple[_Request, list[npt.NDArray[np.int64]], int]] = {}
        room = -1  # read once a step, and only if a request is waiting for room
        for p in progress:
            if not isinstance(p, StepProgress):
                # A tuple (or a dict's key) raised a bare AttributeError that named neither.
                raise ValueError(
                    f"progress entry {reprlib.repr(p)} is a {type(p).__name__}; expected a "
                    "StepProgress(req_id, block_ids, num_computed_tokens)"
                )
            # Checked before anything is planned: a bad count (a float would raise mid-plan)
            # must leave no slot reserved for the entries before it.
            computed = _token_count(p.req_id, "num_computed_tokens", p.num_computed_tokens)
            req = self._requests.get(p.req_id)
            if req is None or req.finished or p.req_id in due:
                continue
            if req.jobs and not self._only_stores(req):
                # A load in flight writes the request's blocks; a preempted request's jobs
                # still in flight may read blocks the engine gave away.
                continue
            if self.offload_prompt_only:
                computed = min(computed, req.num_prompt_tokens)
            end_chunk = computed // tpc
            if self.proof_chunks and computed > req.num_prompt_tokens:
                end_chunk -= self.proof_chunks  # a decoding drafter's tail is not final yet
            end_chunk = min(end_chunk, self._num_chunks(req))
            if end_chunk > req.next_store_chunk:
                if req.no_room_at >= 0:
                    # Its offer only grows: until a transfer frees room it cannot fit, and
                    # planning it again would cost its whole range every step.
                    if room < 0:
                        room = _room(self.manager.get_stats())
                    if room <= req.no_room_at:
                        continue
                # Every block table is checked before any store is planned: a bad entry
                # raises with no slot reserved for the entries before it either.
                blocks = self._check_block_table(req, p.block_ids, end_chunk)
                due[p.req_id] = (req, blocks, end_chunk)
        for req, blocks, end_chunk in due.values():
            if self._plan_stores(req, blocks, req.next_store_chunk, end_chunk):
                req.next_store_chunk = end_chunk
        for job in self._unsent:
            self._jobs[job.job_id].sent = True
        meta = StepMetadata(
            loads=[j for j in self._unsent if j.kind is JobKind.LOAD],
            stores=[j for j in self._unsent if j.kind is JobKind.STORE],
            wait_for=self._wait_for,
        )
        self._unsent = []
        self._wait_for = []
        return meta

    def _check_block_table(
        self, req: _Request, block_ids: Sequence[Sequence[int]], end: int
    ) -> list[npt.NDArray[np.int64]]:
        """Per group, the device blocks of the chunks from `req.next_store_chunk` to `end`."""
        bpc = self.blocks_per_chunk
        # Checked before any slot is reserved: a pending write never completed would answer
        # HIT_PENDING ("ask again") to every later request with this prefix, forever.
        lengths = _block_table(req.ctx.req_id, block_ids, len(self.groups))
        for g, group in enumerate(self.groups):
            if lengths[g] < end * bpc:
                raise ValueError(
                    f"request {req.ctx.req_id!r}: group {group} has {lengths[g]} device "
                    f"blocks; storing its first {end} chunks needs {end * bpc}"
                )
        first = req.next_store_chunk * bpc
        return [
            _device_blocks(req.ctx.req_id, group, block_ids[g][first : end * bpc])
            for g, group in enumerate(self.groups)
        ]

    def _plan_stores(
        self, req: _Request, blocks: list[npt.NDArray[np.int64]], start: int, end: int
    ) -> bool:
        """Reserve and plan chunks `start` to `end`; `blocks[g]` holds group g's device blocks
        of those chunks, from chunk `start` on. False when the manager found no room: the
        chunks are offered again once the tier has more room (vLLM's connector offers them at
        its next step), since the slots that transfers in flight hold (pinned by loads,
        written by stores, or held since a reset until those then in flight end) free up as
        they complete; turned away for good, the request's prefix was never stored. An offer
        turned away while no slot was held in any of those ways can never fit and is not
        offered again."""
        bpc = self.blocks_per_chunk
        # Every group's keys in one call: a chunk hits only if every group holds it, and one
        # call makes room for all of them or for none. Called group by group, a later group
        # finding no room left the earlier ones' evictions done for chunks never stored.
        # Chunk by chunk, each chunk's groups together: an admission tracker that keeps only
        # an offer's first keys then keeps whole chunks, not all of one group's and none of
        # the next's (slots spent on chunks that could never load).
        per_group = [self._chunk_keys(req, start, end, g) for g in range(len(self.groups))]
        chunk_of: dict[OffloadKey, tuple[int, int]] = {}
        positions, tpc = req.ctx.key_positions, self.tokens_per_chunk
        if len(per_group) == 1:  # the common case, without the interleaving's cost
            for c, k in zip(range(start, end), per_group[0], strict=True):
                positions[k] = (c + 1) * tpc
                chunk_of[k] = (0, c)
        else:
            for i, c in enumerate(range(start, end)):
                for g, keys in enumerate(per_group):
                    k = keys[i]
                    positions[k] = (c + 1) * tpc
                    chunk_of[k] = (g, c)
        out = self.manager.prepare_store(list(chunk_of), req.ctx)
        if out is None:  # no room now (the manager counts them at each try)
            stats = self.manager.get_stats()
            room = _room(stats)
            if room >= stats.num_slots:
                return True
            req.no_room_at = room
            return False
        req.no_room_at = -1
        slots = _block_ids(out.store_spec)
        for g, group in enumerate(self.groups):
            if len(self.groups) == 1:
                g_keys, g_slots = out.keys_to_store, slots
            else:
                picked = [i for i, k in enumerate(out.keys_to_store) if chunk_of[k][0] == g]
                g_keys, g_slots = [out.keys_to_store[i] for i in picked], slots[picked]
            if not g_keys:
                continue
            chunks = np.fromiter((chunk_of[k][1] - start for k in g_keys), np.int64, len(g_keys))
            idx = (chunks[:, None] * bpc + np.arange(bpc)).reshape(-1)
            job = TransferJob(
                job_id=self._new_job_id(),
                kind=JobKind.STORE,
                req_id=req.ctx.req_id,
                group=group,
                slots=g_slots,
                device_blocks=blocks[g][idx],
            )
            self._track(req, job, g_keys)
        return True

    # -- completions --------------------------------------------------------------------------

    def on_worker_results(
        self, results: Iterable[TransferResult], worker: int | None = None
    ) -> None:
        """Record one worker's finished jobs; a job completes once every worker reported it.

        `worker` (0 to `num_workers` - 1) names the reporting worker, so that a worker
        reporting a job twice is refused instead of counting as another worker's report
        (without it only more reports than workers can be told apart). A report of a job not
        in flight (not yet sent in a `StepMetadata`, or already completed), or reported too
        often, raises before any report is applied.

        A job leaves the jobs in flight only once all its effects are applied: should an
        interrupt (or a manager call that raises) stop this part-way, `fail_unreported`
        finishes the jobs whose reports were all in and fails the reports not yet applied.
        The exception is the cache policy raising as it ends a request whose last job
        completed (`on_request_finished`, after every effect of that job): the whole batch is
        applied first, then the first such error is raised (the others logged); no recovery
        is needed."""
        self._check_worker(worker)
        results = list(results)
        seen: dict[int, int] = {}
        for r in results:
            if not isinstance(r, TransferResult):
                # A (job_id, success) tuple raised a bare AttributeError that named neither.
                raise ValueError(
                    f"worker result {reprlib.repr(r)} is a {type(r).__name__}; expected a "
                    "TransferResult(job_id, success, bytes, seconds)"
                )
            _check_result(r)
            job = self._jobs.get(r.job_id)
            if job is None or not job.sent:
                unsent = "" if job is None else " (no StepMetadata has sent it to a worker yet)"
                raise ValueError(f"worker reported job {r.job_id}, which is not in flight{unsent}")
            n = seen.get(r.job_id, 0) + 1
            if worker is not None and (n > 1 or worker in job.reporters):
                raise ValueError(f"job {r.job_id} was already reported by worker {worker}")
            if n > job.reports_left:
                raise ValueError(
                    f"job {r.job_id} reported {n} times; it waits for {job.reports_left} more"
                )
            seen[r.job_id] = n
        with _policy_errors() as errors:
            for r in results:
                job = self._jobs[r.job_id]
                # No call until the report is counted (`reporters.add` is the last step), so an
                # interrupt cannot land part-way through it.
                job.success = job.success and r.success
                if r.success:
                    job.bytes += r.bytes
                    job.seconds += r.seconds
                job.reports_left -= 1
                if worker is not None:
                    job.reporters.add(worker)
                if job.reports_left == 0:
                    self._complete(job, errors)

    def fail_unreported(self, worker: int | None = None) -> list[int]:
        """Count every report still missing from `worker` (every worker if None) as a failure,
        and return the ids of the jobs that completed.

        For reports that will never come: the worker died or was replaced, or its results were
        lost between its `get_finished` and `on_worker_results`, or inside the latter (an
        interrupt). Without this, such jobs hold their pins, host slots and request forever.
        Jobs whose reports were all in but whose completion was stopped part-way (an interrupt
        in `on_worker_results`) are finished too, with their reported outcome. Call it only
        once no copy of those jobs can still run on that worker (its process is gone, or its
        transfer worker waited for them and its results were applied): a store's slots become
        reusable at once. Jobs not yet sent in a `StepMetadata` are left alone; a later report
        of a job failed here is refused as not in flight. With several workers, naming one needs the
        reports so far to have named theirs (`on_worker_results(..., worker=i)`). An error
        the cache policy raises as it ends a request waits for every owed job, as there."""
        self._check_worker(worker)
        owed: list[tuple[_Job, int]] = []
        for job in self._jobs.values():
            if not job.sent:
                continue
            if job.reports_left == 0:
                # Every report is in; an interrupt stopped its completion part-way.
                owed.append((job, 0))
                continue
            if worker is None:
                owed.append((job, job.reports_left))
                continue
            anonymous = self.num_workers - job.reports_left - len(job.reporters)
            if anonymous and self.num_workers > 1:
                raise ValueError(
                    f"job {job.spec.job_id} has reports that named no worker; cannot tell "
                    f"whether worker {worker} reported it (pass worker= to on_worker_results)"
                )
            if worker not in job.reporters and job.reports_left:
                owed.append((job, 1))
        done: list[int] = []
        with _policy_errors() as errors:
            for job, n in owed:
                if n:
                    job.success = False
                    job.reports_left -= n
                    if worker is not None:
                        job.reporters.add(worker)
                if job.reports_left == 0:
                    done.append(job.spec.job_id)
                    self._complete(job, errors)
        return done

    def take_finished(self) -> FinishedRequests:
        """Requests whose transfers ended since the last call."""
        finished, self._finished = self._finished, FinishedRequests()
        failed_blocks, self._failed_blocks = self._failed_blocks, {}
        for blocks in failed_blocks.values():
            finished.failed_load_blocks.update(blocks)
        return finished

    def reset_cache(self) -> None:
        """Empty the tier. Jobs in flight complete later without touching the new contents;
        their slots are reused only after the last of them is done."""
        self._generation += 1
        # A job the manager already completed (an interrupt stopped the rest of its
        # completion) uses no slot any more.
        self._jobs_before_reset = sum(not job.applied for job in self._jobs.values())
        try:
            self.manager.reset_cache()
        finally:
            # Even when a cache policy raised there: the manager forgets its chunks all the
            # same, and requests that kept their store offsets never stored them again.
            for req in self._requests.values():
                req.next_store_chunk = 0
                req.no_room_at = -1
        if self._jobs_before_reset == 0:
            self.manager.on_reset_flushed()

    def _complete(self, job: _Job, errors: list[Exception]) -> None:
        """Apply a job whose reports are all in, then drop it from the jobs in flight.

        Resumable: an interrupt part-way (or a manager call that raises, which changes nothing)
        leaves the job in flight, and calling this again applies only what is left. The last
        job of a finished request ends it in the manager's policy once the job is dropped; an
        error from that call goes to `errors`, for the caller to raise once its batch is
        applied."""
        spec = job.spec
        if not job.applied:
            old = job.generation != self._generation
            if not old:
                # An interrupt just as the manager call returned, before `applied` is set,
                # makes it run again: the manager then refuses the keys (no longer pinned or
                # pending), which on a second attempt means the first one was applied.
                again, job.attempted = job.attempted, True
                try:
                    if spec.kind is JobKind.LOAD:
                        self.manager.complete_load(job.keys, self._job_ctx(spec))
                    else:
                        self.manager.complete_store(job.keys, self._job_ctx(spec), job.success)
                except ValueError as e:
                    if not again:
                        raise
                    logger.warning(
                        "kvtier: %s job %d of request %s taken as applied: %s",
                        spec.kind.value,
                        spec.job_id,
                        spec.req_id,
                        e,
                    )
            elif self._jobs_before_reset == 1:
                self.manager.on_reset_flushed()  # before the count: a raise leaves it due
            # No call from here to the counters' end, so no interrupt lands part-way.
            job.applied = True
            if old:
                self._jobs_before_reset -= 1
            # Counted once the job is done: a job that failed on one worker is not a
            # successful job, whatever the other workers moved.
            if not job.success:
                if spec.kind is JobKind.LOAD:
                    self.load_jobs_failed += 1
                else:
                    self.store_jobs_failed += 1
            elif spec.kind is JobKind.LOAD:
                self.bytes_loaded += job.bytes
                self.load_seconds += job.seconds
            else:
                self.bytes_stored += job.bytes
                self.store_seconds += job.seconds
            if not job.success:
                logger.warning(
                    "kvtier: %s job %d of request %s failed",
                    spec.kind.value,
                    spec.job_id,
                    spec.req_id,
                )
        released = self._released.get(spec.job_id)
        tracked = self._requests.get(spec.req_id)
        if released is not None and released is tracked:
            # An interrupt stopped `request_finished` before the release took effect (the
            # request is still in `_requests`): the engine was told nothing, so the request
            # is held and reported in `sending`, as when a policy error stops it there.
            released = None
        req = released if released is not None else tracked
        ended: ReqContext | None = None
        extended = self._extended_prefix(job, req)
        extended_ctx = req.ctx if req is not None else None
        if req is not None:
            # The job leaves `req.jobs` last: until then the request has a job in flight, so
            # no new job of it starts before this one's effects are all applied. Every step
            # below may run twice (after an interrupt): sets only grow.
            last = req.jobs <= {spec.job_id}
            if spec.kind is JobKind.LOAD:
                if not job.success:
                    req.load_failed = req.offers_stopped = True
                    # A preempted request's blocks may hold other requests' KV by now; it
                    # recomputes its own tokens anyway, having lost them at the preemption.
                    # Kept per request until `take_finished`, as a failure at allocation is:
                    # a preemption or finish before then gives the blocks back. (A rerun after
                    # an interrupt may list them twice; `take_finished` makes a set.)
                    if spec.job_id not in req.released_jobs:
                        self._failed_blocks.setdefault(spec.req_id, []).extend(
                            spec.device_blocks.tolist()
                        )
                # A load is one job per KV-cache group: the request is received only when the
                # last of them ended, or the engine would read blocks another group still
                # writes. While a load is in flight the request has no other jobs.
                if last:
                    self._finished.recving.add(spec.req_id)
                    if req.load_failed:
                        self._finished.failed_loads.add(spec.req_id)
                    else:
                        req.reused_chunks = max(req.reused_chunks, req.loading_chunks)
                    req.loading_chunks = 0
            if last and req.finished:
                if released is None:
                    self._finished.sending.add(spec.req_id)
                    del self._requests[spec.req_id]
                ended = req.ctx
            else:
                req.jobs.discard(spec.job_id)
                req.released_jobs.discard(spec.job_id)  # after: a rerun must still see it
        if self._fences:
            self._unfence(spec)
        del self._jobs[spec.job_id]
        self._released.pop(spec.job_id, None)
        try:
            if extended is not None and extended_ctx is not None:
                # A hint for the policy's order only: after the job's effects, and lost (not
                # repeated) if an interrupt lands here.
                try:
                    self.manager.prefix_extended(extended, extended_ctx)
                except Exception as e:
                    errors.append(e)
        finally:
            self._end_in_policy(ended, errors)

    def _end_in_policy(self, ended: ReqContext | None, errors: list[Exception]) -> None:
        if ended is not None:
            # Last, with the scheduler's state complete: a rerun after an interrupt here finds
            # neither job nor request, so the policy hears of the end at most once. A policy
            # error waits for the rest of the batch, which a raise here would leave unapplied
            # and `fail_unreported` would then fail, though every transfer succeeded.
            try:
                self.manager.on_request_finished(ended)
            except Exception as e:
                errors.append(e)

    # -- helpers ------------------------------------------------------------------------------

    def _extended_prefix(self, job: _Job, req: _Request | None) -> list[OffloadKey] | None:
        """For a request's successful store (also one ending after the request did) that did
        not store all of the request's chunks up to its deepest: the request's chunk keys,
        every group's, from the first to that deepest, which the policy ranks above the new
        ones (`OffloadingManager.prefix_extended`). Stored over several steps, a prompt's later
        chunks would otherwise be newer than its head, and an LRU tier would evict the head
        first, leaving the tail unreachable. With several groups always: one job per group
        stacks a group's chunks above another's."""
        spec = job.spec
        if (
            req is None
            or spec.kind is not JobKind.STORE
            or not job.success
            or not job.keys
            or job.generation != self._generation
        ):
            return None
        positions, tpc = req.ctx.key_positions, self.tokens_per_chunk
        first, last = positions.get(job.keys[0]), positions.get(job.keys[-1])
        if first is None or last is None:
            return None
        n = last // tpc
        if len(self.groups) == 1 and first <= tpc and len(job.keys) == n:
            return None  # chunks 0..n all stored by this call: head above tail already
        # Every group's keys, chunk by chunk: a chunk hits only if every group holds it, so
        # the groups' tails go before any group's head (one job per group stacked them).
        per_group = [self._chunk_keys(req, 0, n, g) for g in range(len(self.groups))]
        return [keys[c] for c in range(n) for keys in per_group]

    def _unfence(self, spec: TransferJob) -> None:
        """A job is done: the blocks it read need no wait any more (idempotent, for reruns)."""
        fences = self._fences
        for block in spec.device_blocks.tolist():
            jobs = fences.get(block)
            if jobs is not None:
                jobs.discard(spec.job_id)
                if not jobs:
                    del fences[block]

    def _check_worker(self, worker: int | None) -> None:
        if worker is not None and (
            isinstance(worker, bool)
            or not isinstance(worker, int)
            or not 0 <= worker < self.num_workers
        ):
            raise ValueError(
                f"worker={worker!r} is invalid; expected a worker index in [0, {self.num_workers})"
            )

    def _get(self, req_id: str) -> _Request:
        req = self._requests.get(req_id)
        if req is None:
            raise ValueError(f"request {req_id!r} is not tracked; call add_request first")
        return req

    def _job_ctx(self, spec: TransferJob) -> ReqContext:
        """The context of a job's request: a released request's, though the engine may have
        given its id to a new request since."""
        req = self._released.get(spec.job_id)
        if req is None:
            req = self._requests.get(spec.req_id)
        return req.ctx if req is not None else ReqContext(spec.req_id)

    def _num_chunks(self, req: _Request) -> int:
        return len(req.block_hashes) // self.blocks_per_chunk

    def _key(self, req: _Request, g: int, chunk: int) -> OffloadKey:
        keys = req.keys[g]
        if chunk >= len(keys):
            bpc, group = self.blocks_per_chunk, self.groups[g]
            hashes = req.block_hashes
            keys.extend(
                _make_key(hashes[(c + 1) * bpc - 1], group) for c in range(len(keys), chunk + 1)
            )
        return keys[chunk]

    def _chunk_keys(self, req: _Request, start: int, end: int, g: int = 0) -> list[OffloadKey]:
        if end > start:
            self._key(req, g, end - 1)
        return req.keys[g][start:end]

    def _only_stores(self, req: _Request) -> bool:
        """Whether every job of `req` in flight is a store of its current run (not one left
        from before a preemption): new chunks may then be stored beside them."""
        if req.released_jobs:
            return False
        jobs = self._jobs
        return all(jobs[j].spec.kind is JobKind.STORE for j in req.jobs)

    def _new_job_id(self) -> int:
        self._next_job_id += 1
        return self._next_job_id

    def _count_lookups(self, req: _Request) -> None:
        if req.looked_up is not None:
            self.lookup_hits += req.looked_up[0]
            self.lookup_misses += req.looked_up[1]
            req.looked_up = None

    def _track(self, req: _Request, job: TransferJob, keys: list[OffloadKey]) -> None:
        self._jobs[job.job_id] = _Job(job, list(keys), self._generation, self.num_workers)
        req.jobs.add(job.job_id)
        self._unsent.append(job)

    def _cancel_unsent(self, req: _Request) -> None:
        """Drop jobs of `req` that no worker has seen yet: they free their pins and slots now.

        Each job leaves the scheduler before its manager call: a call that raises (a cache
        policy's bug) left the job in `_unsent` but not in flight, and the next step's
        metadata raised KeyError. The first such error is raised once every job is dropped
        (that call's pins stay taken: those chunks are never evicted)."""
        req_id = req.ctx.req_id
        mine = [job for job in self._unsent if job.req_id == req_id]
        if not mine:
            return
        self._unsent = [job for job in self._unsent if job.req_id != req_id]
        if any(job.kind is JobKind.LOAD for job in mine):
            req.loading_chunks = 0  # a cancelled load serves nothing (its jobs are all unsent)
        error: Exception | None = None
        for job in mine:
            record = self._jobs.pop(job.job_id)
            req.jobs.discard(job.job_id)
            try:
                if record.generation != self._generation:
                    self._jobs_before_reset -= 1
                    if self._jobs_before_reset == 0:
                        self.manager.on_reset_flushed()
                elif job.kind is JobKind.LOAD:
                    self.manager.complete_load(record.keys, req.ctx)
                else:
                    self.manager.complete_store(record.keys, req.ctx, success=False)
            except Exception as e:
                if error is not None:
                    logger.error("kvtier: cancelling job %d failed", job.job_id, exc_info=e)
                else:
                    error = e
        if error is not None:
            raise error

    # -- introspection ------------------------------------------------------------------------

    def store_chunks(self, job_id: int) -> list[tuple[OffloadKey, int]]:
        """(key, chunk index in its request) of each chunk a store job in flight writes, for
        KV events that describe the chunk's blocks."""
        record = self._jobs.get(job_id)
        if record is None or record.spec.kind is not JobKind.STORE:
            raise ValueError(f"job {job_id!r} is not a store job in flight")
        positions, tpc = self._job_ctx(record.spec).key_positions, self.tokens_per_chunk
        return [(k, positions[k] // tpc - 1) for k in record.keys]

    def job_ids_in_flight(self) -> list[int]:
        """Ids of jobs created and not yet completed (sent or not)."""
        return list(self._jobs)

    def num_jobs_in_flight(self) -> int:
        """Jobs created and not yet completed (sent or not)."""
        return len(self._jobs)

    def num_requests(self) -> int:
        """Requests tracked (running, or finished with jobs in flight)."""
        return len(self._requests)
