"""Review 1135 of `KVTierPolicyAdapter`: load completions of different requests in one step.

Before: the adapter kept a completed load's keys in one run, handed to the kvtier policy in
one call with one request's ctx, whenever one request's prefix held them all. Two requests'
loads that end in the same step then became one call: request "a" loads k1 and k2; "b",
whose prompt starts with them too but which had them in the device prefix cache (a request
computing its whole prompt, for prompt logprobs, put them there), loads m1 and m2. The kvtier
policy heard one unpin of k1, k2, m1 and m2, all of them b's uses, where kvtier's own manager
unpins each job with its own request: a's use of k1 and k2 was b's, and the victims of the
next store differed from those of kvtier's own manager (for LRU, ARC, S3-FIFO and kvaware)
for some orders of the completions.
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
from test_policy_adapter_review_1134 import _key, _kvtier_ctx, _vllm_ctx

MODULE = "kvtier.integrations.vllm.policy"
STORED = ["k1", "k2", "m1", "m2", "x1"]


@pytest.fixture(scope="module")
def vllm_loaded() -> None:
    import vllm.v1.kv_offload.cpu.manager  # noqa: F401

    import kvtier.integrations.vllm.policy  # noqa: F401


def _run(manager: Any, new_ctx: Any, a_first: bool, order: tuple[int, ...]) -> list[str]:
    """Chunks stored by "w" and "x"; "a" loads k1 k2 and "b" loads m1 m2, both loads end in
    one step (a's job first or not, its keys in `order`: kvtier's own connector passes them
    head first); then, both still running, a two-chunk store's victims."""
    for req_id, tags in (("w", STORED[:4]), ("x", STORED[4:])):
        ctx = new_ctx(manager, req_id, tags)
        keys = [_key(t) for t in tags]
        assert manager.prepare_store(keys, ctx) is not None
        manager.complete_store(keys, ctx)
        manager.on_request_finished(ctx)
    a = new_ctx(manager, "a", ["k1", "k2"])
    b = new_ctx(manager, "b", ["k1", "k2", "m1", "m2"])
    jobs = [([_key("k1"), _key("k2")], a), ([_key("m1"), _key("m2")], b)]
    for keys, ctx in jobs:
        manager.prepare_load(keys, ctx)
    for keys, ctx in jobs if a_first else jobs[::-1]:
        manager.complete_load([keys[i] for i in order] if new_ctx is _vllm_ctx else keys, ctx)
    c = new_ctx(manager, "c", ["c1", "c2"])
    out = manager.prepare_store([_key("c1"), _key("c2")], c)
    assert out is not None
    return sorted(bytes(k)[:2].decode() for k in out.evicted_keys)


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo", "kvaware"])
def test_two_requests_loads_ending_in_one_step_stay_each_its_own_use(
    vllm_loaded: None, policy: str
) -> None:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from kvtier.cpu import CPUOffloadingManager as KVTierManager

    wrong = {}
    for a_first, order in itertools.product((True, False), itertools.permutations(range(2))):
        expected = _run(KVTierManager(5, policy), _kvtier_ctx, a_first, order)
        got = _run(CPUOffloadingManager(5, f"kvtier_{policy}", MODULE), _vllm_ctx, a_first, order)
        if got != expected:
            wrong[a_first, order] = (expected, got)
    assert not wrong
