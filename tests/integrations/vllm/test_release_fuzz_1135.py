"""A random walk over request arrivals, aborts, resets and preemptions through vLLM 0.33's real
Scheduler with `release_finished_blocks` on, every transfer held at a gate until a random
later step: each step's `wait_for` must cover every store still held that reads a block the
step writes (a forward pass or a load), and every request admitted must find the right KV in
its prefix (vLLM's cache hits and kvtier's loads). Run with one KVTierConnector, and with two
inside a `MultiConnector`, where one connector's loads overwrite blocks the other's stores
read.

The CPU transfer engine runs jobs in one FIFO thread, so a load queued after a store never
overtakes it here, as it may on a GPU: the step-by-step check of `wait_for` is what judges the
fence, the byte check what judges the bytes loaded."""

from __future__ import annotations

import importlib.util
import random
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import (
    BLOCK_SIZE,
    Engine,
    assert_computed_kv,
    make_engine,
    runner_output,
    worker_output,
)
from test_vllm import EXTRA, MODULE, _swap_transfer, vllm_loaded

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm

PREFIXES = [list(range(100 * k + 1, 100 * k + 1 + 3 * BLOCK_SIZE)) for k in range(3)]
RELEASE = {**EXTRA, "release_finished_blocks": True}


class _Walk:
    """The engine, its gate, and the stores the gate holds: (connector, job id) -> device
    blocks the store reads."""

    def __init__(self, seed: int, num_connectors: int) -> None:
        self.rng = random.Random(seed)
        if num_connectors == 1:
            self.engine: Engine = make_engine("KVTierConnector", RELEASE, num_gpu_blocks=16)
            workers, scheds = [self.engine.worker], [self.engine.scheduler.connector]
        else:
            kvtier = {
                "kv_connector": "KVTierConnector",
                "kv_connector_module_path": MODULE,
                "kv_role": "kv_both",
                "kv_connector_extra_config": RELEASE,
            }
            multi = {"connectors": [kvtier] * num_connectors}
            self.engine = make_engine("MultiConnector", multi, module_path=None, num_gpu_blocks=16)
            workers = list(self.engine.worker._connectors)
            scheds = list(self.engine.scheduler.connector._connectors)
        self.workers = [w.worker_side for w in workers]
        self.sides = [c.scheduler_side for c in scheds]
        self.opened = threading.Event()
        for w in workers:
            _swap_transfer(cast(Engine, SimpleNamespace(worker=w)), self._hold)
        self.held: dict[tuple[int, int], set[int]] = {}
        self.submitted: list[list[int]] = [[] for _ in workers]
        self.live: set[str] = set()
        self.next_id = 0
        self.checked_blocks = 0

    def _hold(self, job_id: int, kind: str) -> None:
        self.opened.wait(60)

    def flush(self) -> None:
        """Let every transfer submitted so far run to its end."""
        self.opened.set()
        for w, jobs in zip(self.workers, self.submitted, strict=True):
            w.transfer.wait(jobs)
            jobs.clear()
        self.opened.clear()
        self.held.clear()

    def add(self) -> None:
        rng = self.rng
        tokens = [*rng.choice(PREFIXES)[: rng.randrange(1, 4) * BLOCK_SIZE]]
        tokens += [rng.randrange(400, 1000) for _ in range(rng.randrange(1, 2 * BLOCK_SIZE))]
        req_id = f"r{self.next_id}"
        self.next_id += 1
        self.engine.add(req_id, tokens, max_tokens=rng.randrange(1, 12))
        self.live.add(req_id)

    def step(self) -> None:
        engine, sched = self.engine, self.engine.scheduler
        so = sched.schedule()
        meta = so.kv_connector_metadata
        steps = [m.step for m in getattr(meta, "metadata", (meta,))]
        # Blocks this step writes: its forward pass (num_computed_tokens already counts the
        # step's tokens) and every connector's loads.
        written: set[int] = set()
        for step in steps:
            for job in step.loads:
                written.update(job.device_blocks.tolist())
        for req_id, n in so.num_scheduled_tokens.items():
            end = sched.requests[req_id].num_computed_tokens
            for ids in sched.kv_cache_manager.get_block_ids(req_id):
                written.update(ids[p // BLOCK_SIZE] for p in range(end - n, end))
        waits = False
        for (k, job_id), blocks in self.held.items():
            waits |= job_id in steps[k].wait_for
            if blocks & written:
                self.checked_blocks += 1
                assert job_id in steps[k].wait_for, (
                    f"connector {k}'s store {job_id} reads blocks {sorted(blocks & written)} "
                    f"this step writes; its wait_for={steps[k].wait_for}"
                )
        if waits or self.rng.random() < 0.15:
            self.flush()  # the workers wait for those (FIFO: for every job before them too)
        w = engine.worker
        w.bind_connector_metadata(meta)
        w.handle_preemptions(meta)
        w.start_load_kv(None)
        engine._forward(so)
        # Admitted requests read their prefix (cache hits, loads) in this step's forward, once
        # it wrote its tokens: a hit may be on a block another request computes in this step.
        for new in so.scheduled_new_reqs:
            req = sched.requests[new.req_id]
            assert_computed_kv(
                engine.kv_caches,
                engine.group_of_layer,
                new.block_ids,
                list(req.all_token_ids),
                new.num_computed_tokens,
                new.req_id,
            )
        w.wait_for_save()
        for k, step in enumerate(steps):
            self.submitted[k].extend(job.job_id for job in [*step.loads, *step.stores])
            for job in step.stores:
                self.held[k, job.job_id] = set(job.device_blocks.tolist())
        kv_out = worker_output(w, so.finished_req_ids)
        w.clear_connector_metadata()
        self._feed(so, kv_out)

    def _feed(self, so: Any, kv_out: Any) -> None:
        sched = self.engine.scheduler
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            req = sched.requests[req_id]
            sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
        for eo in sched.update_from_output(so, runner_output(req_ids, sampled, kv_out)).values():
            for o in eo.outputs:
                if o.finish_reason is not None:
                    self.live.discard(o.request_id)

    def walk(self, num_steps: int) -> None:
        from vllm.v1.request import RequestStatus

        rng, sched = self.rng, self.engine.scheduler
        for _ in range(num_steps):
            r = rng.random()
            if r < 0.35 and len(self.live) < 8:
                self.add()
            elif r < 0.45 and self.live:
                req_id = rng.choice(sorted(self.live))
                sched.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
                self.live.discard(req_id)
            elif r < 0.50:
                sched.reset_prefix_cache()  # refused while blocks are in use
            elif r < 0.53 and all(
                q.status == RequestStatus.RUNNING or q.num_computed_tokens == 0
                for q in sched.requests.values()
            ):
                # Preempts every running request (vLLM raises if others hold blocks: a load).
                sched.reset_prefix_cache(reset_running_requests=True)
            self.step()
        for _ in range(200):
            if not (self.live or sched.has_requests() or any(self.submitted)) and not any(
                side.scheduler.num_jobs_in_flight() for side in self.sides
            ):
                return
            self.flush()
            self.step()
        raise AssertionError(f"requests {sorted(self.live)} did not finish")

    def assert_clean(self) -> None:
        """Nothing left: no fence, released request, pin, pending write, job or request."""
        for side, worker in zip(self.sides, self.workers, strict=True):
            s = side.scheduler
            assert not s.has_fences() and not s._released
            assert s.num_jobs_in_flight() == 0 and s.num_requests() == 0
            stats = side.manager.get_stats()
            assert stats.pinned == 0 and stats.pending_writes == 0
            assert not (side._requests or side._loads or side._loading or side._local_hits)
            assert not side._allocated and not worker._jobs
        assert not self.engine.scheduler.requests


@pytest.mark.parametrize(("num_connectors", "seed"), [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1)])
def test_every_step_waits_for_the_held_stores_it_overwrites(
    vllm_loaded: None, num_connectors: int, seed: int
) -> None:
    walk = _Walk(seed, num_connectors)
    try:
        walk.walk(300)
    finally:
        walk.opened.set()  # a failed check leaves no transfer held at the gate
    walk.assert_clean()
    assert walk.checked_blocks > 0  # some step did reuse a block a held store read
