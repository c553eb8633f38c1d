"""A hybrid model's load whose groups end in different passes, reported through `get_finished`.

A load is one job per KV-cache group. When the first group's job fails in one pass and the
last group's job ends in a later one, a caller of `get_finished` (no `failed_recving`) hears
of the failure only from `get_block_ids_with_load_errors`: the failed group's blocks must be
among the load errors no later than the pass that reports the request in `finished_recving`
(vLLM's contract), not dropped in the earlier pass where nothing was reported finished.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine as engine_module
from engine import BLOCK_SIZE, make_engine
from test_get_finished_failures import output_through_get_finished
from test_vllm import (
    EXTRA,
    PROMPT,
    _swap_transfer,
    store_a_then_forget_on_device,
    vllm_loaded,
)

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm


def test_a_hybrid_load_failed_in_one_group_before_the_other_ends_is_never_served(
    vllm_loaded: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine("KVTierConnector", EXTRA, num_groups=2)
    store_a_then_forget_on_device(engine)
    lock = threading.Lock()
    failed: list[int] = []  # the load job that fails (either group's: the first to run)
    one_failed = threading.Event()
    second_may_run = threading.Event()

    def first_fails_second_waits(job_id: int, kind: str) -> None:
        if kind != "load":
            return
        with lock:
            first = not failed
            if first:
                failed.append(job_id)
        if first:
            one_failed.set()
            raise RuntimeError("injected load failure of one group")
        assert second_may_run.wait(60)

    _swap_transfer(engine, first_fails_second_waits)
    reported: list[tuple[set[str], set[int]]] = []
    offered: set[int] = set()

    def recorded(w: Any, finished_req_ids: set[str]) -> Any:
        side = engine.kvtier_worker()
        loads = [j for j, (_, is_load, _) in side._jobs.items() if is_load]
        if loads and not reported:
            # One group's job fails; the other still runs: this pass reports nothing finished.
            assert one_failed.wait(60)
            side.transfer.wait(failed)
        elif loads:
            second_may_run.set()
            side.transfer.wait(loads)
        if "b" in engine.scheduler.requests and not offered:
            table = engine.scheduler.kv_cache_manager.get_block_ids("b")
            offered.update(blk for group in table for blk in group[: len(PROMPT) // BLOCK_SIZE])
        out = output_through_get_finished(w, finished_req_ids)
        if loads or reported:
            reported.append((set(out.finished_recving or ()), set(out.invalid_block_ids)))
        return out

    monkeypatch.setattr(engine_module, "worker_output", recorded)
    engine.add("b", [*PROMPT, 8])
    try:
        with pytest.raises(RuntimeError, match="multiple KV cache groups"):
            for _ in range(5):
                engine.step(settle=False)
    finally:
        second_may_run.set()
    assert reported[0] == (set(), set())  # the load has not ended yet
    finished, invalid = reported[-1]
    assert finished == {"b"}
    # vLLM reads the errors of the pass that ends the load: the failed group's blocks are
    # there (the old adapter dropped them in the pass before, and b was served zeros).
    assert len(offered) == 2 * (len(PROMPT) // BLOCK_SIZE)
    assert invalid and invalid <= offered
