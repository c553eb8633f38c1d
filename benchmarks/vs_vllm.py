"""kvtier side by side with vLLM 0.33's own offloading, in one run and one environment.

(a)/(b): the Mooncake conversation trace replayed through vLLM's `CPUOffloadingManager` and
kvtier's, with the same engine call sequence (benchmarks/manager_ops.py), policy and capacity.
(c)/(d): five windows of the trace (2,000 requests from offsets 0, 2000, ..., 8000), in 16-token
blocks (each hash id becomes 16 token ids), as requests through vLLM's real `Scheduler` with
(c) vLLM's `OffloadingConnector` and (d) kvtier's `KVTierConnector`, same capacity and
policy, workers stubbed to complete every job at once (`--job-delay N`: N steps after the step
that issued it, as an asynchronous copy engine would). The two take turns going first, window
by window, starting with the other one from seed to seed; each run's JSON says which went
first (`first`), and the summary gives the steps/s ratio for each order as well.

    python benchmarks/vs_vllm.py --json out/vs_vllm.json

`--kv-events off,on,self-describing` runs (c)/(d) with vLLM's KV events off, on, and on with
`self_describing_kv_events` for both connectors (vLLM's "null" publisher: the scheduler still
drains each connector's `take_events()` every step), the settings alternated child by child,
and compares each connector's steps/s against the first setting's.

`--kvtier-extra '{"release_finished_blocks": false}'` adds keys to kvtier's extra config in (d),
to compare kvtier's settings under the same stub workers.

`--max-batched-tokens 256` lowers vLLM's per-step token budget in (c)/(d) below the prompts'
lengths, so vLLM prefills them over several steps (chunked prefill) and each connector stores
a prompt step by step.

Each scheduler run is a child process with a fixed PYTHONHASHSEED (vLLM's figure depends on
it; see `compare_schedulers`), so the whole comparison is deterministic for given seeds.

Needs vLLM 0.33.0 installed next to kvtier (see docs/vllm.md for the CPU-only recipe).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _cli import (
    at_least,
    int_list,
    positive_int,
    progress,
    require_distinct,
    require_file,
    require_known,
    require_writable,
    run_main,
    write_results,
)
from kvtier.base import ReqContext
from kvtier.cpu import CPUOffloadingManager
from kvtier.policies import registered_policies
from manager_ops import MOONCAKE, Workload, mooncake_workload, replay


def compare_managers(
    workload: Workload,
    policies: Sequence[str],
    num_slots: int,
    repeats: int,
    log: Callable[[str], None] | None = None,
) -> dict[str, dict[str, float]]:
    """Calls/s and prefix hit ratio of both managers, alternating runs (and which of a pair
    runs first) so noise hits both."""
    from vllm.v1.kv_offload.base import LookupResult as VLookup
    from vllm.v1.kv_offload.base import ReqContext as VReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VManager

    from kvtier.base import LookupResult

    out: dict[str, dict[str, float]] = {}
    for policy in policies:
        v_rates, k_rates = [], []
        v_hit = k_hit = 0.0
        for i in range(1, repeats + 1):
            # Each goes first in every other pair: the second of a pair ran on a warmer (or,
            # after the first's garbage, a more fragmented) heap every time.
            for side in ("vllm", "kvtier") if i % 2 else ("kvtier", "vllm"):
                if side == "vllm":
                    vm = VManager(num_slots, cache_policy=policy, enable_events=True)
                    calls, _, secs, v_hit = replay(workload, vm, VReqContext, VLookup.HIT)
                    v_rates.append(calls / secs)
                else:
                    km = CPUOffloadingManager(num_slots, policy, enable_events=True)
                    calls, _, secs, k_hit = replay(workload, km, ReqContext, LookupResult.HIT)
                    k_rates.append(calls / secs)
            # A line per pair of replays: vLLM's LRU replays Mooncake in 5-10 s, so a line per
            # policy came 15-30 s apart.
            if log is not None and i < repeats:
                log(f"manager, {policy}: {i} of {repeats}")
        v, k = statistics.median(v_rates), statistics.median(k_rates)
        out[policy] = {
            "vllm_calls_per_s": v,
            "kvtier_calls_per_s": k,
            "speedup": k / v,
            "vllm_hit_ratio": v_hit,
            "kvtier_hit_ratio": k_hit,
        }
        if log is not None:
            log(f"manager, {policy}: done")
    return out


SCHED_BLOCK = 16
BATCH_TOKENS = 8192
"""vLLM's `max_num_batched_tokens` in (c)/(d) unless `--max-batched-tokens` says otherwise: the
default windows' prompts (at most 247 blocks of 16 tokens) are each prefilled in one step."""

KV_EVENTS = ("off", "on", "self-describing")
"""`--kv-events` settings: vLLM's KV events off; on; on with `self_describing_kv_events`."""


def _scheduler_engine(
    connector: str,
    extra: dict[str, Any],
    module: str | None,
    blocks: int,
    kv_events: bool = False,
    batch_tokens: int = BATCH_TOKENS,
) -> Any:
    """vLLM's Scheduler for a tiny local Llama config on CPU, with `connector` (and vLLM's KV
    events, published nowhere, if `kv_events`)."""
    # Read once, while the config is built: removed after, or every engine (two or three a
    # window and hash seed) left a folder behind in the temp folder.
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-llama-") as model_dir:
        return _build_scheduler(
            model_dir, connector, extra, module, blocks, kv_events, batch_tokens
        )


def _build_scheduler(
    model_dir: str,
    connector: str,
    extra: dict[str, Any],
    module: str | None,
    blocks: int,
    kv_events: bool = False,
    batch_tokens: int = BATCH_TOKENS,
) -> Any:
    """`_scheduler_engine`'s Scheduler, its model config written to `model_dir`."""
    import torch
    from transformers import LlamaConfig
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    LlamaConfig(
        vocab_size=1 << 20,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1 << 16,
    ).save_pretrained(model_dir)
    max_len = 1 << 15
    model = ModelConfig(
        model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=max_len
    )
    cache = CacheConfig(block_size=SCHED_BLOCK, enable_prefix_caching=True)
    cache.num_gpu_blocks = blocks
    sched = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=batch_tokens,
        max_model_len=max_len,
        is_encoder_decoder=False,
    )
    transfer = KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path=module,
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )
    cfg = VllmConfig(
        model_config=model,
        cache_config=cache,
        scheduler_config=sched,
        kv_transfer_config=transfer,
        # The "null" publisher drops each step's batch, but vLLM's scheduler still collects
        # it (its own prefix-cache events and the connector's `take_events()`) every step.
        kv_events_config=(
            KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None
        ),
        device_config=DeviceConfig("cpu"),
    )
    spec = FullAttentionSpec(
        block_size=SCHED_BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32
    )
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    kv = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=spec.page_size_bytes * blocks,
                layers=[n],
                layer_stride=0,
                block_stride=spec.page_size_bytes,
            )
            for n in names
        ],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    return Scheduler(
        vllm_config=cfg,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=SCHED_BLOCK,
        log_stats=True,
    )


def _vllm_chunks(scheduler: Any) -> int:
    return int(scheduler.connector.connector_scheduler.manager._num_chunks)


def _vllm_engine_with_chunks(
    policy: str,
    num_slots: int,
    slot_guess: int,
    align: int,
    device_blocks: int,
    events: str = "off",
    batch_tokens: int = BATCH_TOKENS,
) -> Any:
    """vLLM's engine with exactly `num_slots` host chunks: vLLM sizes its pool from bytes with
    its own per-chunk size, so the first guess is corrected from the count it reports."""

    def build(chunk_bytes: int) -> Any:
        extra = {"cpu_bytes_to_use": num_slots * chunk_bytes, "eviction_policy": policy}
        extra |= _events_extra(events)
        return _scheduler_engine(
            "OffloadingConnector", extra, None, device_blocks, events != "off", batch_tokens
        )

    engine = build(slot_guess)
    got = _vllm_chunks(engine)
    if got != num_slots:
        engine = build(num_slots * slot_guess // got // align * align)
        got = _vllm_chunks(engine)
    if got != num_slots:
        raise RuntimeError(f"vLLM sized its pool to {got} chunks; wanted {num_slots}")
    return engine


def _events_extra(events: str) -> dict[str, Any]:
    """The connector extra config of a `--kv-events` setting: the same key for both."""
    return {"self_describing_kv_events": True} if events == "self-describing" else {}


class _EventTally:
    """Counts what a scheduler's connector returns from `take_events()`, and the time vLLM's
    scheduler spends in that call (its translation of the host tier's events)."""

    def __init__(self, scheduler: Any) -> None:
        from vllm.distributed.kv_events import BlockStored

        self._stored_type = BlockStored
        self.stored = self.removed = self.described = 0
        self.seconds = 0.0
        connector = scheduler.connector
        self._take = connector.take_events
        connector.take_events = self._take_and_count

    def _take_and_count(self) -> list[Any]:
        start = time.perf_counter()
        # vLLM's connector returns a generator, which the scheduler lists at once anyway.
        events = list(self._take())
        self.seconds += time.perf_counter() - start
        for e in events:
            if isinstance(e, self._stored_type):
                self.stored += 1
                self.described += bool(e.token_ids)
            else:
                self.removed += 1
        return events

    def report(self, run_seconds: float) -> dict[str, float]:
        """Event counts and `take_events()`'s share of the run's time."""
        return {
            "stored": self.stored,
            "removed": self.removed,
            "stored_with_tokens": self.described,
            "take_events_share": self.seconds / run_seconds,
        }


class _StubWorkers:
    """Workers that move no bytes but report each job `delay` steps after the step that issued
    it, as an asynchronous copy engine would (0: in the step itself). A job the scheduler has
    the workers wait for (vLLM's `jobs_to_flush`, kvtier's `wait_for`: blocks about to be
    reused) and vLLM's synchronous loads end in their step, as the real workers wait for them.
    """

    def __init__(self, delay: int) -> None:
        self.delay = delay
        self.step = 0
        # job id -> (step due, request id, load that reports `finished_recving`)
        self._pending: dict[int, tuple[int, str, bool]] = {}
        self._in_flight: dict[str, int] = {}  # request id -> its jobs pending (kvtier)
        self._loads: dict[str, int] = {}  # request id -> its loads pending (kvtier)
        self._held: set[str] = set()  # kvtier: finished requests whose blocks vLLM holds
        self.jobs_done = 0
        # Jobs ended before their delay because the scheduler had the workers wait for them:
        # a real worker stalls the step for each (vLLM's flushes, kvtier's `wait_for`).
        self.jobs_waited = 0

    @property
    def pending(self) -> int:
        """Jobs issued and not yet reported."""
        return len(self._pending)

    def _issue(self, job_id: int, req_id: str, recv: bool) -> None:
        self._pending[job_id] = (self.step + self.delay, req_id, recv)

    def _due(self, waited: Any) -> list[tuple[int, str, bool]]:
        """Take the jobs due this step (and those in `waited`), in the order issued."""
        for job_id in waited or ():
            if job_id in self._pending:
                due, req_id, recv = self._pending[job_id]
                self.jobs_waited += due > self.step
                self._pending[job_id] = (self.step, req_id, recv)
        done = [(j, r, recv) for j, (due, r, recv) in self._pending.items() if due <= self.step]
        for job_id, _, _ in done:
            del self._pending[job_id]
        self.jobs_done += len(done)
        return done

    def output(self, meta: Any) -> Any:
        """What the workers report at the end of the step that received `meta`."""
        from kvtier.integrations.vllm.metadata import KVTierConnectorMetadata

        try:
            if isinstance(meta, KVTierConnectorMetadata):
                return self._kvtier_output(meta)
            return self._vllm_output(meta)
        finally:
            self.step += 1

    def _kvtier_output(self, meta: Any) -> Any:
        from vllm.v1.outputs import KVConnectorOutput

        from kvtier.integrations.vllm.metadata import KVTierWorkerMetadata

        step = meta.step
        for jobs, is_load in ((step.loads, True), (step.stores, False)):
            for j in jobs:
                self._issue(j.job_id, j.req_id, is_load)
                self._in_flight[j.req_id] = self._in_flight.get(j.req_id, 0) + 1
                if is_load:
                    self._loads[j.req_id] = self._loads.get(j.req_id, 0) + 1
        self._held.update(meta.held)
        recving: set[str] = set()
        invalid: set[int] = set()
        for req_id, blocks in meta.failed_loads.items():
            # Loads the scheduler ended before any job ran: failed, as kvtier's workers say.
            recving.add(req_id)
            invalid.update(blocks)
        # (job id, success, worker 0 of 1, bytes, seconds): no bytes move in this comparison
        done = []
        for job_id, req_id, is_load in self._due(step.wait_for):
            done.append((job_id, True, 0, 0, 0.0))
            self._in_flight[req_id] -= 1
            if not self._in_flight[req_id]:
                del self._in_flight[req_id]
            if is_load:
                self._loads[req_id] -= 1
                if not self._loads[req_id]:
                    del self._loads[req_id]
                    recving.add(req_id)
        sending = {r for r in self._held if r not in self._in_flight}
        self._held -= sending
        return KVConnectorOutput(
            finished_recving=recving,
            finished_sending=sending,
            kv_connector_worker_meta=KVTierWorkerMetadata(done) if done else None,
            invalid_block_ids=invalid,
            failed_recving=set(meta.failed_loads),
        )

    def _vllm_output(self, meta: Any) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        waited = set(meta.jobs_to_flush or ())
        for job_id, job in meta.load_jobs.items():
            # A synchronous load's request runs this step: the worker waits for it, and
            # reports no `finished_recving` for it.
            self._issue(job_id, job.req_id, not job.sync)
            if job.sync:
                waited.add(job_id)
        for job_id, job in meta.store_jobs.items():
            self._issue(job_id, job.req_id, False)
        worker_meta = OffloadingWorkerMetadata()
        recving = set()
        for job_id, req_id, recv in self._due(waited):
            worker_meta.mark_completed(job_id)
            if recv:
                recving.add(req_id)
        return KVConnectorOutput(finished_recving=recving, kv_connector_worker_meta=worker_meta)


def _run_scheduler(
    scheduler: Any,
    prompts: list[list[int]],
    max_running: int = 16,
    workers: _StubWorkers | None = None,
) -> tuple[int, float, float]:
    """Feed the prompts, keeping `max_running` in the engine, with `workers` (default: every
    job done in its step); return (steps, seconds, external hit ratio = tokens the connector
    served / tokens it was asked for)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(SCHED_BLOCK, sha256)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    requests = [
        Request(str(i), p, params, None, block_hasher=hasher) for i, p in enumerate(prompts)
    ]
    if workers is None:
        workers = _StubWorkers(0)
    job_delay = workers.delay
    nxt = steps = queries = hits = idle = 0
    # Every job ends within `job_delay` steps, and a request waiting on none is scheduled: many
    # more idle steps than that in a row (nothing scheduled, no job reported; 8 of slack) is a
    # replay that hangs, which looped for good.
    max_idle = job_delay + 8
    live: set[str] = set()
    start = time.perf_counter()
    # vLLM's `has_requests` also counts finished requests whose blocks wait for their stores
    # (kvtier) and a connector's jobs in flight (vLLM's): the replay drains both.
    while nxt < len(requests) or scheduler.has_requests() or workers.pending:
        while nxt < len(requests) and len(live) < max_running:
            scheduler.add_request(requests[nxt])
            live.add(requests[nxt].request_id)
            nxt += 1
        so = scheduler.schedule()
        jobs_done = workers.jobs_done
        stats = scheduler.connector_prefix_cache_stats
        queries += stats.queries
        hits += stats.hits
        req_ids = list(so.num_scheduled_tokens)
        reqs = scheduler.requests
        out = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[
                [7] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in req_ids
            ],
            kv_connector_output=workers.output(so.kv_connector_metadata),
        )
        for eo in scheduler.update_from_output(so, out).values():
            for o in eo.outputs:
                if o.finish_reason is not None:
                    live.discard(o.request_id)
        steps += 1
        idle = 0 if req_ids or workers.jobs_done > jobs_done else idle + 1
        if idle > max_idle:
            raise RuntimeError(
                f"the replay made no progress for {idle} steps (step {steps}, --job-delay "
                f"{job_delay}): {len(requests) - nxt} requests not yet added, {len(live)} in "
                f"the engine, {workers.pending} jobs in flight; expected a request scheduled "
                f"or a job reported at least every {max_idle} steps"
            )
    return steps, time.perf_counter() - start, hits / max(queries, 1)


def _scheduler_prompts(trace: Path, offset: int, num_requests: int) -> list[list[int]]:
    """Trace requests `offset` .. `offset + num_requests - 1`, each hash id as 16 token ids,
    plus one token so that every full block of the prompt can be offloaded."""
    with trace.open() as f:
        lines = itertools.islice(f, offset, offset + num_requests)
        chains = [json.loads(line)["hash_ids"] for line in lines]
    return [[*(h * SCHED_BLOCK + j for h in c for j in range(SCHED_BLOCK)), 1] for c in chains]


def _finishes_in_arrival_order(scheduler: Any) -> None:
    """Hand vLLM's OffloadingConnector the step's finished requests in arrival order instead
    of a set's hash order (a diagnostic: it makes (c) independent of PYTHONHASHSEED)."""
    connector = scheduler.connector
    build = connector.build_connector_meta

    def ordered(scheduler_output: Any) -> Any:
        if scheduler_output.finished_req_ids:
            scheduler_output.finished_req_ids = sorted(scheduler_output.finished_req_ids, key=int)
        return build(scheduler_output)

    connector.build_connector_meta = ordered


SIDES = ("vllm", "kvtier")
"""The connectors of (c) and (d), as the JSON names them."""


def scheduler_run(
    trace: Path,
    offset: int,
    num_requests: int,
    policy: str,
    capacity: float,
    arrival_order: bool = False,
    kv_events: str = "off",
    first: str = "vllm",
    job_delay: int = 0,
    kvtier_extra: Mapping[str, Any] | None = None,
    batch_tokens: int = BATCH_TOKENS,
) -> dict[str, Any]:
    """One run of (c) and (d) in this process on one trace window, `first` ("vllm" or
    "kvtier") first, the workers reporting each job `job_delay` steps after its step:
    steps/s, external hit ratios (tokens the connector served / tokens it was asked for) and
    each connector's KV events (`kv_events` one of `KV_EVENTS`). `kvtier_extra` adds keys to
    kvtier's `kv_connector_extra_config` (to compare its settings)."""
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    if first not in SIDES:
        raise ValueError(f"first={first!r}; expected one of {SIDES}")
    prompts = _scheduler_prompts(trace, offset, num_requests)
    unique = len({t // SCHED_BLOCK for p in prompts for t in p[:-1]})
    slot_bytes = 2 * 2 * 2 * SCHED_BLOCK * 32 * 4  # layers x K/V x heads x tokens x dim x fp32
    # vLLM aligns each chunk to its shared-region alignment; give both the same slot count.
    num_slots = max(16, int(capacity * unique))
    device_blocks = 256  # small, so reuse beyond the device prefix cache needs the host tier
    align = CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT
    v_slot = -(-slot_bytes // align) * align

    def engine(side: str) -> Any:
        if side == "vllm":
            vs = _vllm_engine_with_chunks(
                policy, num_slots, v_slot, align, device_blocks, kv_events, batch_tokens
            )
            if arrival_order:
                _finishes_in_arrival_order(vs)
            return vs
        return _scheduler_engine(
            "KVTierConnector",
            {
                "num_slots": num_slots,
                "cache_policy": policy,
                **_events_extra(kv_events),
                **(kvtier_extra or {}),
            },
            "kvtier.integrations.vllm",
            device_blocks,
            kv_events != "off",
            batch_tokens,
        )

    out: dict[str, Any] = {"offset": offset, "kv_events": kv_events, "first": first}
    # Each side's engine is built just before its replay and dropped after it: the second
    # replay of the pair runs on the heap the first left, so the parent alternates `first`.
    for side in (first, *(s for s in SIDES if s != first)):
        sched = engine(side)
        events = _EventTally(sched)
        workers = _StubWorkers(job_delay)
        # The earlier replays' garbage, collected before the clock starts rather than by
        # whichever replay's allocations happen to trigger a full collection.
        gc.collect()
        steps, secs, hit = _run_scheduler(sched, prompts, workers=workers)
        out[f"{side}_events"] = events.report(secs)
        out[f"{side}_steps_per_s"] = steps / secs
        out[f"{side}_steps"] = steps
        out[f"{side}_seconds"] = secs
        out[f"{side}_hit_ratio"] = hit
        out[f"{side}_jobs_waited"] = workers.jobs_waited
        del sched, events
    return out | {
        "job_delay": job_delay,
        "kvtier_extra": dict(kvtier_extra or {}),
        "batch_tokens": batch_tokens,
        "num_slots": num_slots,
        "num_requests": len(prompts),
    }


CHILD_PROGRESS = "vs_vllm progress: "
"""What starts a scheduler child's progress line on its stderr (vLLM logs there too)."""


def _run_child(
    cmd: list[str], env: dict[str, str], log: Callable[[str], None] | None, what: str
) -> tuple[str, str, int]:
    """Run a scheduler child; pass its progress lines to `log` (prefixed with `what`) as they
    come. Returns (stdout, the rest of stderr, exit status). A child replays a window in 10 s
    or more, five by default, so one line at its end left the run silent for a minute."""
    with tempfile.TemporaryFile("w+") as out:
        # stdout to a file: a pipe vLLM's logging filled would block the child while this
        # process reads stderr.
        child = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.PIPE, text=True)
        assert child.stderr is not None
        rest: list[str] = []
        for line in child.stderr:
            if line.startswith(CHILD_PROGRESS):
                if log is not None:
                    log(f"{what}: {line[len(CHILD_PROGRESS) :].strip()}")
            else:
                rest.append(line)
        status = child.wait()
        out.seek(0)
        return out.read(), "".join(rest), status


def first_connector(at_first_window: str, window: int) -> str:
    """The connector that goes first on a child's `window`-th window (from 0): the two take
    turns, starting with `at_first_window`, which the parent alternates from seed to seed, so
    each goes first in half the runs (one more for an odd count) of every window."""
    return SIDES[(SIDES.index(at_first_window) + window) % 2]


def _scheduler_runs(
    trace: Path,
    offsets: Sequence[int],
    num_requests: int,
    policy: str,
    capacity: float,
    hash_seeds: Sequence[int],
    arrival_order: bool,
    kv_events: Sequence[str],
    log: Callable[[str], None] | None,
    job_delay: int = 0,
    kvtier_extra: Mapping[str, Any] | None = None,
    batch_tokens: int = BATCH_TOKENS,
) -> list[dict[str, Any]]:
    """Every window's run, one child process per hash seed and KV-events setting; the settings
    take turns going first from seed to seed, so the machine's drift hits each alike, and so
    do the connectors within a child, window by window (`first_connector`)."""
    runs: list[dict[str, Any]] = []
    children = len(hash_seeds) * len(kv_events)
    done = 0
    for i, seed in enumerate(hash_seeds):
        env = {**os.environ, "PYTHONHASHSEED": str(seed)}
        shift = i % len(kv_events)
        for events in [*kv_events[shift:], *kv_events[:shift]]:
            cmd = [
                sys.executable,
                __file__,
                "--scheduler-child",
                f"--trace={trace}",
                f"--sched-offsets={','.join(map(str, offsets))}",
                f"--sched-requests={num_requests}",
                f"--sched-policy={policy}",
                f"--capacity={capacity}",
                *(["--vllm-finishes-in-arrival-order"] if arrival_order else []),
                *([f"--kv-events={events}"] if events != "off" else []),
                f"--first-connector={SIDES[i % 2]}",
                f"--job-delay={job_delay}",
                *([f"--kvtier-extra={json.dumps(kvtier_extra)}"] if kvtier_extra else []),
                f"--max-batched-tokens={batch_tokens}",
            ]
            what = f"scheduler, {policy}, PYTHONHASHSEED {seed}"
            if list(kv_events) != ["off"]:
                what += f", KV events {events}"
            stdout, stderr, status = _run_child(cmd, env, log, what)
            if status != 0:
                raise RuntimeError(f"{what}: the child failed:\n{stderr}")
            for run in json.loads(stdout.strip().splitlines()[-1]):
                runs.append({"hash_seed": seed, "kv_events": events, **run})
            done += 1
            if log is not None:
                log(f"{what}: done ({done} of {children})")
    return runs


def _event_totals(runs: Sequence[dict[str, Any]], side: str) -> dict[str, float]:
    """One side's KV events summed over `runs`, and the median share of a run's time spent
    in its connector's `take_events()`."""
    tallies = [r[f"{side}_events"] for r in runs if f"{side}_events" in r]
    if not tallies:
        return {}
    out: dict[str, float] = {
        k: sum(t[k] for t in tallies) for k in ("stored", "removed", "stored_with_tokens")
    }
    out["take_events_share"] = statistics.median(t["take_events_share"] for t in tallies)
    return out


def _take_events_time_ratio(runs: Sequence[dict[str, Any]]) -> float | None:
    """Median over `runs` of kvtier's time in `take_events()` per step over vLLM's: a share of
    a run over its steps/s is the time per step, whatever the machine's speed then."""
    ratios = [
        (k["take_events_share"] / r["kvtier_steps_per_s"])
        / (v["take_events_share"] / r["vllm_steps_per_s"])
        for r in runs
        if (v := r.get("vllm_events")) and (k := r.get("kvtier_events"))
    ]
    return statistics.median(ratios) if ratios else None


def _speedup(runs: Sequence[dict[str, Any]]) -> float | None:
    """The median of the runs' kvtier-over-vLLM steps/s ratios; None for no run."""
    ratios = [r["kvtier_steps_per_s"] / r["vllm_steps_per_s"] for r in runs]
    return statistics.median(ratios) if ratios else None


def _order_figures(runs: Sequence[dict[str, Any]], offsets: Sequence[int]) -> dict[str, Any]:
    """The steps/s ratio of the runs each connector went first in (None for one that never
    did), and `order_effect`: per window, the vLLM-first runs' median ratio over the
    kvtier-first runs', the median over the windows run both ways (None for none). Windows
    differ in ratio, and which went first in which window follows the seed: the per-window
    quotient keeps the windows' own spread out of the order's effect."""
    by_first = {side: [r for r in runs if r.get("first") == side] for side in SIDES}
    effects = []
    for offset in offsets:
        v, k = (_speedup([r for r in by_first[s] if r["offset"] == offset]) for s in SIDES)
        if v is not None and k is not None:
            effects.append(v / k)
    return {
        "speedup_by_first": {side: _speedup(rs) for side, rs in by_first.items()},
        "runs_by_first": {side: len(rs) for side, rs in by_first.items()},
        "order_effect": statistics.median(effects) if effects else None,
    }


def _summarize(
    runs: list[dict[str, Any]],
    offsets: Sequence[int],
    num_requests: int,
    hash_seeds: Sequence[int],
    arrival_order: bool,
    kv_events: str,
    job_delay: int = 0,
) -> dict[str, Any]:
    """The runs of one policy and KV-events setting: medians, ratios, hit ratios per window,
    and the steps/s ratio by the connector that went first (`_order_figures`)."""
    windows = []
    for offset in offsets:
        rs = [r for r in runs if r["offset"] == offset]
        v_hits = [r["vllm_hit_ratio"] for r in rs]
        windows.append(
            {
                "offset": offset,
                "num_slots": rs[0]["num_slots"],
                "vllm_hit_ratio": statistics.median(v_hits),
                "vllm_hit_ratio_min": min(v_hits),
                "vllm_hit_ratio_max": max(v_hits),
                "kvtier_hit_ratio": statistics.median(r["kvtier_hit_ratio"] for r in rs),
                "kvtier_hit_ratio_spread": max(r["kvtier_hit_ratio"] for r in rs)
                - min(r["kvtier_hit_ratio"] for r in rs),
            }
        )
    timed = [r for r in runs if "vllm_seconds" in r]
    return {
        "vllm_steps_per_s": statistics.median(r["vllm_steps_per_s"] for r in runs),
        "kvtier_steps_per_s": statistics.median(r["kvtier_steps_per_s"] for r in runs),
        "speedup": _speedup(runs),
        **_order_figures(runs, offsets),
        # With a job delay the two take different step counts for the same requests, and
        # steps/s no longer compares their work: the replays' times do.
        "replay_time_ratio": (
            statistics.median(r["vllm_seconds"] / r["kvtier_seconds"] for r in timed)
            if timed
            else None
        ),
        "job_delay": job_delay,
        **{
            f"{side}_{what}": sum(r.get(f"{side}_{what}", 0) for r in runs)
            for side in SIDES
            for what in ("steps", "jobs_waited")
        },
        "vllm_hit_ratio": statistics.fmean(w["vllm_hit_ratio"] for w in windows),
        "kvtier_hit_ratio": statistics.fmean(w["kvtier_hit_ratio"] for w in windows),
        "windows": windows,
        "hash_seeds": list(hash_seeds),
        "vllm_finishes_in_arrival_order": arrival_order,
        "num_requests": num_requests,
        "kv_events": kv_events,
        "vllm_events": _event_totals(runs, "vllm"),
        "kvtier_events": _event_totals(runs, "kvtier"),
        "take_events_time_ratio": _take_events_time_ratio(runs),
        "runs": runs,
    }


def compare_schedulers(
    trace: Path,
    offsets: Sequence[int],
    num_requests: int,
    policy: str,
    capacity: float,
    hash_seeds: Sequence[int],
    arrival_order: bool = False,
    log: Callable[[str], None] | None = None,
    kv_events: str = "off",
    job_delay: int = 0,
    kvtier_extra: Mapping[str, Any] | None = None,
    batch_tokens: int = BATCH_TOKENS,
) -> dict[str, Any]:
    """Steps/s and external hit ratio, OffloadingConnector vs KVTierConnector, per trace
    window (`num_requests` requests from each offset), one child process per hash seed.

    vLLM's scheduler hands its connector the finished requests as a set of request ids, and
    vLLM's LRU refreshes their chunks in that order: among requests finishing in the same
    step, which one's chunks are evicted first follows Python's string hashing, so vLLM's
    hit ratio changes with PYTHONHASHSEED (kvtier's does not). Each child gets a fixed seed;
    per window, the seeds' median is compared, and the summary averages over windows (one
    window's LRU figure moves by about 0.05 points with any change of tie order).
    """
    runs = _scheduler_runs(
        trace,
        offsets,
        num_requests,
        policy,
        capacity,
        hash_seeds,
        arrival_order,
        [kv_events],
        log,
        job_delay,
        kvtier_extra,
        batch_tokens,
    )
    return _summarize(runs, offsets, num_requests, hash_seeds, arrival_order, kv_events, job_delay)


def compare_kv_events(
    trace: Path,
    offsets: Sequence[int],
    num_requests: int,
    policy: str,
    capacity: float,
    hash_seeds: Sequence[int],
    kv_events: Sequence[str],
    arrival_order: bool = False,
    log: Callable[[str], None] | None = None,
    job_delay: int = 0,
    kvtier_extra: Mapping[str, Any] | None = None,
    batch_tokens: int = BATCH_TOKENS,
) -> dict[str, dict[str, Any]]:
    """`compare_schedulers` for each KV-events setting, in one run: the settings' children
    alternate, and each setting's steps/s is set against the first setting's (`vs_baseline`:
    the median, over windows and seeds, of each run's steps/s over the first setting's run of
    the same window and seed). `hits_as_baseline` says whether every run's hit ratios equal
    the first setting's (events must not change a decision)."""
    runs = _scheduler_runs(
        trace,
        offsets,
        num_requests,
        policy,
        capacity,
        hash_seeds,
        arrival_order,
        kv_events,
        log,
        job_delay,
        kvtier_extra,
        batch_tokens,
    )
    base = {(r["hash_seed"], r["offset"]): r for r in runs if r["kv_events"] == kv_events[0]}
    out = {}
    for events in kv_events:
        mine = [r for r in runs if r["kv_events"] == events]
        summary = _summarize(
            mine, offsets, num_requests, hash_seeds, arrival_order, events, job_delay
        )
        pairs = [(r, base[r["hash_seed"], r["offset"]]) for r in mine]
        for side in ("vllm", "kvtier"):
            key = f"{side}_steps_per_s"
            summary[f"{side}_vs_baseline"] = statistics.median(r[key] / b[key] for r, b in pairs)
        summary["hits_as_baseline"] = all(
            r[f"{side}_hit_ratio"] == b[f"{side}_hit_ratio"]
            for r, b in pairs
            for side in ("vllm", "kvtier")
        )
        out[events] = summary
    return out


def _kvtier_extra(sched: dict[str, Any]) -> dict[str, Any]:
    runs = sched.get("runs") or [{}]
    extra: dict[str, Any] = runs[0].get("kvtier_extra", {})
    return extra


def _batch_tokens(sched: dict[str, Any]) -> int:
    runs = sched.get("runs") or [{}]
    return int(runs[0].get("batch_tokens", BATCH_TOKENS))


def _print_scheduler(policy: str, sched: dict[str, Any]) -> None:
    ordered = sched["vllm_finishes_in_arrival_order"]
    print(
        f"\nscheduler, policy {policy}: {sched['num_requests']} trace requests per window in "
        "16-token blocks, workers stubbed "
        + (
            f"(each job reported {sched['job_delay']} steps after its step)"
            if sched["job_delay"]
            else "(every job done in its step)"
        )
        + ", PYTHONHASHSEED "
        f"{','.join(map(str, sched['hash_seeds']))}"
        + (", vLLM fed finishes in arrival order" if ordered else "")
        + (f", kvtier extra config {json.dumps(extra)}" if (extra := _kvtier_extra(sched)) else "")
        + (f", at most {b:,} tokens a step" if (b := _batch_tokens(sched)) != BATCH_TOKENS else "")
        + (f", KV events {sched['kv_events']}" if sched["kv_events"] != "off" else "")
    )
    print(
        f"{'window':>7} {'slots':>6} {'vLLM hit % median':>18} {'(min-max)':>15} "
        f"{'kvtier hit %':>13} {'diff':>7}"
    )
    for w in sched["windows"]:
        print(
            f"{w['offset']:>7} {w['num_slots']:>6} {100 * w['vllm_hit_ratio']:>18.3f}"
            f" ({100 * w['vllm_hit_ratio_min']:.3f}-{100 * w['vllm_hit_ratio_max']:.3f})"
            f" {100 * w['kvtier_hit_ratio']:>13.3f}"
            f" {100 * (w['kvtier_hit_ratio'] - w['vllm_hit_ratio']):>+7.3f}"
        )
    print(
        f"{'mean':>7} {'':>6} {100 * sched['vllm_hit_ratio']:>18.3f} {'':>15}"
        f" {100 * sched['kvtier_hit_ratio']:>13.3f}"
        f" {100 * (sched['kvtier_hit_ratio'] - sched['vllm_hit_ratio']):>+7.3f}"
    )
    print(
        f"steps/s (median of runs): vLLM {sched['vllm_steps_per_s']:,.0f}, kvtier "
        f"{sched['kvtier_steps_per_s']:,.0f}, ratio {sched['speedup']:.2f}x (median of the "
        "runs' side-by-side ratios)"
    )
    by_first = ", ".join(
        f"{side} first: "
        + ("-" if ratio is None else f"{ratio:.2f}x")
        + f" ({sched['runs_by_first'][side]} runs)"
        for side, ratio in sched["speedup_by_first"].items()
    )
    effect = sched["order_effect"]
    print(
        f"ratio by the connector that ran first in its pair (median): {by_first}; order "
        "effect (per window, vLLM-first ratio over kvtier-first ratio, median): "
        + ("-" if effect is None else f"{effect:.2f}x")
    )
    if sched["job_delay"]:
        print(
            f"steps over the runs: vLLM {sched['vllm_steps']:,}, kvtier "
            f"{sched['kvtier_steps']:,}; replay time vLLM / kvtier "
            f"{sched['replay_time_ratio']:.2f}x (median); jobs the workers were made to wait "
            f"for before their delay: vLLM {sched['vllm_jobs_waited']:,}, kvtier "
            f"{sched['kvtier_jobs_waited']:,}"
        )
    if sched["kv_events"] != "off":
        v, k = sched["vllm_events"], sched["kvtier_events"]
        print(
            f"KV events over the runs, stored / removed: vLLM {v['stored']:,.0f} / "
            f"{v['removed']:,.0f}, kvtier {k['stored']:,.0f} / {k['removed']:,.0f}; share of "
            f"the replay in take_events() (median): vLLM {100 * v['take_events_share']:.2f}%, "
            f"kvtier {100 * k['take_events_share']:.2f}%"
        )


def _print_kv_events(policy: str, by_events: dict[str, dict[str, Any]]) -> None:
    base = next(iter(by_events))
    print(
        f"\nKV events, policy {policy}: steps/s medians; ratios are medians of per-window, "
        f"per-seed ratios (against {base}: the same window and seed with {base})"
    )
    print(
        f"{'KV events':<16} {'vLLM steps/s':>12} {'kvtier steps/s':>14} {'kvtier/vLLM':>11} "
        f"{'vLLM vs ' + base:>12} {'kvtier vs ' + base:>14} {'take_events % vLLM/kvtier':>26} "
        f"{'hits as ' + base:>12} {'take_events/step kvtier/vLLM':>28}"
    )
    for events, r in by_events.items():
        v, k = r["vllm_events"], r["kvtier_events"]
        share = f"{100 * v['take_events_share']:.2f} / {100 * k['take_events_share']:.2f}"
        print(
            f"{events:<16} {r['vllm_steps_per_s']:>12,.0f} {r['kvtier_steps_per_s']:>14,.0f} "
            f"{r['speedup']:>10.2f}x {r['vllm_vs_baseline']:>11.3f}x "
            f"{r['kvtier_vs_baseline']:>13.3f}x {share:>26} "
            f"{'yes' if r['hits_as_baseline'] else 'NO':>12} "
            f"{r['take_events_time_ratio']:>27.2f}x"
        )


def json_object(text: str) -> dict[str, Any]:
    """A JSON object given on the command line (argparse names the option if this raises)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not JSON ({e.msg}); expected an object"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"{text!r} is a JSON {type(value).__name__}; expected an object"
        )
    return value


def kv_events_list(text: str) -> list[str]:
    """`--kv-events`: a comma list of `KV_EVENTS` settings."""
    settings = text.split(",")
    bad = [s for s in settings if s not in KV_EVENTS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"{text!r}: unknown setting {bad}; expected off, on or self-describing, or a "
            "comma list of them"
        )
    return settings


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--policies", default="lru,arc")
    parser.add_argument("--capacity", type=float, default=0.10, help="share of unique blocks")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--trace", type=Path, default=MOONCAKE)
    parser.add_argument(
        "--sched-requests",
        type=positive_int,
        default=2000,
        help="trace requests replayed through vLLM's Scheduler (c)/(d)",
    )
    parser.add_argument("--sched-policy", default="lru,arc", help="policies for (c)/(d)")
    parser.add_argument(
        "--sched-offsets",
        type=int_list(0),
        default="0,2000,4000,6000,8000",
        help="first trace request of each window replayed through the Scheduler",
    )
    parser.add_argument(
        "--hash-seeds",
        type=int_list(0),
        help="PYTHONHASHSEED of each scheduler run (default: 0 .. repeats-1)",
    )
    parser.add_argument(
        "--vllm-finishes-in-arrival-order",
        action="store_true",
        help="diagnostic: give (c) the finished requests in arrival order, not hash order",
    )
    parser.add_argument(
        "--kv-events",
        type=kv_events_list,
        default="off",
        help="vLLM's KV events for (c)/(d), a comma list of off, on, self-describing (on with "
        "self_describing_kv_events); several are run alternately and set against the first",
    )
    parser.add_argument(
        "--job-delay",
        type=at_least(0),
        default=0,
        help="steps after its step that the stub workers report each job of (c)/(d) done, "
        "loads and stores alike, as an asynchronous copy engine would (default 0: in its step)",
    )
    parser.add_argument(
        "--kvtier-extra",
        type=json_object,
        default={},
        help="JSON object of keys added to kvtier's kv_connector_extra_config in (d), such as "
        "'{\"release_finished_blocks\": false}' (default: none)",
    )
    parser.add_argument(
        "--max-batched-tokens",
        type=at_least(SCHED_BLOCK),
        default=BATCH_TOKENS,
        help="vLLM's max_num_batched_tokens in (c)/(d): below a prompt's length, vLLM prefills "
        f"it over several steps (chunked prefill; default {BATCH_TOKENS}, above every prompt "
        "of the default windows)",
    )
    parser.add_argument("--skip-scheduler", action="store_true")
    parser.add_argument("--skip-manager", action="store_true")
    parser.add_argument("--scheduler-child", action="store_true", help=argparse.SUPPRESS)
    # A child's first window's first connector; the parent alternates it from seed to seed.
    parser.add_argument("--first-connector", choices=SIDES, default="vllm", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="write the results as JSON to this file")
    args = parser.parse_args(argv)

    offsets = args.sched_offsets
    if not 0.0 < args.capacity <= 1.0:
        parser.error(f"--capacity {args.capacity} is invalid; expected a share in (0, 1]")
    if args.hash_seeds and max(args.hash_seeds) > 4294967295:
        parser.error(f"--hash-seeds {args.hash_seeds}: PYTHONHASHSEED is at most 4294967295")
    if args.skip_manager and args.skip_scheduler:
        # Else it printed nothing and wrote `{}` to --json, with exit status 0.
        parser.error("--skip-manager with --skip-scheduler leaves nothing to run; expected one")
    # Else a window (or seed) given twice ran twice, and weighed twice in the mean (or median).
    require_distinct(parser, "--sched-offsets", offsets, "window")
    require_distinct(parser, "--hash-seeds", args.hash_seeds or [], "seed")
    require_distinct(parser, "--kv-events", args.kv_events, "setting")
    if args.skip_scheduler and args.kv_events != ["off"]:
        parser.error(
            f"--kv-events {','.join(args.kv_events)}: only the scheduler runs (c)/(d), which "
            "--skip-scheduler leaves out, have KV events; expected off or no --skip-scheduler"
        )
    if args.skip_scheduler and args.job_delay:
        parser.error(
            f"--job-delay {args.job_delay}: only the scheduler runs (c)/(d) have stub workers, "
            "which --skip-scheduler leaves out; expected 0 or no --skip-scheduler"
        )
    if args.scheduler_child and len(args.kv_events) != 1:
        parser.error(f"--kv-events {args.kv_events}: a scheduler child runs one setting")
    require_file(parser, "--trace", args.trace)
    policies = [
        *([] if args.skip_manager else args.policies.split(",")),
        *([] if args.skip_scheduler else args.sched_policy.split(",")),
    ]
    require_known(parser, "--policies/--sched-policy", policies, registered_policies())
    for option in ("--policies", "--sched-policy"):
        require_distinct(parser, option, getattr(args, option[2:].replace("-", "_")).split(","))
    if not args.scheduler_child:
        # After the checks above: this makes --json's folders, which their refusals left behind.
        require_writable(parser, args.json, make_parents=True, inputs=[args.trace])
    try:
        from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
    except ImportError:
        parser.error("needs vLLM 0.33.0 installed next to kvtier (see docs/vllm.md)")
    both = [n for n in registered_policies() if n in CachePolicyFactory._registry]
    require_known(parser, "--policies/--sched-policy", policies, both)
    try:
        workload = mooncake_workload(args.trace)
    except ValueError as e:
        parser.error(f"--trace: {e}")
    if not args.skip_scheduler:
        # A window past the trace's end would replay nothing, and fail only at the end.
        short = [o for o in offsets if o + args.sched_requests > len(workload)]
        if short:
            parser.error(
                f"--sched-offsets {short} with --sched-requests {args.sched_requests}: the "
                f"trace has {len(workload)} requests; expected windows inside it"
            )
    if args.scheduler_child:
        runs = []
        for i, o in enumerate(offsets, 1):
            runs.append(
                scheduler_run(
                    args.trace,
                    o,
                    args.sched_requests,
                    args.sched_policy,
                    args.capacity,
                    args.vllm_finishes_in_arrival_order,
                    args.kv_events[0],
                    first_connector(args.first_connector, i - 1),
                    args.job_delay,
                    args.kvtier_extra,
                    args.max_batched_tokens,
                )
            )
            if i < len(offsets):  # the parent says when the last is done
                print(f"{CHILD_PROGRESS}window {o}: done ({i} of {len(offsets)})",
                      file=sys.stderr, flush=True)  # fmt: skip
        print(json.dumps(runs))
        return 0

    result: dict[str, Any] = {}
    if not args.skip_manager:
        unique = len({k for chain in workload for k in chain})
        num_slots = max(1, int(args.capacity * unique))
        manager = compare_managers(
            workload, args.policies.split(","), num_slots, args.repeats, progress
        )
        result["manager"] = manager
        share = f"{args.capacity:.0%} of unique blocks"
        print(f"manager, {args.trace.name}, {num_slots} slots ({share})")
        print(
            f"{'policy':<7} {'vLLM calls/s':>13} {'kvtier calls/s':>15} {'ratio':>6} "
            f"{'vLLM hit %':>10} {'kvtier hit %':>12}"
        )
        for policy, r in manager.items():
            print(
                f"{policy:<7} {r['vllm_calls_per_s']:>13,.0f} {r['kvtier_calls_per_s']:>15,.0f}"
                f" {r['speedup']:>5.2f}x {100 * r['vllm_hit_ratio']:>10.2f}"
                f" {100 * r['kvtier_hit_ratio']:>12.2f}"
            )
    if not args.skip_scheduler:
        seeds = args.hash_seeds or list(range(args.repeats))
        by_policy = {}
        by_events = {}
        for policy in args.sched_policy.split(","):
            if len(args.kv_events) == 1:
                by_policy[policy] = compare_schedulers(
                    args.trace,
                    offsets,
                    args.sched_requests,
                    policy,
                    args.capacity,
                    seeds,
                    args.vllm_finishes_in_arrival_order,
                    progress,
                    args.kv_events[0],
                    args.job_delay,
                    args.kvtier_extra,
                    args.max_batched_tokens,
                )
            else:
                by_events[policy] = compare_kv_events(
                    args.trace,
                    offsets,
                    args.sched_requests,
                    policy,
                    args.capacity,
                    seeds,
                    args.kv_events,
                    args.vllm_finishes_in_arrival_order,
                    progress,
                    args.job_delay,
                    args.kvtier_extra,
                    args.max_batched_tokens,
                )
                by_policy[policy] = by_events[policy][args.kv_events[0]]
            _print_scheduler(policy, by_policy[policy])
            if by_events:
                _print_kv_events(policy, by_events[policy])
        # The first policy's figures at the top level, as the issue's JSON layout has them.
        result["scheduler"] = {"policy": next(iter(by_policy)), **next(iter(by_policy.values()))}
        result["scheduler_by_policy"] = by_policy
        if by_events:
            # The first setting's figures are those above; every setting's, per policy.
            result["scheduler_by_kv_events"] = by_events
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_results(args.json, json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    run_main(main)
