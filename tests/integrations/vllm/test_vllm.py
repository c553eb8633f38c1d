"""kvtier inside vLLM 0.33 on CPU: the real vLLM Scheduler driving KVTierConnector (and
vLLM's OffloadingConnector with a kvtier policy), with kvtier's CPU transfer engine moving
the bytes of CPU tensors shaped like vLLM's KV cache. See engine.py for the stand-ins."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import (
    BLOCK_SIZE,
    Engine,
    make_engine,
    make_kv_cache_config,
    make_vllm_config,
    runner_output,
    step_until_output,
    token_value,
)

EXTRA = {"cpu_bytes_to_use": "8MiB"}
MODULE = "kvtier.integrations.vllm"
PROMPT = list(range(1, 70))  # 69 tokens: 4 full 16-token blocks are offloaded


@pytest.fixture(scope="module")
def vllm_loaded() -> Iterator[None]:
    """Import vLLM once for the module (about 15-30 s)."""
    import vllm.v1.core.sched.scheduler  # noqa: F401

    import kvtier.integrations.vllm  # noqa: F401

    yield


def _swap_transfer(engine: Engine, inject: Callable[[int, str], None]) -> None:
    from kvtier.connector import OffloadingWorker
    from kvtier.transfer import CPUTransferWorker

    ws = engine.worker.worker_side
    old = ws.transfer
    new = CPUTransferWorker(old.registration, old.pool, fault_injector=inject)
    old.shutdown()
    ws.transfer = new
    ws._worker = OffloadingWorker(new)


def fail_loads(job_id: int, kind: str) -> None:
    """A fault injector (`_swap_transfer`) that fails every load and lets stores through."""
    if kind == "load":
        raise RuntimeError("injected load failure")


def gate(engine: Engine) -> threading.Event:
    """Hold every transfer of `engine` until the returned event is set."""
    opened = threading.Event()

    def hold(job_id: int, kind: str) -> None:
        opened.wait(60)

    _swap_transfer(engine, hold)
    return opened


def stores_held(engine: Engine) -> threading.Event:
    """Request "a" run 3 steps with every transfer held at the gate: its stores in flight."""
    opened = gate(engine)
    engine.add("a", PROMPT)
    for _ in range(3):
        engine.step(settle=False)
    assert engine.kvtier_worker()._jobs, "expected a's stores in flight"
    return opened


def kvtier_side(engine: Engine) -> Any:
    return engine.scheduler.connector.scheduler_side


def assert_no_leaks(engine: Engine) -> None:
    side = kvtier_side(engine)
    stats = side.manager.get_stats()
    assert stats.pinned == 0 and stats.pending_writes == 0
    assert side.scheduler.num_jobs_in_flight() == 0
    assert side.scheduler.num_requests() == 0
    assert not (side._requests or side._loads or side._loading)
    assert not engine.worker.worker_side._jobs
    assert not engine.scheduler.requests


def expect_loaded(engine: Engine, req_id: str, tokens: list[int], num_tokens: int) -> None:
    table = engine.scheduler.kv_cache_manager.get_block_ids(req_id)
    for name, t in engine.kv_caches.items():
        g = engine.group_of_layer[name]
        layer = int(name.split(".")[2])
        for p in range(num_tokens):
            got = t[table[g][p // BLOCK_SIZE], :, p % BLOCK_SIZE, :]
            assert bool((got == token_value(tokens, p, layer)).all()), (name, p)


def store_a_then_forget_on_device(engine: Engine) -> None:
    engine.add("a", PROMPT)
    engine.run_until(["a"])
    assert engine.scheduler.reset_prefix_cache()
    for t in engine.kv_caches.values():
        t.zero_()  # only a load from kvtier can bring the bytes back


def step_until_running(engine: Engine, req_id: str) -> None:
    from vllm.v1.request import RequestStatus

    for _ in range(50):
        req = engine.scheduler.requests[req_id]
        if req.status == RequestStatus.RUNNING:
            return
        engine.step()
    raise AssertionError(f"{req_id} never ran")


def load_back(engine: Engine, req_id: str, prompt: list[int]) -> int:
    """Tokens of `prompt` that a new request `req_id` loads from kvtier alone (vLLM's prefix
    cache reset and every device block zeroed first), its bytes checked, nothing leaked."""
    assert engine.scheduler.reset_prefix_cache()
    for t in engine.kv_caches.values():
        t.zero_()  # only a load from kvtier can bring the bytes back
    engine.add(req_id, prompt)
    engine.step()
    loaded = int(engine.scheduler.requests[req_id].num_computed_tokens)
    step_until_running(engine, req_id)
    expect_loaded(engine, req_id, prompt, loaded)
    engine.run_until([req_id])
    assert_no_leaks(engine)
    return loaded


@pytest.mark.parametrize("num_groups", [1, 2])
def test_second_request_loads_the_stored_bytes(vllm_loaded: None, num_groups: int) -> None:
    engine = make_engine("KVTierConnector", EXTRA, num_groups=num_groups)
    store_a_then_forget_on_device(engine)
    assert kvtier_side(engine).manager.get_stats().stores == 4 * num_groups
    b = engine.add("b", [*PROMPT, 900, 901])
    engine.step()
    assert b.status.name == "WAITING_FOR_REMOTE_KVS"
    assert b.num_computed_tokens == 4 * BLOCK_SIZE
    step_until_running(engine, "b")
    expect_loaded(engine, "b", [*PROMPT, 900, 901], 4 * BLOCK_SIZE)
    engine.run_until(["b"])
    # vLLM's own count of what the connector served, summed over the steps' stats: a (69
    # tokens) found nothing, b (71 tokens, none left on the device) got its 4 stored blocks.
    served = [s.connector_prefix_cache_stats for s in engine.stats]
    assert sum(s.requests for s in served) == 2
    assert sum(s.queries for s in served) == len(PROMPT) + len(PROMPT) + 2
    assert sum(s.hits for s in served) == 4 * BLOCK_SIZE
    assert kvtier_side(engine).manager.get_stats().loads == 4 * num_groups
    assert_no_leaks(engine)


def _b_loads_what_a_stored(engine: Engine) -> None:
    """The worker moves the right bytes: "b" extends "a", whose KV was stored, then dropped."""
    store_a_then_forget_on_device(engine)
    engine.add("b", [*PROMPT, 900])
    step_until_running(engine, "b")
    expect_loaded(engine, "b", [*PROMPT, 900], 4 * BLOCK_SIZE)
    engine.run_until(["b"])
    assert_no_leaks(engine)


def test_transfer_cpus_reach_the_copy_threads(vllm_loaded: None) -> None:
    """`transfer_cpus` in kv_connector_extra_config places the worker's copy threads, and
    the worker still moves the right bytes."""
    from kvtier.transfer import NativeCPUTransferWorker
    from kvtier.transfer.native import library

    if library() is None or not hasattr(os, "sched_getaffinity"):
        pytest.skip("needs the compiled engine and Linux thread affinity")
    cpu = max(os.sched_getaffinity(0))
    engine = make_engine("KVTierConnector", {**EXTRA, "transfer_cpus": [cpu]})
    transfer = engine.worker.worker_side.transfer
    assert isinstance(transfer, NativeCPUTransferWorker)
    assert transfer.copy_cpus == (cpu,)
    assert not transfer.avoid_submitter_cpu  # pinned threads stay where they were put
    _b_loads_what_a_stored(engine)


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ({"transfer_cpus": [65535]}, r"transfer_cpus=\(65535,\).*no CPU \[65535\]"),
        ({"transfer_backend": "cuda"}, r"transfer_backend='cuda'.*needs KV tensors on a CUDA"),
    ],
)
def test_a_transfer_setting_the_worker_cannot_honour_is_a_config_error(
    vllm_loaded: None, setting: dict[str, Any], needle: str
) -> None:
    from helpers import pool_closes
    from kvtier.config import ConfigError
    from kvtier.transfer.native import library

    if "transfer_cpus" in setting and library() is None:
        pytest.skip("needs the compiled engine, which places copy threads")
    refused = pytest.raises(ConfigError, match=needle)
    with pool_closes() as closed, refused:
        make_engine("KVTierConnector", {**EXTRA, **setting})
    assert len(closed) == 1  # the host pool made before the worker is unpinned at once


def test_shutdown_unpins_the_host_pool(vllm_loaded: None) -> None:
    """It may be many GiB of pinned memory, and the collector may not get to it in time."""
    from helpers import pool_closes

    engine = make_engine("KVTierConnector", EXTRA)
    _b_loads_what_a_stored(engine)
    transfer = engine.worker.worker_side.transfer
    with pool_closes() as closed:
        engine.worker.shutdown()
    assert closed == [transfer.pool]


@pytest.mark.parametrize("avoid", [True, False])
def test_transfer_avoid_submitter_cpu_reaches_the_worker(vllm_loaded: None, avoid: bool) -> None:
    from kvtier.transfer import NativeCPUTransferWorker
    from kvtier.transfer.native import library

    if library() is None:
        pytest.skip("needs the compiled engine")
    engine = make_engine("KVTierConnector", {**EXTRA, "transfer_avoid_submitter_cpu": avoid})
    transfer = engine.worker.worker_side.transfer
    assert isinstance(transfer, NativeCPUTransferWorker)
    assert transfer.avoid_submitter_cpu is avoid
    _b_loads_what_a_stored(engine)


def test_preemption_waits_for_stores_in_flight(vllm_loaded: None) -> None:
    engine = make_engine("KVTierConnector", EXTRA)
    opened = gate(engine)
    engine.add("a", PROMPT, max_tokens=8)
    first = engine.step(settle=False)
    store_ids = [j.job_id for j in first.kv_connector_metadata.step.stores]
    assert store_ids
    # Preempt the running request while its store still reads its blocks.
    engine.scheduler.reset_prefix_cache(reset_running_requests=True)
    opened.set()
    so = engine.step()
    assert so.kv_connector_metadata.step.wait_for == store_ids
    assert engine.worker.worker_side.transfer._in_flight.isdisjoint(store_ids)
    engine.run_until(["a"])
    assert kvtier_side(engine).manager.get_stats().stores == 4
    assert_no_leaks(engine)


def test_abort_during_load_frees_blocks_once(vllm_loaded: None) -> None:
    from vllm.v1.request import RequestStatus

    engine = make_engine("KVTierConnector", EXTRA)
    store_a_then_forget_on_device(engine)
    opened = gate(engine)
    engine.add("b", [*PROMPT, 5])
    so = engine.step(settle=False)
    assert so.kv_connector_metadata.step.loads
    engine.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert "b" in engine.scheduler.requests  # blocks held while the load writes them
    opened.set()
    for _ in range(5):
        engine.step()
    assert "b" not in engine.scheduler.requests
    assert_no_leaks(engine)


def test_abort_during_a_failing_load_forgets_the_request(vllm_loaded: None) -> None:
    """The load's failure arrives after request_finished: nothing of the request may stay."""
    from vllm.v1.request import RequestStatus

    engine = make_engine("KVTierConnector", EXTRA, load_failure_policy="recompute")
    store_a_then_forget_on_device(engine)
    opened = threading.Event()

    def fail_loads_later(job_id: int, kind: str) -> None:
        if kind == "load":
            opened.wait(60)
            raise RuntimeError("injected load failure")

    _swap_transfer(engine, fail_loads_later)
    engine.add("b", [*PROMPT, 5])
    assert engine.step(settle=False).kv_connector_metadata.step.loads
    engine.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    opened.set()
    for _ in range(5):
        engine.step()
    assert "b" not in engine.scheduler.requests
    assert_no_leaks(engine)


def test_abort_with_stores_in_flight_holds_blocks_until_sent(vllm_loaded: None) -> None:
    """With `release_finished_blocks` off (on by default, test_release_finished_blocks_vllm)."""
    from vllm.v1.request import RequestStatus

    engine = make_engine("KVTierConnector", {**EXTRA, "release_finished_blocks": False})
    opened = gate(engine)
    engine.add("a", PROMPT, max_tokens=8)
    engine.step(settle=False)
    engine.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    engine.step(settle=False)
    assert "a" in engine.scheduler.requests  # the store still reads its blocks
    opened.set()
    for _ in range(5):
        engine.step()
    assert "a" not in engine.scheduler.requests
    assert kvtier_side(engine).manager.get_stats().stores == 4
    assert_no_leaks(engine)


def test_reset_mid_flight_ignores_old_jobs(vllm_loaded: None) -> None:
    engine = make_engine("KVTierConnector", EXTRA)
    opened = gate(engine)
    engine.add("a", PROMPT)
    engine.step(settle=False)
    assert engine.scheduler.reset_connector_cache()
    side = kvtier_side(engine)
    assert side.manager.get_stats().used_slots == 4  # quarantined for the job in flight
    opened.set()
    engine.run_until(["a"])
    # The pre-reset store was ignored; the request stored its chunks again after it.
    stats = side.manager.get_stats()
    assert stats.stores == 4 and stats.ready == 4 and stats.used_slots == 4
    assert engine.scheduler.reset_prefix_cache()
    for t in engine.kv_caches.values():
        t.zero_()
    engine.add("b", [*PROMPT, 3])
    step_until_running(engine, "b")
    expect_loaded(engine, "b", [*PROMPT, 3], 4 * BLOCK_SIZE)
    engine.run_until(["b"])
    assert_no_leaks(engine)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_load_follows_vllm_policy(
    vllm_loaded: None, policy: Literal["recompute", "fail"]
) -> None:
    engine = make_engine("KVTierConnector", EXTRA, load_failure_policy=policy)
    store_a_then_forget_on_device(engine)

    _swap_transfer(engine, fail_loads)
    b = engine.add("b", [*PROMPT, 8])
    engine.step()
    assert b.status.name == "WAITING_FOR_REMOTE_KVS"
    if policy == "recompute":
        step_until_output(engine, b)
        # vLLM recomputed the prompt: b's KV is the stand-in model's, never the zeros.
        expect_loaded(engine, "b", [*PROMPT, 8], len(PROMPT))
        engine.run_until(["b"])
        assert b.num_output_tokens == 4
    else:
        engine.run_until(["b"])
        assert b.status.name == "FINISHED_ERROR"
    assert_no_leaks(engine)


def offloading_connector_engine(extra: dict[str, Any], **engine_kwargs: Any) -> Engine:
    """An engine with vLLM's own OffloadingConnector (`engine_kwargs` go to `make_engine`).
    Its worker needs a GPU: each step completes every job at once instead."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )

    engine = make_engine(
        "OffloadingConnector", extra, module_path=None, with_worker=False, **engine_kwargs
    )

    def step(settle: bool = True) -> Any:
        so = engine.scheduler.schedule()
        meta = so.kv_connector_metadata
        done = OffloadingWorkerMetadata()
        for job_id in [*meta.load_jobs, *meta.store_jobs]:
            done.mark_completed(job_id)
        engine.outputs.append(so)
        _feed(engine, so, done, {job.req_id for job in meta.load_jobs.values()})
        return so

    engine.step = step  # type: ignore[method-assign]
    return engine


def test_offloading_connector_with_kvtier_policy(vllm_loaded: None) -> None:
    from kvtier.integrations.vllm.policy import KVTierPolicyAdapter
    from kvtier.policies import ARCPolicy

    extra = {
        "cpu_bytes_to_use": 1 << 20,
        "cache_policy_module_path": "kvtier.integrations.vllm.policy",
        "eviction_policy": "kvtier_arc",
    }
    engine = offloading_connector_engine(extra)
    manager = engine.scheduler.connector.connector_scheduler.manager
    assert isinstance(manager._policy, KVTierPolicyAdapter)
    assert isinstance(manager._policy.inner, ARCPolicy)
    engine.add("a", PROMPT)
    engine.run_until(["a"])
    assert engine.scheduler.reset_prefix_cache()
    b = engine.add("b", [*PROMPT, 4])
    engine.step()
    assert b.num_computed_tokens == 4 * BLOCK_SIZE  # served by the CPU tier
    engine.run_until(["b"])
    # Fill past capacity: the kvtier policy picks the victims, the tier keeps working.
    capacity = manager._num_chunks
    num_fill = capacity // 2 + 2  # two chunks each: more than the tier holds
    for i in range(num_fill):
        engine.add(f"c{i}", [1000 + 100 * i + j for j in range(40)])
    engine.run_until([f"c{i}" for i in range(num_fill)])
    assert len(manager._policy.chunks) == capacity
    assert len(manager._policy.inner) == len(manager._policy.chunks)


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_kvtier_policy_counts_reuse_reported_at_request_end(vllm_loaded: None, name: str) -> None:
    """vLLM's manager reports a request's reuses (here: a device prefix hit offered again) only
    through on_request_finished; the kvtier policy must keep that prefix, as vLLM's own does."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    def key(tag: str) -> Any:
        return make_offload_key(tag.encode().ljust(32, b"."), 0)

    def run(policy: str, module: str | None) -> list[Any]:
        manager = CPUOffloadingManager(4, policy, module)
        evicted: list[Any] = []
        for req_id, tags in [("a", "a1 a2"), ("b", "b1 b2"), ("c", "a1 a2"), ("d", "d1 d2")]:
            ctx = ReqContext(req_id)
            manager.on_new_request(ctx)
            keys = [key(t) for t in tags.split()]
            for i, k in enumerate(keys):
                ctx.set_offload_key_position(k, BLOCK_SIZE * (i + 1))
            out = manager.prepare_store(keys, ctx)
            assert out is not None
            manager.complete_store(out.keys_to_store, ctx)
            manager.on_request_finished(ctx)
            evicted += out.evicted_keys
        return sorted(evicted)

    expected = run(name, None)
    assert expected == sorted([key("b1"), key("b2")])  # "c" reused a1, a2
    assert run(f"kvtier_{name}", "kvtier.integrations.vllm.policy") == expected


def test_kvaware_counts_a_loaded_chunk_once_for_the_request_that_loaded_it(
    vllm_loaded: None,
) -> None:
    """vLLM's mark_evictable names no request: the adapter attributes the unpin to the request
    that accessed the chunk, so its end-of-request touch is not a second use."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from kvtier.integrations.vllm.policy import KVTierPolicyAdapter
    from kvtier.policies import KVAwarePolicy

    manager = CPUOffloadingManager(8, "kvtier_kvaware", "kvtier.integrations.vllm.policy")
    adapter = manager._policy
    assert isinstance(adapter, KVTierPolicyAdapter)
    keys = [make_offload_key(f"k{i}".encode().ljust(32, b"."), 0) for i in range(2)]
    for req_id, load in (("a", False), ("b", True)):
        ctx = ReqContext(req_id)
        manager.on_new_request(ctx)
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, BLOCK_SIZE * (i + 1))
        if load:
            manager.prepare_load(keys, ctx)
            manager.complete_load(keys, ctx)
        else:
            out = manager.prepare_store(keys, ctx)
            assert out is not None
            manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
    inner = adapter.inner
    assert isinstance(inner, KVAwarePolicy)
    # One use by "a" (its store) and one by "b" (its load), not three.
    assert [inner._sketch.estimate_key(bytes(k)) for k in keys] == [2, 2]
    assert not adapter._readers  # forgotten once the request finished


def _feed(engine: Engine, so: Any, worker_meta: Any, recving: set[str]) -> None:
    from vllm.v1.outputs import KVConnectorOutput

    req_ids = list(so.num_scheduled_tokens)
    sampled = [
        [7]
        if engine.scheduler.requests[r].num_computed_tokens
        >= engine.scheduler.requests[r].num_tokens
        else []
        for r in req_ids
    ]
    out = runner_output(
        req_ids,
        sampled,
        KVConnectorOutput(finished_recving=recving, kv_connector_worker_meta=worker_meta),
    )
    for eo in engine.scheduler.update_from_output(so, out).values():
        for o in eo.outputs:
            if o.finish_reason is not None:
                engine.finished.add(o.request_id)


def test_cpu_budget_is_the_engines_not_each_workers(vllm_loaded: None) -> None:
    """As in vLLM's own offloading, cpu_bytes_to_use bounds the host memory of all workers
    together: with two tensor-parallel workers each keeps half as many chunks."""
    from kvtier.config import ConfigError
    from kvtier.integrations.vllm.setup import resolve_setup

    kv_cache_config = make_kv_cache_config(64)
    slots = {}
    for tp in (1, 2, 4):
        cfg = make_vllm_config("KVTierConnector", EXTRA, 64, MODULE, tensor_parallel_size=tp)
        slots[tp] = resolve_setup(cfg, kv_cache_config).num_slots
    assert slots[1] == 2 * slots[2] == 4 * slots[4] > 0

    # A budget that holds one chunk per worker but not two.
    one_chunk = (8 << 20) // slots[1]
    cfg = make_vllm_config("KVTierConnector", {"cpu_bytes_to_use": one_chunk}, 64, MODULE)
    assert resolve_setup(cfg, kv_cache_config).num_slots == 1
    cfg = make_vllm_config(
        "KVTierConnector", {"cpu_bytes_to_use": one_chunk}, 64, MODULE, tensor_parallel_size=2
    )
    with pytest.raises(
        ConfigError, match=f"on each of 2 workers; expected at least {2 * one_chunk}"
    ):
        resolve_setup(cfg, kv_cache_config)


def test_each_worker_reports_a_job_once(vllm_loaded: None) -> None:
    """With two workers a job completes on one report from each; a second report from the
    same worker is refused, not taken for the other worker's."""
    from kvtier.integrations.vllm.metadata import KVTierWorkerMetadata

    engine = make_engine("KVTierConnector", EXTRA, with_worker=False, tensor_parallel_size=2)
    side = kvtier_side(engine)
    engine.add("a", PROMPT)
    so = engine.scheduler.schedule()
    (job,) = so.kv_connector_metadata.step.stores
    twice = KVTierWorkerMetadata([(job.job_id, True, 0, 0, 0.0), (job.job_id, True, 0, 0, 0.0)])
    with pytest.raises(ValueError, match=f"job {job.job_id} was already reported by worker 0"):
        _feed(engine, so, twice, set())
    assert side.scheduler.job_ids_in_flight() == [job.job_id]
    assert side.manager.get_stats().pending_writes == 4

    both = KVTierWorkerMetadata([(job.job_id, True, 0, 0, 0.0)]).aggregate(
        KVTierWorkerMetadata([(job.job_id, True, 1, 0, 0.0)])
    )
    _feed(engine, so, both, set())
    assert side.scheduler.num_jobs_in_flight() == 0
    assert side.manager.get_stats().ready == 4


def test_a_refused_report_leaves_both_halves_agreeing(vllm_loaded: None) -> None:
    """Reports are applied one worker at a time, each with the connector's own count of the
    load's reports: a refused worker leaves no load counted by one half and not the other."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvtier.integrations.vllm.metadata import KVTierWorkerMetadata

    engine = make_engine("KVTierConnector", EXTRA, with_worker=False, tensor_parallel_size=2)
    side = kvtier_side(engine)

    def step(report: Callable[[Any], list[tuple[int, bool, int, int, float]]]) -> Any:
        so = engine.scheduler.schedule()
        meta = so.kv_connector_metadata
        req_ids = list(so.num_scheduled_tokens)
        out = runner_output(
            req_ids,
            [[7] for _ in req_ids],
            KVConnectorOutput(
                finished_recving={j.req_id for j in meta.step.loads},
                finished_sending=set(meta.held),
                kv_connector_worker_meta=KVTierWorkerMetadata(report(meta.step)),
            ),
        )
        for eo in engine.scheduler.update_from_output(so, out).values():
            engine.finished.update(o.request_id for o in eo.outputs if o.finish_reason)
        return meta.step

    def every_job_once_per_worker(s: Any) -> list[tuple[int, bool, int, int, float]]:
        return [(j.job_id, True, w, 0, 0.0) for j in (*s.loads, *s.stores) for w in (0, 1)]

    engine.add("a", PROMPT, max_tokens=1)
    while "a" not in engine.finished or engine.scheduler.has_requests():
        step(every_job_once_per_worker)
    assert engine.scheduler.reset_prefix_cache()
    engine.add("b", [*PROMPT, 4], max_tokens=1)
    loads: list[Any] = []
    while not loads:  # b's load, reported by neither worker yet
        loads = list(step(lambda s: []).loads)
    (load,) = loads
    assert side._loads[load.job_id] == ["b", 2]

    # Worker 0 reports the load; worker 1 reports it twice and is refused.
    bad = KVTierWorkerMetadata(
        [(load.job_id, True, 0, 0, 0.0), *[(load.job_id, True, 1, 0, 0.0)] * 2]
    )
    with pytest.raises(ValueError, match="already reported by worker 1"):
        side.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=bad))
    assert side._loads[load.job_id] == ["b", 1]  # worker 0's report, counted by both halves
    side.update_connector_output(
        KVConnectorOutput(
            kv_connector_worker_meta=KVTierWorkerMetadata([(load.job_id, True, 1, 0, 0.0)])
        )
    )
    assert not side._loads and not side._loading
    assert side.scheduler.num_jobs_in_flight() == 0


def test_worker_reports_carry_its_rank_within_the_engine(vllm_loaded: None) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.integrations.vllm import KVTierConnector

    cfg = make_vllm_config("KVTierConnector", EXTRA, 64, MODULE, tensor_parallel_size=2)
    cfg.parallel_config.rank = 3  # the second worker of the second data-parallel engine
    kv_cache_config = make_kv_cache_config(64)
    worker = KVConnectorFactory.create_connector(
        config=cfg, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config
    )
    assert isinstance(worker, KVTierConnector) and worker.worker_side is not None
    assert worker.worker_side.rank == 1
    worker.worker_side._results.append((5, True, worker.worker_side.rank, 0, 0.0))
    meta = worker.build_connector_worker_meta()
    assert meta is not None and meta.results == [(5, True, 1, 0, 0.0)]


def test_overrides_and_type_imports_match_the_pinned_vllm(vllm_loaded: None) -> None:
    """Every vLLM method kvtier overrides keeps vLLM's parameters, and every name the vLLM
    modules import for type checking exists in the installed vLLM."""
    import ast
    import importlib
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA
    from vllm.v1.kv_offload.cpu.policies.base import CachePolicy

    from kvtier.integrations.vllm import KVTierConnector
    from kvtier.integrations.vllm.policy import KVTierPolicyAdapter

    for cls, bases in [(KVTierConnector, (KVConnectorBase_V1, SupportsHMA)),
                       (KVTierPolicyAdapter, (CachePolicy,))]:  # fmt: skip
        for name, ours in vars(cls).items():
            base = next((getattr(b, name) for b in bases if hasattr(b, name)), None)
            if base is None or not callable(ours) or name.startswith("__"):
                continue
            ours_params = list(inspect.signature(ours).parameters.values())
            base_params = list(inspect.signature(base).parameters.values())
            assert [(p.name, p.kind) for p in ours_params] == [
                (p.name, p.kind) for p in base_params
            ], f"{cls.__name__}.{name}"
    src = Path(__file__).resolve().parents[3] / "src" / "kvtier" / "integrations" / "vllm"
    for path in sorted(src.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm"):
                module = importlib.import_module(node.module or "")
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{path.name}: {node.module}.{alias.name}"


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"cpu_bytes_to_use": "8MiB", "evicton_policy": "arc"}, "unknown key"),
        ({"cpu_bytes_to_use": "lots"}, "cpu_bytes_to_use='lots'"),
        ({"cpu_bytes_to_use": "8MiB", "eviction_policy": "fifo"}, "eviction_policy='fifo'"),
        ({}, "cpu_bytes_to_use"),
    ],
)
def test_bad_config_fails_at_start_up(
    vllm_loaded: None, extra: dict[str, Any], needle: str
) -> None:
    from kvtier.config import ConfigError

    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        make_engine("KVTierConnector", extra, with_worker=False)
