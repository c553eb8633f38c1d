"""KVTierConnector with two pipeline stages through the real vLLM Scheduler and vLLM's own
`KVOutputAggregator`: each stage's worker holds its own layers, and the stages may hold
different numbers of them (vLLM splits layers unevenly for some layer counts, or as
`VLLM_PP_LAYER_PARTITION` says), while the scheduler sizes the host tier from the first
stage's KV-cache config."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine as stand_in
from engine import (
    BLOCK_SIZE,
    make_request,
    make_vllm_config,
    runner_output,
    token_value,
    worker_output,
)
from test_vllm import MODULE, vllm_loaded

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm

NUM_BLOCKS = 64
PROMPT_A = list(range(1, 70))  # 4 full blocks
PROMPT_B = [300 + i for i in range(40)]  # 2 full blocks


def stage_kv_cache_config(*groups: range) -> Any:
    """This stage's full-attention groups, one per range of layer indices (an empty range: a
    group whose layers all live on other stages), each layer its own tensor."""
    return stand_in.make_kv_cache_config(NUM_BLOCKS, layer_groups=list(groups))


def page_bytes_per_layer() -> int:
    return 2 * stand_in.NUM_KV_HEADS * BLOCK_SIZE * stand_in.HEAD_SIZE * 4


@dataclass
class PipelineEngine:
    """vLLM's Scheduler (built from the first stage's config, as vLLM's engine core does) and
    one worker-side connector per stage, their outputs merged by vLLM's KVOutputAggregator."""

    scheduler: Any
    workers: list[Any]
    kv_caches: list[dict[str, torch.Tensor]]
    group_of_layer: dict[str, int]
    aggregator: Any
    finished: set[str] = field(default_factory=set)

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 2) -> Any:
        request = make_request(req_id, prompt, max_tokens)
        self.scheduler.add_request(request)
        return request

    def step(self) -> Any:

        so = self.scheduler.schedule()
        req_ids = list(so.num_scheduled_tokens)
        outputs = []
        for w, caches in zip(self.workers, self.kv_caches, strict=True):
            earlier = list(w.worker_side._jobs)
            w.bind_connector_metadata(so.kv_connector_metadata)
            w.handle_preemptions(so.kv_connector_metadata)
            w.start_load_kv(None)
            self._forward(so, caches)
            w.wait_for_save()
            if earlier:
                w.worker_side.transfer.wait(earlier)
            kv_out = worker_output(w, so.finished_req_ids)
            w.clear_connector_metadata()
            sampled = []
            for r in req_ids:
                req = self.scheduler.requests[r]
                sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
            outputs.append(runner_output(req_ids, sampled, kv_out))
        out = self.aggregator.aggregate(outputs, output_rank=len(outputs) - 1)
        for eo in self.scheduler.update_from_output(so, out).values():
            self.finished.update(o.request_id for o in eo.outputs if o.finish_reason)
        return so

    def _forward(self, so: Any, caches: dict[str, torch.Tensor]) -> None:
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            end = req.num_computed_tokens
            tokens = list(req.all_token_ids)
            tables = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            for name, t in caches.items():
                layer = int(name.split(".")[2])
                table = tables[self.group_of_layer[name]]
                for p in range(end - n, end):
                    t[table[p // BLOCK_SIZE], :, p % BLOCK_SIZE, :] = token_value(tokens, p, layer)

    def run_until(self, done: list[str], max_steps: int = 100) -> None:
        for _ in range(max_steps):
            if set(done) <= self.finished and not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError(f"{sorted(set(done) - self.finished)} did not finish")


def make_pipeline(extra: dict[str, Any], stages: list[Any]) -> PipelineEngine:
    """One worker per stage; `stages` holds each stage's KV-cache config, the first stage's
    also the scheduler's (as vLLM's engine core gives it)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    cfg = make_vllm_config("KVTierConnector", extra, NUM_BLOCKS, MODULE)
    cfg.parallel_config.pipeline_parallel_size = len(stages)
    cfg.parallel_config.world_size = len(stages)
    configs = stages
    scheduler = Scheduler(
        vllm_config=cfg,
        kv_cache_config=configs[0],
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )
    workers, caches = [], []
    for rank, kv_cache_config in enumerate(configs):
        cfg.parallel_config.rank = rank
        w = KVConnectorFactory.create_connector(
            config=cfg, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config
        )
        c = stand_in.make_kv_caches(kv_cache_config)
        w.register_kv_caches(c)
        workers.append(w)
        caches.append(c)
    cfg.parallel_config.rank = 0
    aggregator = KVOutputAggregator.from_connector(workers[0], len(stages))
    group_of_layer = {
        n: g for c in configs for g, grp in enumerate(c.kv_cache_groups) for n in grp.layer_names
    }
    return PipelineEngine(scheduler, workers, caches, group_of_layer, aggregator)


def step_until_running(engine: PipelineEngine, req_id: str) -> None:
    from vllm.v1.request import RequestStatus

    for _ in range(20):
        if engine.scheduler.requests[req_id].status == RequestStatus.RUNNING:
            return
        engine.step()
    raise AssertionError(f"{req_id} never ran")


def expect_loaded(engine: PipelineEngine, req_id: str, tokens: list[int], n: int) -> None:
    tables = engine.scheduler.kv_cache_manager.get_block_ids(req_id)
    for caches in engine.kv_caches:
        for name, t in caches.items():
            layer = int(name.split(".")[2])
            table = tables[engine.group_of_layer[name]]
            for p in range(n):
                got = t[table[p // BLOCK_SIZE], :, p % BLOCK_SIZE, :]
                assert bool((got == token_value(tokens, p, layer)).all()), (name, p)


def test_a_later_stage_with_more_layers_holds_every_slot_the_scheduler_hands_out(
    vllm_loaded: None,
) -> None:
    """Stage 0 holds 2 layers, stage 1 holds 3. `cpu_bytes_to_use` sizes the tier from the
    scheduler's (stage 0's) pages: 6 chunks. Stage 1's worker must keep 6 slots too (each of
    its own, larger, share of a chunk), or the stores into slots 4 and 5 fail on it and the
    tier holds 4 chunks while the scheduler hands out 6."""
    slots = 6
    extra = {"cpu_bytes_to_use": 2 * slots * 2 * page_bytes_per_layer()}
    engine = make_pipeline(
        extra, [stage_kv_cache_config(range(0, 2)), stage_kv_cache_config(range(2, 5))]
    )
    side = engine.scheduler.connector.scheduler_side
    assert side.setup.num_slots == slots

    engine.add("a", PROMPT_A)
    engine.add("b", PROMPT_B)
    engine.step()
    # Both pools hold the scheduler's 6 chunks: stage 1's grew before its first job.
    assert [w.worker_side.transfer.pool.num_slots for w in engine.workers] == [slots, slots]
    engine.run_until(["a", "b"])
    stats = side.manager.get_stats()
    assert stats.stores == 6 and stats.ready == 6

    assert engine.scheduler.reset_prefix_cache()
    for caches in engine.kv_caches:
        for t in caches.values():
            t.zero_()
    engine.add("c", [*PROMPT_B, 5], max_tokens=8)
    engine.add("d", [*PROMPT_A, 5], max_tokens=8)
    step_until_running(engine, "c")
    step_until_running(engine, "d")
    expect_loaded(engine, "c", [*PROMPT_B, 5], 2 * BLOCK_SIZE)
    expect_loaded(engine, "d", [*PROMPT_A, 5], 4 * BLOCK_SIZE)
    engine.run_until(["c", "d"])
    assert side.manager.get_stats().loads == 6


def test_a_group_with_no_layers_on_a_stage_does_not_fail_that_stages_jobs(
    vllm_loaded: None,
) -> None:
    """A KV-cache group may live on one stage only (a drafter's layers, on the last stage; or
    layers of one kind placed together): vLLM gives the other stages that group with no
    layers. Its jobs have nothing to move there and succeed; they must not fail the stage's
    report, or no chunk of that group is ever stored and no prefix ever hits."""
    stages = [
        stage_kv_cache_config(range(0, 2), range(0)),
        stage_kv_cache_config(range(0), range(2, 4)),
    ]
    engine = make_pipeline({"num_slots": 16}, stages)
    side = engine.scheduler.connector.scheduler_side

    engine.add("a", PROMPT_A)
    engine.run_until(["a"])
    stats = side.manager.get_stats()
    assert stats.stores == 2 * 4 and stats.failed_stores == 0

    assert engine.scheduler.reset_prefix_cache()
    for caches in engine.kv_caches:
        for t in caches.values():
            t.zero_()
    b = engine.add("b", [*PROMPT_A, 5], max_tokens=8)
    engine.step()
    assert b.num_computed_tokens == 4 * BLOCK_SIZE  # offered by kvtier, both groups
    step_until_running(engine, "b")
    expect_loaded(engine, "b", [*PROMPT_A, 5], 4 * BLOCK_SIZE)
    engine.run_until(["b"])
    assert side.manager.get_stats().loads == 2 * 4
