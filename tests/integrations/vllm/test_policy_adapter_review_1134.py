"""Review of `KVTierPolicyAdapter` (kvtier's policies in vLLM's own `CPUOffloadingManager`):
load completions whose keys name different readers, or no live reader, and the adapters' base
class named as `eviction_policy`.

vLLM completes a load job's keys one `mark_evictable` each, in the order of a `set`; the
kvtier policy must see them as kvtier's own connector passes them (one call, head first, with
the request whose job it was), whatever that order.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODULE = "kvtier.integrations.vllm.policy"
# SIEVE's unpin only marks a key visited: the order of one call's keys does not matter to it.
ORDERED = ["lru", "arc", "s3fifo", "kvaware"]
TOKENS = 16
ORDERS = list(itertools.permutations(range(4)))


@pytest.fixture(scope="module")
def vllm_loaded() -> None:
    import vllm.v1.kv_offload.cpu.manager  # noqa: F401

    import kvtier.integrations.vllm.policy  # noqa: F401


def _key(tag: str) -> Any:
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(tag.encode().ljust(32, b"."), 0)


PREFIX = ["k1", "k2", "k3", "k4"]


def _vllm_ctx(manager: Any, req_id: str, tags: list[str]) -> Any:
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id)
    manager.on_new_request(ctx)
    for i, tag in enumerate(tags):
        ctx.set_offload_key_position(_key(tag), TOKENS * (i + 1))
    return ctx


def _kvtier_ctx(manager: Any, req_id: str, tags: list[str]) -> Any:
    from kvtier.base import ReqContext

    ctx = ReqContext(req_id)
    manager.on_new_request(ctx)
    for i, tag in enumerate(tags):
        ctx.key_positions[_key(tag)] = TOKENS * (i + 1)
    return ctx


def _victims(out: Any) -> list[str]:
    return sorted(bytes(k)[:2].decode() for k in out.evicted_keys)


def _stored_prefix(manager: Any, new_ctx: Any) -> None:
    """Request "s" stores k1..k4 and ends; "x" stores one more chunk: the tier (5) is full."""
    for req_id, tags in (("s", PREFIX), ("x", ["x1"])):
        ctx = new_ctx(manager, req_id, tags)
        keys = [_key(t) for t in tags]
        out = manager.prepare_store(keys, ctx)
        assert out is not None
        manager.complete_store(keys, ctx)
        manager.on_request_finished(ctx)


def _next_store(manager: Any, new_ctx: Any) -> list[str]:
    """Victims of a two-chunk store by a new request."""
    ctx = new_ctx(manager, "c", ["c1", "c2"])
    out = manager.prepare_store([_key("c1"), _key("c2")], ctx)
    assert out is not None
    return _victims(out)


@pytest.mark.parametrize("policy", ORDERED)
def test_a_load_outliving_its_aborted_request_keeps_the_prefix_order(
    vllm_loaded: None, policy: str
) -> None:
    """vLLM's connector ends an aborted request (`on_request_finished`) while its load is in
    flight; the load completes later, its keys in the order of a set. The adapter gave the
    kvtier policy those unpins in that order (no live reader, so no positions): kvtier_lru
    evicted k1, k2 or k3 before the prefix's tail k4, as the order fell. kvtier's own
    connector unpins the job head first: the same victims for every order."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from kvtier.cpu import CPUOffloadingManager as KVTierManager
    from kvtier.integrations.vllm.policy import KVTierPolicyAdapter

    keys = [_key(t) for t in PREFIX]

    ref = KVTierManager(5, policy)
    _stored_prefix(ref, _kvtier_ctx)
    a = _kvtier_ctx(ref, "a", PREFIX)
    ref.prepare_load(keys, a)
    # kvtier's connector: the load's unpin with the request, then the request's end.
    ref.complete_load(keys, a)
    ref.on_request_finished(a)
    expected = _next_store(ref, _kvtier_ctx)

    wrong = {}
    for order in ORDERS:
        manager = CPUOffloadingManager(5, f"kvtier_{policy}", MODULE)
        _stored_prefix(manager, _vllm_ctx)
        va = _vllm_ctx(manager, "a", PREFIX)
        manager.prepare_load(keys, va)
        manager.on_request_finished(va)  # aborted with its load in flight
        manager.complete_load([keys[i] for i in order], va)
        got = _next_store(manager, _vllm_ctx)
        if got != expected:
            wrong[order] = got
    assert not wrong, (expected, wrong)
    adapter = manager._policy
    assert isinstance(adapter, KVTierPolicyAdapter)
    assert not adapter._readers and not adapter._orphans  # nothing left of "a"


@pytest.mark.parametrize("policy", ORDERED)
def test_a_load_whose_head_another_request_read_meanwhile_keeps_the_prefix_order(
    vllm_loaded: None, policy: str
) -> None:
    """Request "a" loads k1..k4; "b", sharing k1 and k2 only, loads those too and its load
    (a sync load, say) completes first; then a's completes, its keys in the order of a set.
    The adapter attributed k1, k2 to "b" (their last reader) and k3, k4 to "a", and gave the
    kvtier policy one call per run of one reader in that order: kvtier_lru evicted the head
    k1 or k2 before the tail for some orders. kvtier's own manager unpins a's job in one
    call, head first, with a's context: the same victims for every order."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from kvtier.cpu import CPUOffloadingManager as KVTierManager

    keys = [_key(t) for t in PREFIX]

    ref = KVTierManager(5, policy)
    _stored_prefix(ref, _kvtier_ctx)
    a = _kvtier_ctx(ref, "a", PREFIX)
    b = _kvtier_ctx(ref, "b", PREFIX[:2])
    ref.prepare_load(keys, a)
    ref.prepare_load(keys[:2], b)
    ref.complete_load(keys[:2], b)
    ref.complete_load(keys, a)
    expected = _next_store(ref, _kvtier_ctx)

    for order in ORDERS:
        manager = CPUOffloadingManager(5, f"kvtier_{policy}", MODULE)
        _stored_prefix(manager, _vllm_ctx)
        va = _vllm_ctx(manager, "a", PREFIX)
        vb = _vllm_ctx(manager, "b", PREFIX[:2])
        manager.prepare_load(keys, va)
        manager.prepare_load(keys[:2], vb)
        manager.complete_load(set(keys[:2]), vb)
        manager.complete_load([keys[i] for i in order], va)
        assert _next_store(manager, _vllm_ctx) == expected, order


def test_the_adapters_base_class_as_eviction_policy_names_the_kvtier_policies(
    vllm_loaded: None,
) -> None:
    """vLLM instantiates any class the module path holds: `KVTierPolicyAdapter` (the name the
    module's docs give the adapter) failed with "'KVTierPolicyAdapter' object has no attribute
    'policy'", naming neither the setting nor what it expects."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    with pytest.raises(TypeError, match=r"eviction_policy 'KVTierPolicyAdapter'.*kvtier_lru"):
        CPUOffloadingManager(4, "KVTierPolicyAdapter", MODULE)


def test_vllms_scheduler_aborting_a_request_mid_load_keeps_each_prefix_head_last(
    vllm_loaded: None,
) -> None:
    """The same through vLLM's real Scheduler and OffloadingConnector (workers stubbed): three
    prompts stored, the device prefix cache reset, then three requests that load them, each
    aborted before its load completes. vLLM ends each request first and completes its load
    a step later; kvtier_lru must keep every prefix's tail oldest, its head newest."""
    from engine import runner_output
    from test_vllm import PROMPT, offloading_connector_engine
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    from kvtier.integrations.vllm.policy import KVTierPolicyAdapter
    from kvtier.policies import LRUPolicy

    def lru_order() -> list[Any]:
        inner = adapter.inner
        assert isinstance(inner, LRUPolicy)
        return list(inner._order)  # oldest first

    extra = {
        "cpu_bytes_to_use": 1 << 20,
        "cache_policy_module_path": MODULE,
        "eviction_policy": "kvtier_lru",
    }
    engine = offloading_connector_engine(extra)
    scheduler = engine.scheduler
    adapter = scheduler.connector.connector_scheduler.manager._policy
    assert isinstance(adapter, KVTierPolicyAdapter)
    prompts = [[1000 * i + t for t in PROMPT] for i in range(1, 4)]
    stored = []
    for i, prompt in enumerate(prompts):
        before = set(adapter.chunks)
        engine.add(f"a{i}", prompt)
        engine.run_until([f"a{i}"])
        stored.append([k for k in lru_order() if k not in before])
    assert [len(keys) for keys in stored] == [4, 4, 4]
    assert scheduler.reset_prefix_cache()

    def step(complete: list[int]) -> Any:
        out = scheduler.schedule()
        done = OffloadingWorkerMetadata()
        for job_id in complete:
            done.mark_completed(job_id)
        req_ids = list(out.num_scheduled_tokens)
        kv = KVConnectorOutput(kv_connector_worker_meta=done)
        scheduler.update_from_output(out, runner_output(req_ids, [[] for _ in req_ids], kv))
        return out.kv_connector_metadata

    for i, prompt in enumerate(prompts):
        engine.add(f"b{i}", [*prompt, 4])
        loads = list(step([]).load_jobs)
        assert len(loads) == 1
        scheduler.finish_requests([f"b{i}"], RequestStatus.FINISHED_ABORTED)
        step([])  # vLLM ends the request: its load is still in flight
        step(loads)
    order = lru_order()
    for keys in stored:
        assert [k for k in order if k in keys] == keys
    assert not adapter._orphans and not adapter._readers
