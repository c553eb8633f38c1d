"""Review fixes for kvtier's vLLM 0.33 integration (scheduler side, policy plugin), each
through vLLM's own code where the defect showed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import make_engine
from test_vllm import vllm_loaded

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm

POLICY_MODULE = "kvtier.integrations.vllm.policy"


@pytest.mark.parametrize("cpu_bytes", [-65536, -1])
def test_a_negative_cpu_bytes_to_use_is_named_by_the_policy_plugin(
    vllm_loaded: None, cpu_bytes: int
) -> None:
    """vLLM's OffloadingConnector checks only that cpu_bytes_to_use is truthy and floors it
    by the chunk's bytes: a negative setting gives the policy a negative capacity, which the
    adapter passed on to kvtier's policy ("capacity=-8 is invalid"), naming no setting."""
    extra = {
        "cpu_bytes_to_use": cpu_bytes,
        "cache_policy_module_path": POLICY_MODULE,
        "eviction_policy": "kvtier_arc",
    }
    with pytest.raises(ValueError) as info:
        make_engine("OffloadingConnector", extra, module_path=None, with_worker=False)
    message = str(info.value)
    assert "cpu_bytes_to_use" in message
    assert "expected a positive number of bytes" in message


@pytest.mark.parametrize("key", ["num_slots", "cpu_bytes_to_use"])
def test_a_host_tier_smaller_than_one_chunk_of_every_group_is_refused_at_start(
    vllm_loaded: None, key: str
) -> None:
    """A chunk takes a slot in each KV-cache group and is stored for all groups or none. With
    two groups and one slot the engine started, and every store then found no room: nothing
    was ever offloaded, and nothing said so."""
    from kvtier.config import ConfigError

    slot_bytes = 16384  # one chunk of one group: a block of 2 layers x 8 KiB
    one_slot = {"num_slots": 1} if key == "num_slots" else {"cpu_bytes_to_use": slot_bytes}
    with pytest.raises(ConfigError) as info:
        make_engine("KVTierConnector", one_slot, num_groups=2, with_worker=False)
    message = str(info.value)
    assert message.startswith(f"{key}=")
    assert "2 KV-cache groups" in message
    expected = "expected at least 2" if key == "num_slots" else f"at least {2 * slot_bytes} bytes"
    assert expected in message

    # The least that is accepted stores a chunk of both groups.
    two_slots = {"num_slots": 2} if key == "num_slots" else {"cpu_bytes_to_use": 2 * slot_bytes}
    engine = make_engine("KVTierConnector", two_slots, num_groups=2)
    assert engine.scheduler.connector.scheduler_side.setup.num_slots == 2
    engine.add("a", list(range(1, 20)))  # one full block: one chunk per group
    engine.run_until(["a"])
    assert engine.scheduler.connector.scheduler_side.manager.get_stats().stores == 2


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo", "sieve", "kvaware"])
def test_a_cascade_read_of_a_chunk_a_request_only_offered_is_no_use(
    vllm_loaded: None, policy: str
) -> None:
    """vLLM's tiering manager pins each stored chunk while it copies it on to a secondary tier
    (`prepare_read`). A running request that then offers the chunk for storing (a device
    prefix hit) reports an access without any pin of its own; the adapter took the cascade's
    pin for that request's load, and the cascade's end moved the chunk ahead as a use: the
    other chunk, not it, was evicted next. Offered, not read, it keeps its place, cascade or
    not."""
    from typing import Any, cast

    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager

    class Region:
        """vLLM's shared host region, which this test moves no bytes through."""

        def create_kv_memoryview(self) -> memoryview:
            return memoryview(b"")

    k1, k2, k3 = (make_offload_key(bytes([i]) * 32, 0) for i in (1, 2, 3))

    def next_victims(cascade: bool) -> list[Any]:
        manager = CPUPrimaryTierOffloadingManager(
            2,
            cast(Any, Region()),
            cache_policy=f"kvtier_{policy}",
            cache_policy_module_path=POLICY_MODULE,
        )

        def begin(req_id: str) -> Any:
            ctx = ReqContext(req_id)
            manager.on_new_request(ctx)
            return ctx

        for req_id, key in (("a", k1), ("b", k2)):  # k1 is the older chunk
            ctx = begin(req_id)
            out = manager.prepare_write([key], ctx)
            assert out is not None and list(out.keys_to_store) == [key]
            manager.complete_write([key], ctx)
            manager.on_request_finished(ctx)
        copier = ReqContext("cascade")
        if cascade:
            manager.prepare_read([k1], copier)
        offered = manager.prepare_write([k1], begin("r"))  # held already: nothing to store
        assert offered is not None and not offered.keys_to_store
        if cascade:
            manager.complete_read({k1}, copier)
        out = manager.prepare_write([k3], begin("x"))
        assert out is not None
        return list(out.evicted_keys)

    assert next_victims(cascade=False) == [k1]
    assert next_victims(cascade=True) == [k1]
