"""The connector's `prefix_extended` hook behind vLLM 0.33's real Scheduler with chunked
prefill (`max_num_batched_tokens` of two blocks): request "a"'s 8-block prompt is stored two
blocks a step into an 8-slot LRU tier, request "b" then stores 2 new chunks, and a request with
a's prompt, none of it left on the device, loads what is left of it. The tail (a's last two
chunks) must be the victims: 6 blocks load.

Each store is slowed down on the worker's (single) copy thread, so that every job is reported
exactly one step after the step that sent it (`Engine.step` waits for the earlier ones): the
order of completions and finishes is then the same on every run."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import BLOCK_SIZE, make_engine
from test_vllm import (
    _swap_transfer,
    load_back,
    vllm_loaded,
)

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm

A_PROMPT = list(range(1, 8 * BLOCK_SIZE + 2))  # 8 full blocks and one token
B_PROMPT = list(range(3000, 3000 + 2 * BLOCK_SIZE + 1))


def _slow_stores(job_id: int, kind: str) -> None:
    """A fault injector that fails nothing: a store's copy starts 0.5 s late."""
    if kind == "store":
        time.sleep(0.5)  # far longer than a step, even on a loaded machine


def _loaded_after_eviction(max_tokens: int, release: bool, num_groups: int = 1) -> int:
    """Tokens of a's prompt loaded back from the tier once b's stores evicted two chunks."""
    extra = {"num_slots": 8 * num_groups, "release_finished_blocks": release}
    engine = make_engine(
        "KVTierConnector", extra, num_groups=num_groups, max_num_batched_tokens=2 * BLOCK_SIZE
    )
    _swap_transfer(engine, _slow_stores)
    engine.add("a", A_PROMPT, max_tokens=max_tokens)
    engine.run_until(["a"])
    # Chunked prefill, each store reported a step late: a's prompt was stored in four steps
    # (chunks 0-1, 2-3, 4-5, 6-7), each beside the store of the step before, the last one
    # in the step of its last prefill token.
    steps = [len(so.kv_connector_metadata.step.stores) for so in engine.outputs]
    assert steps[:4] == [num_groups] * 4 and not any(steps[4:])
    engine.add("b", B_PROMPT)
    engine.run_until(["b"])
    return load_back(engine, "d", [*A_PROMPT[:-1], 900])


@pytest.mark.parametrize("release", [True, False], ids=["released", "held"])
def test_a_prompt_whose_request_ends_before_its_last_store_keeps_its_head(
    vllm_loaded: None, release: bool
) -> None:
    """Fails on the current source (and the old one): with one output token, vLLM finishes
    "a" in the step of its last prefill chunk, before the workers report that step's store
    (`update_from_output` frees finished requests before it reads the transfer results). The
    connector skips the hook for a finished request, so a's last chunks rank above its head,
    and b's stores evict a's middle chunks: 4 blocks load (64 tokens) instead of 6."""
    assert _loaded_after_eviction(max_tokens=1, release=release) == 6 * BLOCK_SIZE


@pytest.mark.parametrize("num_groups", [1, 2])
def test_a_prompt_prefilled_over_several_steps_loses_its_tail_first(
    vllm_loaded: None, num_groups: int
) -> None:
    """One KV-cache group: a guard, passes on the current source, fails on the old one (2
    blocks load: the head went first). Two groups: fails on the current source (and the old
    one): the hook re-ranks one group per job, so group 1's whole prefix ends above group 0's
    and b's four keys evict group 0's chunks 4-7, not both groups' 6-7 (4 blocks load)."""
    assert _loaded_after_eviction(4, True, num_groups) == 6 * BLOCK_SIZE
