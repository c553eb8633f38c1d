"""A seeded random fault fuzz of KVTierConnector through the real vLLM Scheduler.

Each seed drives one engine (small GPU block count, so vLLM preempts; small host tier, so
kvtier evicts; one or two KV-cache groups) through a random mix of requests sharing random
prefixes, aborts, prefix-cache resets with and without preempting the running requests (the
device KV zeroed afterwards, so only kvtier loads bring bytes back), connector resets, and
transfer faults (failed and slow loads and stores, under both of vLLM's load failure
policies). After every step, every block vLLM counts as computed for a running request holds
exactly the stand-in model's bytes for that request's tokens; at the end nothing leaks. See
engine.py for the stand-ins.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import time
from pathlib import Path
from typing import Literal

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)


sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import BLOCK_SIZE, Engine, ZeroAfterFence, assert_computed_kv, make_engine
from test_vllm import _swap_transfer, assert_no_leaks, vllm_loaded

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm

SEEDS = range(40)


def check_running(engine: Engine) -> None:
    """Every block vLLM counts as computed for a running request holds that request's bytes."""
    from vllm.v1.request import RequestStatus

    sched = engine.scheduler
    for req in sched.running:
        if req.status != RequestStatus.RUNNING:
            continue
        n = req.num_computed_tokens
        if n == 0:
            continue
        assert_computed_kv(
            engine.kv_caches,
            engine.group_of_layer,
            sched.kv_cache_manager.get_block_ids(req.request_id),
            list(req.all_token_ids),
            n,
            f"request {req.request_id}",
        )


class Fuzz:
    """One seed's engine, request mix and fault plan."""

    def __init__(self, seed: int) -> None:
        rng = self.rng = random.Random(seed)
        self.seed = seed
        self.num_gpu_blocks = rng.choice([10, 14, 20, 32])
        # Two full-attention groups (hybrid-style) draw a block each from one shared pool.
        num_groups = rng.choice([1, 1, 2])
        self.policy: Literal["recompute", "fail"] = rng.choice(["recompute", "recompute", "fail"])
        extra = {
            "num_slots": rng.choice([3, 6, 12, 48]),
            "blocks_per_chunk": rng.choice([1, 1, 2]),
        }
        self.engine = make_engine(
            "KVTierConnector",
            extra,
            num_gpu_blocks=self.num_gpu_blocks * num_groups,
            num_groups=num_groups,
            load_failure_policy=self.policy,
            max_num_batched_tokens=rng.choice([128, 512]),
        )
        self.p_fail_load = rng.choice([0.0, 0.1, 0.3])
        self.p_fail_store = rng.choice([0.0, 0.1])
        self.p_slow = rng.choice([0.0, 0.3, 0.6])
        _swap_transfer(self.engine, self._inject)
        w = self.engine.worker
        self.zero = ZeroAfterFence(w, self.engine.kv_caches)
        # Up to (num_gpu_blocks - 2) blocks a request, so each one fits alone.
        self.max_len = (self.num_gpu_blocks - 2) * BLOCK_SIZE
        self.prefixes = [
            [rng.randrange(1, 1000) for _ in range(rng.randrange(8, self.max_len // 2))]
            for _ in range(3)
        ]
        self.next_id = 0
        self.aborted = 0
        self.resets = 0

    def _inject(self, job_id: int, kind: str) -> None:
        # From the copy threads: decided by (seed, job, kind) alone, not by thread order.
        r = random.Random(f"{self.seed}:{job_id}:{kind}")
        if self.p_slow and r.random() < self.p_slow:
            time.sleep(0.002)
        p = self.p_fail_load if kind == "load" else self.p_fail_store
        if p and r.random() < p:
            raise RuntimeError(f"injected {kind} failure")

    def add(self) -> None:
        rng = self.rng
        max_tokens = rng.choice([1, 2, 4, 9, 20])
        limit = self.max_len - max_tokens
        prompt: list[int] = []
        if rng.random() < 0.8:
            base = rng.choice(self.prefixes)
            prompt = base[: rng.randrange(1, len(base) + 1)]
        prompt = prompt + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 40))]
        self.engine.add(f"r{self.next_id}", prompt[:limit], max_tokens=max_tokens)
        self.next_id += 1

    def abort(self) -> None:
        from vllm.v1.request import RequestStatus

        live = [r for r, req in self.engine.scheduler.requests.items() if not req.is_finished()]
        if live:
            victim = self.rng.choice(sorted(live))
            self.engine.scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            self.aborted += 1

    def reset(self) -> None:
        rng = self.rng
        sched = self.engine.scheduler
        preempt = rng.random() < 0.5
        try:
            ok = sched.reset_prefix_cache(reset_running_requests=preempt)
        except RuntimeError:
            # vLLM refuses while blocks are held (loads in flight, held finished requests),
            # having preempted the running requests already.
            ok = False
        if ok:
            self.resets += 1
            if rng.random() < 0.8:
                self.zero.armed = True

    def step(self) -> None:
        self.engine.step()
        check_running(self.engine)

    def run(self, num_steps: int = 60) -> None:
        rng = self.rng
        for _ in range(num_steps):
            for _ in range(rng.choice([0, 0, 1, 1, 2])):
                self.add()
            r = rng.random()
            if r < 0.06:
                self.abort()
            elif r < 0.18:
                self.reset()
            elif r < 0.20:
                self.engine.scheduler.reset_connector_cache()
            self.step()
        for _ in range(400):
            if not self.engine.scheduler.has_requests():
                break
            self.step()
        for _ in range(3):
            self.step()
        live = sorted(self.engine.scheduler.requests)
        assert not live, f"requests {live} never finished"
        assert_no_leaks(self.engine)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_faults_keep_kv_exact_and_leak_nothing(vllm_loaded: None, seed: int) -> None:
    fuzz = Fuzz(seed)
    try:
        fuzz.run()
    finally:
        fuzz.engine.worker.shutdown()
