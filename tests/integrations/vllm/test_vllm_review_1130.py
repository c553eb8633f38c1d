"""vLLM rewrites a streaming session's block hashes; kvtier, which caches a chunk's key the first
time it reads it, never holds a key whose hash vLLM rewrote (docs/vllm.md, "Streaming input").

Every key kvtier looks up, stores, loads or touches is checked against the hashes of the
request's current tokens, recomputed from scratch with vLLM's hasher, through the real
Scheduler. The last test shows the check catches a stale key."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import Engine, make_engine, make_request
from test_eagle_proof import drafter_kv_cache_config, set_speculative
from test_streaming_input import add_input
from test_vllm import assert_no_leaks, kvtier_side, vllm_loaded

from kvtier.base import OffloadKey, make_offload_key

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm

# A 44-token first turn samples tokens 44-47: the last, which vLLM drops when the next chunk
# arrives, completes block 2, so vLLM rewrites that block's hash.
TURN_1 = list(range(1, 45))
EXTRA = {"cpu_bytes_to_use": "8MiB", "offload_prompt_only": False}


def finish_turn(engine: Engine, session: Any) -> None:
    """Step until the session's turn has sampled its tokens and waits for more input (the
    output's blocks are stored too here, unlike under `offload_prompt_only`)."""
    from vllm.v1.request import RequestStatus

    for _ in range(60):
        engine.step()
        if session.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            return
    raise AssertionError(f"turn did not end: {session.status}")


def check_keys_against_tokens(engine: Engine) -> list[int]:
    """Wrap the manager's key-taking calls: each key must be one of the request's current
    blocks' keys. Returns a one-item list counting the keys checked."""
    side = kvtier_side(engine)
    manager, groups = side.manager, side.setup.groups
    checked = [0]

    def current_keys(req_id: str) -> set[OffloadKey] | None:
        request = engine.scheduler.requests.get(req_id)
        if request is None:
            return None
        fresh = make_request("probe", list(request.all_token_ids), 1)
        return {make_offload_key(h, g) for h in fresh.block_hashes for g in groups}

    def wrap(name: str, keys_of: Callable[..., list[OffloadKey]]) -> None:
        call = getattr(manager, name)

        def checked_call(*args: Any) -> Any:
            ctx = args[-1]
            want = current_keys(ctx.req_id)
            if want is not None:
                for key in keys_of(*args):
                    checked[0] += 1
                    assert key in want, f"{name} of a stale key for {ctx.req_id}: {key.hex()}"
            return call(*args)

        setattr(manager, name, checked_call)

    wrap("lookup", lambda key, ctx: [key])
    for name in ("prepare_store", "prepare_load", "touch"):
        wrap(name, lambda keys, ctx: list(keys))
    return checked


@pytest.mark.parametrize(
    ("extra", "drafter"),
    [(EXTRA, False), ({"cpu_bytes_to_use": "8MiB"}, False), (EXTRA, True)],
    ids=["all-tokens", "prompt-only", "eagle-drafter"],
)
def test_no_key_kvtier_uses_is_stale_after_vllm_rewrites_a_hash(
    vllm_loaded: None, extra: dict[str, Any], drafter: bool
) -> None:
    options: dict[str, Any] = {}
    if drafter:
        options = {
            "configure": set_speculative("eagle"),
            "kv_cache_config": drafter_kv_cache_config(64),
            "num_groups": 2,
        }
    engine = make_engine("KVTierConnector", extra, **options)
    checked = check_keys_against_tokens(engine)
    session = add_input(engine, "s", TURN_1)
    finish_turn(engine, session)
    before = list(session.block_hashes)
    add_input(engine, "s", list(range(300, 330)), max_tokens=20)
    after = session.block_hashes[: len(before)]
    rewritten = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    assert rewritten == [2]  # the scenario does what it is for
    # Preempted in the second turn, with the device KV gone: the session loads from kvtier.
    while session.num_computed_tokens <= session.num_prompt_tokens:
        engine.step()
    assert engine.scheduler.reset_prefix_cache(reset_running_requests=True)
    for tensor in engine.kv_caches.values():
        tensor.zero_()
    finish_turn(engine, session)
    engine.add("b", [*list(session.all_token_ids)[:80], 9, 9])  # shares the session's prefix
    add_input(engine, "s", list(range(400, 420)), max_tokens=13)
    finish_turn(engine, session)
    add_input(engine, "s", [0], resumable=False)
    engine.run_until(["b"])
    engine.run_until(["s"])
    # Keys were checked on every path, loads included: the preempted session and "b" hit.
    assert checked[0] >= 30
    assert kvtier_side(engine).manager.get_stats().loads > 0
    assert_no_leaks(engine)


def test_the_check_catches_a_key_cached_before_the_rewrite(vllm_loaded: None) -> None:
    # As an eager key cache would: block 2's key read before the next chunk rewrites its hash.
    engine = make_engine("KVTierConnector", EXTRA)
    check_keys_against_tokens(engine)
    session = add_input(engine, "s", TURN_1)
    finish_turn(engine, session)
    scheduler = kvtier_side(engine).scheduler
    scheduler._key(scheduler._requests["s"], 0, len(session.block_hashes) - 1)
    add_input(engine, "s", list(range(300, 330)), max_tokens=20)
    with pytest.raises(AssertionError, match="prepare_store of a stale key for s"):
        finish_turn(engine, session)
