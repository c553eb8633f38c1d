"""Streaming-input sessions (vLLM's resumable requests) through the real vLLM Scheduler with
KVTierConnector: every turn's prompt is offloaded under `offload_prompt_only`, and only
blocks whose KV the engine has computed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import BLOCK_SIZE, Engine, make_engine, make_request
from test_vllm import (
    EXTRA,
    assert_no_leaks,
    expect_loaded,
    kvtier_side,
    step_until_running,
    vllm_loaded,
)

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm

TURN_1 = list(range(1, 41))  # 40 tokens
TURN_2 = list(range(100, 130))  # 30 tokens
TURN_3 = list(range(200, 240))  # 40 tokens
MAX_TOKENS = 4  # a turn samples 4 tokens; vLLM keeps the first 3 in the next prompt
TURN_1_OUTPUT = 20  # the first turn's output completes block 2 (tokens 32-47) while it runs


def add_input(
    engine: Engine,
    req_id: str,
    tokens: list[int],
    resumable: bool = True,
    max_tokens: int = MAX_TOKENS,
) -> Any:
    """Send one input chunk of a streaming session, as vLLM's `AsyncLLM` does: the first
    chunk opens the session, later ones (same request id) extend its prompt, and a
    non-resumable request with the same id closes it."""
    # vLLM extends the first chunk's list in place as the session grows
    request = make_request(req_id, list(tokens), max_tokens, resumable=resumable)
    engine.scheduler.add_request(request)
    return request


def step_checking_stores(engine: Engine, session: Any) -> None:
    """One engine step; every block the session's stores read holds prompt KV computed by
    the end of the step's forward pass."""
    # Both as vLLM scheduled the step (update_from_output may apply a queued input chunk).
    prompt, computed = session.num_prompt_tokens, session.num_computed_tokens
    so = engine.step()
    computed += so.num_scheduled_tokens.get(session.request_id, 0)
    stores = [j for j in so.kv_connector_metadata.step.stores if j.req_id == session.request_id]
    if not stores:
        return
    computed = min(computed, prompt)
    table = engine.scheduler.kv_cache_manager.get_block_ids(session.request_id)
    for job in stores:
        index = {b: i for i, b in enumerate(table[job.group])}
        for block in job.device_blocks.tolist():
            assert (index[block] + 1) * BLOCK_SIZE <= computed, (block, computed)


def finish_turn(engine: Engine, session: Any) -> None:
    """Step until the session's current turn has sampled its tokens and waits for input."""
    from vllm.v1.request import RequestStatus

    for _ in range(50):
        step_checking_stores(engine, session)
        if session.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            return
    raise AssertionError(f"turn did not end: {session.status}")


def expected_chunks(session: Any) -> int:
    return int(session.num_prompt_tokens) // BLOCK_SIZE


@pytest.mark.parametrize(
    ("queued", "budget"),
    [(False, 512), (True, 512), (False, 16)],
    ids=["input-while-waiting", "input-queued-while-running", "chunked-prefill"],
)
def test_every_turn_of_a_streaming_session_is_offloaded(
    vllm_loaded: None, queued: bool, budget: int
) -> None:
    """With `offload_prompt_only` (the default) the host tier holds each turn's prompt, which
    vLLM extends by the previous turn's output and the new input, not only the first turn's;
    a turn's output is stored only once it is prompt, and a later request with the session's
    prefix loads the right bytes."""
    engine = make_engine("KVTierConnector", EXTRA, max_num_batched_tokens=budget)
    side = kvtier_side(engine)
    session = add_input(engine, "s", TURN_1, max_tokens=TURN_1_OUTPUT)
    if queued:
        engine.step()
        add_input(engine, "s", TURN_2)  # queued: applied when turn 1 ends
    finish_turn(engine, session)
    if not queued:
        # Still 40 prompt tokens: block 2, computed, holds output and waits.
        assert expected_chunks(session) == 2
        assert side.manager.get_stats().stores == 2
        add_input(engine, "s", TURN_2)
    # 40 + 19 kept outputs + 30 = 89 prompt tokens: 5 full blocks.
    assert session.num_prompt_tokens == len(TURN_1) + TURN_1_OUTPUT - 1 + len(TURN_2)
    finish_turn(engine, session)
    assert side.manager.get_stats().stores == expected_chunks(session) == 5
    add_input(engine, "s", TURN_3)
    finish_turn(engine, session)
    # 89 + 3 + 40 = 132 prompt tokens: 8 full blocks, each stored once.
    assert side.manager.get_stats().stores == expected_chunks(session) == 8
    prompt = list(session.prompt_token_ids)
    add_input(engine, "s", [0], resumable=False)  # closes the session
    for _ in range(5):
        engine.step()
    assert "s" not in engine.scheduler.requests

    # Only kvtier can bring the session's prefix back; its bytes are the computed ones.
    assert engine.scheduler.reset_prefix_cache()
    for t in engine.kv_caches.values():
        t.zero_()
    engine.add("b", [*prompt, 5])
    engine.step()
    step_until_running(engine, "b")
    expect_loaded(engine, "b", [*prompt, 5], 8 * BLOCK_SIZE)
    engine.run_until(["b"])
    assert side.manager.get_stats().loads == 8
    assert_no_leaks(engine)


def test_a_turns_last_block_is_stored_under_the_next_turns_hash(vllm_loaded: None) -> None:
    """vLLM drops a turn's last sampled token (never computed) and the hash of the block it
    completed; kvtier stores that block only once the next input has been computed into it,
    under its new hash. A session waiting for input has offloaded nothing of its output."""
    from kvtier.base import LookupResult, ReqContext, make_offload_key

    engine = make_engine("KVTierConnector", EXTRA)
    side = kvtier_side(engine)

    def lookup(block_hash: bytes) -> LookupResult:
        result: LookupResult = side.manager.lookup(
            make_offload_key(block_hash, 0), ReqContext("probe")
        )
        return result

    # 44 prompt tokens; the 4 outputs (positions 44-47) complete block 2.
    session = add_input(engine, "s", list(range(1, 45)))
    finish_turn(engine, session)
    assert len(session.block_hashes) == 3
    dropped = session.block_hashes[2]
    assert side.manager.get_stats().stores == 2
    add_input(engine, "s", list(range(300, 310)))
    assert session.num_prompt_tokens == 44 + MAX_TOKENS - 1 + 10  # 57: 3 full blocks
    assert session.block_hashes[2] != dropped
    finish_turn(engine, session)
    assert side.manager.get_stats().stores == 3
    assert lookup(session.block_hashes[2]) is LookupResult.HIT
    assert lookup(dropped) is LookupResult.MISS
    add_input(engine, "s", [0], resumable=False)
    for _ in range(5):
        engine.step()
    assert_no_leaks(engine)


def test_a_session_preempted_in_a_later_turn_loads_that_turns_prompt(vllm_loaded: None) -> None:
    """A session preempted while it decodes its second turn is looked up again up to that
    turn's prompt (89 tokens: 5 full blocks), not the first turn's 40 (2 blocks)."""
    engine = make_engine("KVTierConnector", EXTRA)
    side = kvtier_side(engine)
    session = add_input(engine, "s", TURN_1, max_tokens=TURN_1_OUTPUT)
    finish_turn(engine, session)
    add_input(engine, "s", TURN_2, max_tokens=12)
    while session.num_computed_tokens <= session.num_prompt_tokens:
        step_checking_stores(engine, session)
    assert session.status.name == "RUNNING"
    assert side.manager.get_stats().stores == expected_chunks(session) == 5
    assert side.scheduler.num_jobs_in_flight() == 0
    prompt = list(session.prompt_token_ids)
    assert engine.scheduler.reset_prefix_cache(reset_running_requests=True)
    for t in engine.kv_caches.values():
        t.zero_()  # only a load from kvtier can bring the session's prefix back
    so = engine.step()
    assert "s" in so.preempted_req_ids
    [load] = so.kv_connector_metadata.step.loads
    assert load.req_id == "s" and len(load.device_blocks) == 5
    step_until_running(engine, "s")
    expect_loaded(engine, "s", prompt, 5 * BLOCK_SIZE)
    finish_turn(engine, session)
    add_input(engine, "s", [0], resumable=False)  # closes the session
    for _ in range(5):
        engine.step()
    assert_no_leaks(engine)
