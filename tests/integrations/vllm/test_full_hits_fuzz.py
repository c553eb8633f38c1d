"""A seeded fuzz of full prompt hits and preempted restores through vLLM's real scheduler.

It guards two behaviours of KVTierConnector: a prompt that fills its last chunk loads that
chunk too (vLLM rewinds a full asynchronous hit by one token and recomputes it), with a
preempted request's hit reaching all its tokens (`request.num_tokens`); and a preempted
request offers its chunks for storing again from the first. Each case drives vLLM's
`Scheduler` or `AsyncScheduler` (two batches in flight) over one or two KV-cache groups,
with prompts that are often whole chunks (or blocks) of earlier requests' prompts and
outputs, prompt-logprob requests (which read no cached prefix), a small device cache (vLLM
preempts) and a small host tier (kvtier evicts), aborts, prefix-cache resets that preempt
the running requests and zero the device KV, connector resets, and failed loads and stores.

Every transfer runs exactly one step after it was submitted (held until the next step
starts, then waited for), so loads and stores are in flight across a step's scheduling,
preemptions included, and a seed replays the same run. After every step, every token vLLM
counts as computed for a running or loaded request holds the stand-in model's KV for it; at
the end every request produced its max_tokens (or failed its load under vLLM's "fail"
policy), nothing leaks, and vLLM raised nothing. See engine.py for the stand-ins.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any, Literal, NamedTuple

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)


sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import (
    BLOCK_SIZE,
    ZeroAfterFence,
    assert_computed_kv,
    build_halves,
    finish_worker_step,
    groups_of_layers,
    make_engine,
    make_kv_cache_config,
    make_request,
    make_vllm_config,
    prefix_values,
)
from test_vllm import (
    MODULE,
    _swap_transfer,
    assert_no_leaks,
    expect_loaded,
    kvtier_side,
    step_until_running,
    vllm_loaded,
)

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm

SAMPLED = 7  # every sampled token: later prompts can extend earlier requests' outputs


def _tokens(request: Any, n: int) -> list[int]:
    """The request's first n tokens, async scheduling's placeholders as the sampled token."""
    known = list(request.all_token_ids)
    return known + [SAMPLED] * max(0, n - len(known))


def _request(req_id: str, prompt: list[int], max_tokens: int, prompt_logprobs: bool) -> Any:
    """engine.make_request's request, asking for prompt logprobs when told."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    if not prompt_logprobs:
        return make_request(req_id, prompt, max_tokens)
    init_none_hash(sha256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=1)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    return Request(req_id, prompt, params, None, block_hasher=hasher)


class _Engine:
    """vLLM's Scheduler (a batch queue of 1) or AsyncScheduler (2), a worker-side connector on
    CPU tensors, and transfers that each run one step after the step that submitted them."""

    def __init__(
        self,
        extra: dict[str, Any],
        num_blocks: int,
        num_groups: int,
        use_async: bool,
        max_num_batched_tokens: int,
        policy: Literal["recompute", "fail"],
    ) -> None:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        cfg = make_vllm_config(
            "KVTierConnector", extra, num_blocks, MODULE, max_num_batched_tokens, policy
        )
        cfg.scheduler_config.async_scheduling = use_async
        kv_cache_config = make_kv_cache_config(num_blocks, num_groups)
        self.scheduler, self.worker, self.kv_caches = build_halves(
            cfg, kv_cache_config, scheduler_class=AsyncScheduler if use_async else None
        )
        self.group_of_layer = groups_of_layers(kv_cache_config)
        self.depth = 2 if use_async else 1
        self.queue: deque[tuple[Any, Any]] = deque()
        self.num_output_tokens: dict[str, int] = {}
        self.finish_reason: dict[str, str] = {}
        # Transfers: each job waits in its copy thread until the step after its own starts.
        self.step_no = 0
        self._cv = threading.Condition()
        self._submitted_at: dict[int, int] = {}
        self._opened = 0  # jobs of steps before this one may run
        self.on_job: Any = None  # (job_id, kind) -> None, may raise to fail the job

    def hold(self, job_id: int, kind: str) -> None:
        """The fault injector: called by the copy thread before a job's copy."""
        with self._cv:
            ok = self._cv.wait_for(
                lambda: self._submitted_at.get(job_id, self._opened) < self._opened, 60
            )
        assert ok, f"job {job_id} was never let run"
        if self.on_job is not None:
            self.on_job(job_id, kind)

    def open_all(self) -> None:
        with self._cv:
            self._opened = 1 << 30
            self._cv.notify_all()

    def _note_submitted(self) -> None:
        with self._cv:
            for job_id in self.worker.worker_side._jobs:
                self._submitted_at.setdefault(job_id, self.step_no)

    def _execute(self, so: Any) -> Any:

        w, sched = self.worker, self.scheduler
        ws = w.worker_side
        earlier = list(ws._jobs)
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.handle_preemptions(so.kv_connector_metadata)
        w.start_load_kv(None)
        self._note_submitted()
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            n = so.num_scheduled_tokens[req_id]
            req = sched.requests[req_id]
            end = req.num_computed_tokens  # counts this step's tokens already
            values = prefix_values(_tokens(req, end), end)
            table = sched.kv_cache_manager.get_block_ids(req_id)
            for name, t in self.kv_caches.items():
                layer = int(name.split(".")[2])
                blocks = table[self.group_of_layer[name]]
                for p in range(end - n, end):
                    t[blocks[p // BLOCK_SIZE], :, p % BLOCK_SIZE, :] = float(values[p] + layer * 7)
            sampled.append([] if req.is_prefill_chunk else [SAMPLED])
        w.wait_for_save()
        self._note_submitted()
        ws.transfer.wait(earlier)
        return finish_worker_step(w, so, req_ids, sampled)

    def process_oldest(self) -> None:
        so, out = self.queue.popleft()
        for eo in self.scheduler.update_from_output(so, out).values():
            for o in eo.outputs:
                got = self.num_output_tokens.get(o.request_id, 0) + len(o.new_token_ids)
                self.num_output_tokens[o.request_id] = got
                if o.finish_reason is not None:
                    assert o.request_id not in self.finish_reason, o.request_id
                    self.finish_reason[o.request_id] = str(o.finish_reason)

    def step(self) -> None:
        self.step_no += 1
        with self._cv:
            self._opened = self.step_no  # the jobs of earlier steps may run now
            self._cv.notify_all()
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            self.queue.append((so, self._execute(so)))
        if len(self.queue) >= self.depth or (self.queue and not self.scheduler.has_requests()):
            self.process_oldest()

    def busy(self) -> bool:
        return bool(self.scheduler.has_requests() or self.queue)


def _check_kv(engine: _Engine) -> None:
    """Every token vLLM counts as computed for a running request, or a waiting one whose
    load arrived, holds exactly the stand-in model's KV for that request's tokens."""
    from vllm.v1.request import RequestStatus

    sched = engine.scheduler
    live = (RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.PREEMPTED)
    for req in sched.requests.values():
        n = req.num_computed_tokens
        if req.status not in live or n == 0:
            continue
        assert_computed_kv(
            engine.kv_caches,
            engine.group_of_layer,
            sched.kv_cache_manager.get_block_ids(req.request_id),
            _tokens(req, n),
            n,
            f"request {req.request_id} ({req.status.name})",
        )


class _Case(NamedTuple):
    use_async: bool  # AsyncScheduler, two batches in flight
    num_groups: int  # full-attention KV-cache groups
    blocks_per_chunk: int
    num_slots: int  # host tier slots, one chunk each: few evict a lot
    gpu_blocks: int  # device blocks per group: few make vLLM preempt
    offload_prompt_only: bool
    policy: Literal["recompute", "fail"]  # vLLM's kv_load_failure_policy
    p_fail_load: float  # stores fail half as often
    p_reset: float  # per step: a prefix-cache reset preempting the running requests


CASES = {
    "sync-1g-bpc1": _Case(False, 1, 1, 6, 10, False, "recompute", 0.0, 0.08),
    "sync-2g-bpc2-prompt": _Case(False, 2, 2, 4, 14, True, "recompute", 0.1, 0.08),
    "sync-1g-bpc3-fail": _Case(False, 1, 3, 12, 14, False, "fail", 0.1, 0.04),
    "sync-2g-bpc1-tiny-tier": _Case(False, 2, 1, 3, 10, False, "recompute", 0.0, 0.12),
    "async-1g-bpc2": _Case(True, 1, 2, 12, 14, False, "recompute", 0.0, 0.08),
    "async-2g-bpc1-prompt": _Case(True, 2, 1, 6, 10, True, "recompute", 0.1, 0.08),
    "async-1g-bpc1-tiny-tier": _Case(True, 1, 1, 3, 10, False, "fail", 0.0, 0.12),
    "async-2g-bpc3": _Case(True, 2, 3, 12, 20, False, "recompute", 0.1, 0.04),
}


class _Fuzz:
    def __init__(self, seed: int, case: _Case) -> None:
        self.rng = rng = random.Random(seed)
        self.seed = seed
        self.case = case
        self.tpc = BLOCK_SIZE * case.blocks_per_chunk
        extra = {
            "num_slots": case.num_slots,
            "blocks_per_chunk": case.blocks_per_chunk,
            "offload_prompt_only": case.offload_prompt_only,
        }
        self.engine = _Engine(
            extra,
            case.gpu_blocks * case.num_groups,
            case.num_groups,
            case.use_async,
            rng.choice([64, 512]),
            case.policy,
        )
        _swap_transfer(self.engine, self.engine.hold)  # type: ignore[arg-type]
        self.engine.on_job = self._fault
        w = self.engine.worker
        self.zero = ZeroAfterFence(w, self.engine.kv_caches)
        self.max_len = (case.gpu_blocks - 2) * BLOCK_SIZE
        self.sources = [
            [rng.randrange(1, 1000) for _ in range(rng.randrange(BLOCK_SIZE, self.max_len))]
            for _ in range(3)
        ]
        self.max_tokens: dict[str, int] = {}
        self.aborted: set[str] = set()
        self.counts = dict.fromkeys(
            ["full_new", "full_resumed", "preempted_in_flight", "resets", "resets_refused"], 0
        )
        side = self.engine.scheduler.connector.scheduler_side
        self._count_offers(side)

    def _count_offers(self, side: Any) -> None:
        get, preempted = side.get_num_new_matched_tokens, side.scheduler.request_preempted

        def counted_get(request: Any, num_computed_tokens: int) -> Any:
            n, load = get(request, num_computed_tokens)
            if n and request.skip_reading_prefix_cache:
                raise AssertionError(f"{request.request_id} reads no prefix; offered {n}")
            if n and n + num_computed_tokens == request.num_tokens:
                self.counts["full_resumed" if request.num_preemptions else "full_new"] += 1
            return n, load

        def counted_preempted(req_id: str) -> None:
            self.counts["preempted_in_flight"] += bool(side.scheduler.num_jobs_in_flight())
            preempted(req_id)

        side.get_num_new_matched_tokens = counted_get
        side.scheduler.request_preempted = counted_preempted

    def _fault(self, job_id: int, kind: str) -> None:
        # From the copy thread: decided by (seed, job, kind) alone.
        p = self.case.p_fail_load * (1 if kind == "load" else 0.5)
        if p and random.Random(f"{self.seed}:{job_id}:{kind}").random() < p:
            raise RuntimeError(f"injected {kind} failure")

    def add(self) -> None:
        rng = self.rng
        max_tokens = rng.choice([1, 2, 3, 5, 9, 17, 33])
        limit = self.max_len - max_tokens
        source = rng.choice(self.sources)
        r = rng.random()
        if r < 0.6:
            # Whole chunks (or whole blocks) of a prompt or output seen before.
            unit = self.tpc if r < 0.45 else BLOCK_SIZE
            whole = min(len(source), limit) // unit * unit
            prompt = source[: rng.randrange(1, whole // unit + 1) * unit] if whole else source[:1]
        elif r < 0.9:
            prompt = source[: rng.randrange(1, len(source) + 1)]
            prompt = prompt + [rng.randrange(1, 1000) for _ in range(rng.randrange(0, 40))]
        else:
            prompt = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 80))]
        prompt = prompt[:limit]
        req_id = f"r{len(self.max_tokens)}"
        # A prompt-logprob request: vLLM computes its whole prompt; kvtier looks nothing up.
        request = _request(req_id, prompt, max_tokens, prompt_logprobs=rng.random() < 0.15)
        self.engine.scheduler.add_request(request)
        self.max_tokens[req_id] = max_tokens
        # What it holds once done: later prompts reach into its output too.
        self.sources.append(prompt + [SAMPLED] * max_tokens)
        if len(self.sources) > 8:
            del self.sources[rng.randrange(len(self.sources) - 1)]

    def abort(self) -> None:
        from vllm.v1.request import RequestStatus

        live = [r for r, req in self.engine.scheduler.requests.items() if not req.is_finished()]
        if live:
            victim = self.rng.choice(sorted(live))
            self.engine.scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            self.aborted.add(victim)

    def reset(self) -> None:
        try:
            ok = self.engine.scheduler.reset_prefix_cache(reset_running_requests=True)
        except RuntimeError:
            ok = False  # refused while blocks are held (loads in flight, held requests)
        self.counts["resets" if ok else "resets_refused"] += 1
        if ok and self.rng.random() < 0.8:
            self.zero.armed = True

    def aligned(self) -> bool:
        """Whether a running request that sampled a token holds whole chunks: preempted now,
        its hit may reach all its tokens."""
        return any(
            r.num_tokens % self.tpc == 0 and r.num_output_tokens
            for r in self.engine.scheduler.running
        )

    def step(self) -> None:
        self.engine.step()
        _check_kv(self.engine)

    def run(self, num_steps: int) -> None:
        rng = self.rng
        for _ in range(num_steps):
            for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
                self.add()
            r = rng.random()
            if r < 0.03:
                self.abort()
            elif r < 0.03 + self.case.p_reset or (r < 0.5 and self.aligned()):
                self.reset()
            elif r < 0.04 + self.case.p_reset:
                self.engine.scheduler.reset_connector_cache()
            self.step()
        for _ in range(3000):
            if not self.engine.busy():
                break
            self.step()
        for _ in range(3):
            self.step()
        assert not self.engine.busy(), f"requests {sorted(self.engine.scheduler.requests)} live"
        assert_no_leaks(self.engine)  # type: ignore[arg-type]
        for req_id, max_tokens in self.max_tokens.items():
            if req_id in self.aborted:
                continue
            got = self.engine.num_output_tokens.get(req_id, 0)
            reason = self.engine.finish_reason.get(req_id)
            if reason == "error" and self.case.policy == "fail":
                continue  # its load failed, and vLLM fails such a request
            assert (got, reason) == (max_tokens, "length"), (req_id, got, max_tokens, reason)


@pytest.mark.parametrize("name", sorted(CASES))
def test_full_hits_and_restores_keep_kv_exact(vllm_loaded: None, name: str) -> None:
    fuzz = _Fuzz(sorted(CASES).index(name), CASES[name])
    try:
        fuzz.run(70)
    finally:
        fuzz.engine.open_all()
        fuzz.engine.worker.shutdown()
    # Prompts of whole chunks were served whole (kvtier stopped a token short before).
    assert fuzz.counts["full_new"] > 0, fuzz.counts


def test_a_preempted_request_of_whole_chunks_reloads_every_chunk(vllm_loaded: None) -> None:
    """Preempted when its 64 tokens (40 of prompt, 24 sampled) fill 4 chunks, a request's hit
    reaches all of them: "b" stored the fourth, whose last token "a" had sampled but not
    computed. vLLM rewinds the full hit by a token and recomputes it (before: 3 chunks)."""
    engine = make_engine(
        "KVTierConnector", {"cpu_bytes_to_use": "8MiB", "offload_prompt_only": False}
    )
    side = kvtier_side(engine)
    prompt = list(range(1, 41))
    engine.add("b", [*prompt, *[engine.sampled_token] * 24, 900], max_tokens=1)
    engine.run_until(["b"])
    a = engine.add("a", prompt, max_tokens=40)
    while a.num_tokens < 4 * BLOCK_SIZE:
        engine.step()
    assert engine.scheduler.reset_prefix_cache(reset_running_requests=True)
    assert a.num_preemptions == 1
    for t in engine.kv_caches.values():
        t.zero_()  # only a load from kvtier can bring the bytes back
    tokens = list(a.all_token_ids)
    loaded = side._loaded_tokens
    engine.step()
    assert a.status.name == "WAITING_FOR_REMOTE_KVS"
    assert a.num_computed_tokens == 4 * BLOCK_SIZE == a.num_tokens
    step_until_running(engine, "a")
    assert side._loaded_tokens - loaded == 4 * BLOCK_SIZE
    expect_loaded(engine, "a", tokens, 4 * BLOCK_SIZE)
    engine.run_until(["a"])
    assert a.num_output_tokens == 40
    assert_no_leaks(engine)
    engine.worker.shutdown()
