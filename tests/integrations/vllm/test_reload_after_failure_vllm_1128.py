"""Through vLLM's real scheduler: a request whose kvtier load failed is offered hits again once
vLLM preempts it.

vLLM (kv_load_failure_policy "recompute") recomputes the tokens of a failed load. kvtier then
offers that request nothing until vLLM preempts it; readmitted, it is offered what the tier
holds again. Before, the vLLM adapter offered such a request nothing for the rest of its life,
so a preempted request recomputed chunks the tier still held. A load that always fails costs
at most one failed load per preemption (plus the first), never a loop.

Every load's device blocks are filled with NaN before the load starts, so a token vLLM counts
as computed holds the stand-in model's KV only if the load (or the forward pass) wrote it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import BLOCK_SIZE, Engine, make_engine, step_until_output
from test_fuzz_faults import check_running
from test_vllm import (
    EXTRA,
    PROMPT,
    _swap_transfer,
    assert_no_leaks,
    kvtier_side,
    store_a_then_forget_on_device,
    vllm_loaded,
)

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm


class Loads:
    """Fails every load while `failing` is set, records each load's outcome, and fills each
    load's device blocks with NaN before it runs."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.failing = False
        self.ok: set[int] = set()
        self.failed: set[int] = set()
        self._lock = threading.Lock()  # the copy threads report concurrently
        _swap_transfer(engine, self._inject)
        self._handle = engine.worker.handle_preemptions
        engine.worker.handle_preemptions = self._poison

    def _inject(self, job_id: int, kind: str) -> None:
        if kind != "load":
            return
        with self._lock:
            (self.failed if self.failing else self.ok).add(job_id)
        if self.failing:
            raise RuntimeError("injected load failure")

    def _poison(self, meta: Any) -> None:
        # After the fence: no earlier store still reads these blocks.
        self._handle(meta)
        for job in meta.step.loads:
            blocks = job.device_blocks.tolist()
            for name, t in self.engine.kv_caches.items():
                if self.engine.group_of_layer[name] == job.group:
                    t[blocks] = float("nan")

    def jobs_of(self, req_id: str) -> list[int]:
        """The load jobs kvtier sent for `req_id`, in order."""
        return [
            job.job_id
            for so in self.engine.outputs
            for job in so.kv_connector_metadata.step.loads
            if job.req_id == req_id
        ]


def step_checked(engine: Engine, steps: int = 1) -> None:
    """`steps` engine steps, each followed by `check_running`."""
    for _ in range(steps):
        engine.step()
        check_running(engine)


@pytest.mark.parametrize("preemption", ["memory", "reset"])
def test_a_request_whose_load_failed_loads_again_after_a_preemption(
    vllm_loaded: None, preemption: str
) -> None:
    """b's first load fails and vLLM recomputes; preempted (by another request's growth, or by
    `reset_prefix_cache(reset_running_requests=True)`) and readmitted, b is offered the tier's
    chunks again and loads them, byte-exact."""
    engine = make_engine(
        "KVTierConnector", EXTRA, num_gpu_blocks=12, load_failure_policy="recompute"
    )
    side = kvtier_side(engine)
    store_a_then_forget_on_device(engine)
    loads = Loads(engine)
    loads.failing = True
    others = []
    if preemption == "memory":
        # c runs ahead of b and outgrows the device cache: vLLM preempts b (the latest), and c
        # takes over b's blocks, so b's prefix is gone from the device when it comes back.
        others.append(engine.add("c", list(range(500, 520)), max_tokens=150))
    b = engine.add("b", [*PROMPT, 8], max_tokens=100 if preemption == "memory" else 12)
    step_until_output(engine, b)
    check_running(engine)  # the recomputed prompt
    assert len(loads.jobs_of("b")) == 1 and len(loads.failed) == 1
    assert side.scheduler.load_jobs_failed == 1
    step_checked(engine, 3)
    assert len(loads.jobs_of("b")) == 1  # no offer between the failure and a preemption
    loads.failing = False

    if preemption == "reset":
        for _ in range(5):
            if not side.scheduler.num_jobs_in_flight():
                break
            step_checked(engine)
        assert engine.scheduler.reset_prefix_cache(reset_running_requests=True)
    else:
        for _ in range(100):
            if b.num_preemptions:
                break
            step_checked(engine)
    assert b.num_preemptions == 1

    for _ in range(200):
        if len(loads.jobs_of("b")) > 1:
            break
        step_checked(engine)
    else:
        raise AssertionError("b was never offered the tier's chunks after its preemption")
    assert b.status.name == "WAITING_FOR_REMOTE_KVS"
    assert b.num_computed_tokens >= 4 * BLOCK_SIZE  # the prompt chunks a stored
    for _ in range(5):
        if b.status.name == "RUNNING":
            break
        step_checked(engine)
    assert b.status.name == "RUNNING"
    again = loads.jobs_of("b")[1:]
    assert len(again) == 1 and set(again) <= loads.ok
    assert side.scheduler.load_jobs_failed == 1
    assert side.manager.get_stats().loads >= 4

    for _ in range(300):
        if not engine.scheduler.has_requests():
            break
        step_checked(engine)
    assert b.num_output_tokens == b.max_tokens
    assert all(r.num_output_tokens == r.max_tokens for r in others)
    assert len(loads.jobs_of("b")) == 2 and b.num_preemptions == 1
    assert_no_leaks(engine)
    engine.worker.shutdown()


PREFIXES = [list(range(base, base + len(PROMPT))) for base in (1, 300, 600)]


def test_loads_that_always_fail_cost_one_try_per_preemption(vllm_loaded: None) -> None:
    """Every load fails. Requests whose prefixes the tier holds outgrow the device cache and are
    preempted again and again, by each other and by resets that preempt every running request:
    each is offered the tier's chunks after each preemption, its load fails, and vLLM
    recomputes. All finish, with exact KV, after at most one failed load per preemption (plus
    the first), and nothing leaks."""
    engine = make_engine(
        "KVTierConnector", EXTRA, num_gpu_blocks=12, load_failure_policy="recompute"
    )
    side = kvtier_side(engine)
    for k, prefix in enumerate(PREFIXES):
        engine.add(f"s{k}", prefix, max_tokens=1)
    engine.run_until([f"s{k}" for k in range(len(PREFIXES))])
    assert side.manager.get_stats().stores == 4 * len(PREFIXES)
    assert engine.scheduler.reset_prefix_cache()
    loads = Loads(engine)
    loads.failing = True
    requests = [
        engine.add(f"r{k}", [*prefix, 8], max_tokens=40) for k, prefix in enumerate(PREFIXES)
    ]
    by_id = {r.request_id: r for r in requests}
    # Per request, its preemption count when each of its loads was sent.
    tries: dict[str, list[int]] = {r.request_id: [] for r in requests}
    resets = 0
    for step in range(400):
        if not engine.scheduler.has_requests():
            break
        if step % 15 == 14:
            # vLLM raises when a request waiting for its load holds blocks, having preempted
            # the running requests all the same.
            with contextlib.suppress(RuntimeError):
                resets += engine.scheduler.reset_prefix_cache(reset_running_requests=True)
        step_checked(engine)
        for job in engine.outputs[-1].kv_connector_metadata.step.loads:
            tries[job.req_id].append(by_id[job.req_id].num_preemptions)
    else:
        raise AssertionError("the requests never finished")
    assert resets >= 2
    for r in requests:
        assert r.num_output_tokens == 40, r.request_id
        n = tries[r.request_id]
        # One try at arrival, then at most one after each preemption.
        assert n and n == sorted(set(n)), (r.request_id, n)
        assert len(n) <= r.num_preemptions + 1, (r.request_id, n, r.num_preemptions)
    # Offered again after a preemption (before: one try in a request's life).
    assert max(len(n) for n in tries.values()) >= 2, tries
    sent = [j for r in requests for j in loads.jobs_of(r.request_id)]
    assert sum(len(n) for n in tries.values()) == len(sent)
    assert not loads.ok and loads.failed == set(sent)
    assert side.scheduler.load_jobs_failed == len(sent)
    assert_no_leaks(engine)
    engine.worker.shutdown()
