"""KVTierConnector under vLLM's async scheduling: the real `AsyncScheduler` with two batches in
flight, as `EngineCore.step_with_batch_queue` runs it (step N+1 is scheduled before step N's
output is processed, and the sampled tokens are placeholders until then).

The stand-in worker runs each step's connector calls and forward pass in schedule order, as
vLLM's worker does; every sampled token is the same, so the worker knows a placeholder's token.
"""

from __future__ import annotations

import importlib.util
import sys
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import (
    BLOCK_SIZE,
    build_halves,
    finish_worker_step,
    make_kv_cache_config,
    make_request,
    make_vllm_config,
    token_value,
)

SAMPLED = 7
PROMPT = list(range(1, 70))  # 69 tokens


@pytest.fixture(scope="module")
def vllm_loaded() -> Iterator[None]:
    import vllm.v1.core.sched.async_scheduler  # noqa: F401

    import kvtier.integrations.vllm  # noqa: F401

    yield


class AsyncEngine:
    """The real AsyncScheduler, a worker-side connector on CPU tensors, and a batch queue of 2."""

    def __init__(self, extra: dict[str, Any], num_blocks: int = 64) -> None:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        cfg = make_vllm_config("KVTierConnector", extra, num_blocks, "kvtier.integrations.vllm")
        cfg.scheduler_config.async_scheduling = True
        assert cfg.max_concurrent_batches == 2
        kv_cache_config = make_kv_cache_config(num_blocks)
        self.scheduler, self.worker, self.kv_caches = build_halves(
            cfg, kv_cache_config, scheduler_class=AsyncScheduler
        )
        self.queue: deque[tuple[Any, Any]] = deque()
        self.finished: set[str] = set()

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> Any:
        request = make_request(req_id, prompt, max_tokens)
        self.scheduler.add_request(request)
        return request

    @staticmethod
    def tokens(request: Any, n: int) -> list[int]:
        known = list(request.all_token_ids)
        return known + [SAMPLED] * max(0, n - len(known))

    def _execute(self, so: Any) -> Any:

        w, sched = self.worker, self.scheduler
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.handle_preemptions(so.kv_connector_metadata)
        w.start_load_kv(None)
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            n = so.num_scheduled_tokens[req_id]
            req = sched.requests[req_id]
            end = req.num_computed_tokens  # counts this step's tokens already
            tokens = self.tokens(req, end)
            table = sched.kv_cache_manager.get_block_ids(req_id)
            for name, t in self.kv_caches.items():
                layer = int(name.split(".")[2])
                for p in range(end - n, end):
                    t[table[0][p // BLOCK_SIZE], :, p % BLOCK_SIZE, :] = token_value(
                        tokens, p, layer
                    )
            sampled.append([] if req.is_prefill_chunk else [SAMPLED])
        w.wait_for_save()
        w.worker_side.transfer.wait(list(w.worker_side._jobs))
        return finish_worker_step(w, so, req_ids, sampled)

    def _process_oldest(self) -> None:
        so, out = self.queue.popleft()
        for eo in self.scheduler.update_from_output(so, out).values():
            self.finished.update(o.request_id for o in eo.outputs if o.finish_reason)

    def step(self) -> None:
        """Schedule and run one batch; process the oldest once two are in flight."""
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            self.queue.append((so, self._execute(so)))
        if len(self.queue) == 2 or (self.queue and not self.scheduler.has_requests()):
            self._process_oldest()

    def run_until_idle(self, max_steps: int = 300) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and not self.queue:
                return
            self.step()
        raise AssertionError("the engine never went idle")


def test_async_scheduling_stores_prompt_and_output_and_loads_them_back(
    vllm_loaded: None,
) -> None:
    from vllm.v1.request import RequestStatus

    engine = AsyncEngine({"cpu_bytes_to_use": "8MiB", "offload_prompt_only": False})
    engine.add("a", PROMPT, max_tokens=40)
    engine.run_until_idle()
    assert "a" in engine.finished
    side = engine.scheduler.connector.scheduler_side
    # 69 + 39 computed tokens (the last sampled one never is): 6 full blocks.
    assert side.manager.get_stats().stores == 6
    assert engine.scheduler.reset_prefix_cache()
    for t in engine.kv_caches.values():
        t.zero_()  # only a load from kvtier can bring the bytes back

    tokens = [*PROMPT, *[SAMPLED] * 39, *range(500, 520)]
    engine.add("b", tokens, max_tokens=2)
    for _ in range(20):
        engine.step()
        if engine.scheduler.requests["b"].status == RequestStatus.RUNNING:
            break
    assert side.manager.get_stats().loads == 6
    table = engine.scheduler.kv_cache_manager.get_block_ids("b")
    for name, t in engine.kv_caches.items():
        layer = int(name.split(".")[2])
        for p in range(6 * BLOCK_SIZE):
            got = t[table[0][p // BLOCK_SIZE], :, p % BLOCK_SIZE, :]
            assert bool((got == token_value(tokens, p, layer)).all()), (name, p)
    engine.run_until_idle()
    assert side.scheduler.num_jobs_in_flight() == 0
    assert side.scheduler.num_requests() == 0
    assert side.manager.get_stats().pinned == 0
    assert not engine.worker.worker_side._jobs
    assert not engine.scheduler.requests
