"""A failed load reported through `get_finished`, which has no `failed_recving`.

vLLM 0.33's model runner calls `get_transfer_results`; a caller of the older interface reads
`get_finished`, as vLLM's own default `KVConnectorBase_V1.get_transfer_results` does for a
connector that defines only `get_finished`. For such a caller the failed load's blocks in
`get_block_ids_with_load_errors` are the only report of the failure, for hybrid models too.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine as engine_module
from engine import BLOCK_SIZE, make_engine, step_until_output
from test_vllm import (
    EXTRA,
    PROMPT,
    _swap_transfer,
    assert_no_leaks,
    expect_loaded,
    fail_loads,
    store_a_then_forget_on_device,
    vllm_loaded,
)

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm


def output_through_get_finished(w: Any, finished_req_ids: set[str]) -> Any:
    """A worker's output as a caller that knows only `get_finished` builds it: through vLLM's
    default `get_transfer_results`, which leaves `failed_recving` empty."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.outputs import KVConnectorOutput

    res = KVConnectorBase_V1.get_transfer_results(w, finished_req_ids)
    assert not res.failed_recving
    return KVConnectorOutput(
        finished_sending=res.finished_sending,
        finished_recving=res.finished_recving,
        invalid_block_ids=w.get_block_ids_with_load_errors(),
        kv_connector_worker_meta=w.build_connector_worker_meta(),
    )


def _fail_every_load(engine: Any) -> None:
    _swap_transfer(engine, fail_loads)


def test_a_failed_load_through_get_finished_is_recomputed(
    vllm_loaded: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_module, "worker_output", output_through_get_finished)
    engine = make_engine("KVTierConnector", EXTRA, load_failure_policy="recompute")
    store_a_then_forget_on_device(engine)
    _fail_every_load(engine)
    b = engine.add("b", [*PROMPT, 8])
    engine.step()
    assert b.status.name == "WAITING_FOR_REMOTE_KVS"
    step_until_output(engine, b)
    # vLLM recomputed the prompt: b's KV is the stand-in model's, never the zeros.
    expect_loaded(engine, "b", [*PROMPT, 8], len(PROMPT))
    engine.run_until(["b"])
    assert b.num_output_tokens == 4
    assert engine.scheduler.connector.scheduler_side.scheduler.load_jobs_failed == 1
    assert_no_leaks(engine)


def test_a_failed_load_of_a_hybrid_model_through_get_finished_is_never_served(
    vllm_loaded: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both groups' blocks reach vLLM as load errors, in the step that ends the load; vLLM
    0.33 refuses block-level errors for a hybrid model, loudly, instead of serving zeros."""
    engine = make_engine("KVTierConnector", EXTRA, num_groups=2)
    reported: list[tuple[set[str], set[int], set[int]]] = []

    def recorded(w: Any, finished_req_ids: set[str]) -> Any:
        out = output_through_get_finished(w, finished_req_ids)
        # b's offered blocks, 4 a group, read before vLLM sees the output.
        table = engine.scheduler.kv_cache_manager.get_block_ids("b")
        offered = {blk for group in table for blk in group[: len(PROMPT) // BLOCK_SIZE]}
        reported.append((set(out.finished_recving), set(out.invalid_block_ids), offered))
        return out

    store_a_then_forget_on_device(engine)
    monkeypatch.setattr(engine_module, "worker_output", recorded)
    _fail_every_load(engine)
    engine.add("b", [*PROMPT, 8])
    with pytest.raises(RuntimeError, match="multiple KV cache groups"):
        for _ in range(5):
            engine.step()
    finished, invalid, offered = reported[-1]
    assert finished == {"b"} and invalid == offered
    assert len(offered) == 2 * (len(PROMPT) // BLOCK_SIZE)
