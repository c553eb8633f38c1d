"""The worker-side connector under vLLM 0.33's worker call orders that the stand-in engine's
plain step does not make: the same metadata handed over twice, and a step whose
`wait_for_save` never comes (speculative decoding on a pipeline stage other than the last,
where vLLM's `sample_tokens` returns before `finalize_kv_connector`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import BLOCK_SIZE, Engine, make_engine, runner_output, worker_output
from test_pipeline_stages import PROMPT_A, make_pipeline, stage_kv_cache_config
from test_vllm import (
    EXTRA,
    PROMPT,
    assert_no_leaks,
    expect_loaded,
    kvtier_side,
    vllm_loaded,
)

__all__ = ["vllm_loaded"]


def _step(engine: Engine, *, repeat: int = 1, save: bool = True, settle: bool = True) -> Any:
    """One engine step whose worker calls follow vLLM's model runner: `repeat` runs the
    connector calls of the step that many times with the same metadata; `save=False` leaves
    out `wait_for_save` and `clear_connector_metadata`, as vLLM's non-last pipeline stage
    does with speculative decoding."""

    w = engine.worker
    side = engine.kvtier_worker()
    earlier = list(side._jobs)
    so = engine.scheduler.schedule()
    meta = so.kv_connector_metadata
    for _ in range(repeat):
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
    engine._forward(so)
    if save:
        for _ in range(repeat):
            w.wait_for_save()
    if settle and earlier:
        side.transfer.wait(earlier)
    kv_out = worker_output(w, so.finished_req_ids)
    if save:
        w.clear_connector_metadata()
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        req = engine.scheduler.requests[req_id]
        sampled.append([engine.sampled_token] if req.num_computed_tokens >= req.num_tokens else [])
    out = runner_output(req_ids, sampled, kv_out)
    for eo in engine.scheduler.update_from_output(so, out).values():
        engine.finished.update(o.request_id for o in eo.outputs if o.finish_reason is not None)
    return so


def _run_until(engine: Engine, done: list[str], **kwargs: Any) -> None:
    for _ in range(100):
        if set(done) <= engine.finished and not engine.scheduler.has_requests():
            return
        _step(engine, **kwargs)
    raise AssertionError(f"{sorted(set(done) - engine.finished)} did not finish")


def test_the_same_metadata_twice_submits_and_reports_each_job_once(vllm_loaded: None) -> None:
    """Every connector call of every step made twice with the same metadata: each job runs
    once and is reported once, its request finishes, and nothing stays held."""
    engine = make_engine("KVTierConnector", EXTRA)
    engine.add("a", PROMPT)
    _run_until(engine, ["a"], repeat=2)
    side = kvtier_side(engine)
    assert side.manager.get_stats().stores == 4
    assert engine.scheduler.reset_prefix_cache()
    for t in engine.kv_caches.values():
        t.zero_()
    engine.add("b", [*PROMPT, 3], max_tokens=8)
    for _ in range(20):
        _step(engine, repeat=2)
        if engine.scheduler.requests["b"].status.name == "RUNNING":
            break
    expect_loaded(engine, "b", [*PROMPT, 3], 4 * BLOCK_SIZE)
    _run_until(engine, ["b"], repeat=2)
    assert side.manager.get_stats().loads == 4
    assert_no_leaks(engine)
    assert not engine.kvtier_worker()._in_flight and not engine.kvtier_worker()._held


def test_a_step_without_wait_for_save_still_stores_and_releases(vllm_loaded: None) -> None:
    """vLLM 0.33 defers `wait_for_save` past the drafter with speculative decoding, and a
    pipeline stage other than the last never reaches it. The stores of such a step run when
    the next step starts, and its held requests are released: nothing is left behind."""
    engine = make_engine("KVTierConnector", EXTRA)
    engine.add("a", PROMPT)
    _run_until(engine, ["a"], save=False)
    side = kvtier_side(engine)
    assert side.manager.get_stats().stores == 4
    assert_no_leaks(engine)
    assert not engine.kvtier_worker()._in_flight and not engine.kvtier_worker()._held
    # The bytes stored that way are the forward pass's: a later request loads them.
    assert engine.scheduler.reset_prefix_cache()
    for t in engine.kv_caches.values():
        t.zero_()
    engine.add("b", [*PROMPT, 3], max_tokens=8)
    for _ in range(20):
        _step(engine, save=False)
        if engine.scheduler.requests["b"].status.name == "RUNNING":
            break
    expect_loaded(engine, "b", [*PROMPT, 3], 4 * BLOCK_SIZE)
    _run_until(engine, ["b"], save=False)
    assert kvtier_side(engine).manager.get_stats().loads == 4
    assert_no_leaks(engine)


def test_preemption_waits_for_a_store_whose_wait_for_save_never_came(vllm_loaded: None) -> None:
    """A request preempted right after a step that never reached `wait_for_save`: its store
    must run, and be waited for, before vLLM hands its blocks to another request."""
    engine = make_engine("KVTierConnector", EXTRA)
    engine.add("a", PROMPT, max_tokens=8)
    first = _step(engine, save=False)
    store_ids = [j.job_id for j in first.kv_connector_metadata.step.stores]
    assert store_ids
    engine.scheduler.reset_prefix_cache(reset_running_requests=True)
    so = _step(engine, save=False)
    assert so.kv_connector_metadata.step.wait_for == store_ids
    _run_until(engine, ["a"], save=False)
    assert kvtier_side(engine).manager.get_stats().stores == 4
    assert_no_leaks(engine)


def _stages_with_a_group_each() -> list[Any]:
    """Two stages; group 0's layers all on the first, group 1's (a drafter's, say) all on
    the last: each stage has the other's group with no layers."""
    return [
        stage_kv_cache_config(range(0, 2), range(0)),
        stage_kv_cache_config(range(0), range(2, 4)),
    ]


def _run_a_and_check_every_store_reported(engine: Any) -> None:
    """Run request a on both stages: each of its 4 chunks stored on each, none failed,
    nothing left in flight, and vLLM holding no request."""
    engine.add("a", PROMPT_A)
    engine.run_until(["a"])
    side = engine.scheduler.connector.scheduler_side
    stats = side.manager.get_stats()
    assert stats.stores == 2 * 4 and stats.failed_stores == 0
    assert side.scheduler.num_jobs_in_flight() == 0
    assert not engine.scheduler.requests


def test_the_same_metadata_twice_with_a_group_not_on_this_stage(vllm_loaded: None) -> None:
    """The jobs of a group without layers on a stage succeed there at once; handed the same
    metadata twice, the stage still reports each of them once."""
    engine = make_pipeline({"num_slots": 16}, _stages_with_a_group_each())
    for w in engine.workers:
        for name in ("start_load_kv", "wait_for_save"):
            call = getattr(w, name)

            def twice(*args: Any, _call: Any = call) -> None:
                _call(*args)
                _call(*args)

            setattr(w, name, twice)
    _run_a_and_check_every_store_reported(engine)
    assert all(not w.worker_side._jobs for w in engine.workers)


def test_a_stage_that_never_gets_wait_for_save_still_reports(vllm_loaded: None) -> None:
    """vLLM 0.33 with speculative decoding: the first stage never gets `wait_for_save`
    (its `sample_tokens` returns before `finalize_kv_connector`). Its stores run when the
    next step starts, so both stages report every job and vLLM frees every block."""
    engine = make_pipeline({"num_slots": 16}, _stages_with_a_group_each())
    engine.workers[0].wait_for_save = lambda: None
    _run_a_and_check_every_store_reported(engine)
