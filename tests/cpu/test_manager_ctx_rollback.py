"""A manager call that fails part-way leaves no slot or pin stranded (review 4).

The policies and admission read the request context in the middle of a batch, after the
manager had already changed its own state: a wrong context (a bare request id) or a policy
that raised left a slot ready but unknown to the policy (never evictable) or a key pinned by
the policy but not by the manager (never evictable either).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from helpers import all_evictable, fill, key, keys
from kvtier.base import OffloadKey, ReqContext
from kvtier.cpu import CPUOffloadingManager
from kvtier.policies import LRUPolicy

CTX = ReqContext("r1")


def snapshot(m: CPUOffloadingManager) -> bytes:
    return pickle.dumps(
        (
            m._slot_of,
            m._ref,
            m._free,
            m._num_pinned,
            m._num_pending,
            m.get_stats(),
            m.table_sizes(),
            list(m.policy.table_sizes().items()),
        )
    )


def core(m: CPUOffloadingManager) -> bytes:
    """The manager's own state (a policy may have learned from the failed call's uses)."""
    return pickle.dumps((m._slot_of, m._ref, m._free, m._num_pinned, m._num_pending, m.get_stats()))


@pytest.mark.parametrize("bad_ctx", ["r1", None, 7], ids=["str", "none", "int"])
def test_a_context_that_is_not_a_reqcontext_is_refused_before_any_change(
    policy_name: str, bad_ctx: Any
) -> None:
    m = CPUOffloadingManager(4, policy_name, enable_events=True)
    fill(m, CTX, 1, 2)
    m.prepare_load(keys(1), CTX)
    m.prepare_store(keys(3), CTX)
    before = snapshot(m)
    calls: dict[str, Callable[[], object]] = {
        "complete_store": lambda: m.complete_store(keys(3), bad_ctx),
        "complete_load": lambda: m.complete_load(keys(1), bad_ctx),
        "touch": lambda: m.touch(keys(2), bad_ctx),
        "prepare_store": lambda: m.prepare_store(keys(4), bad_ctx),
        # complete_load refuses it: pins taken with it could never be released.
        "prepare_load": lambda: m.prepare_load(keys(2), bad_ctx),
        "on_request_finished": lambda: m.on_request_finished(bad_ctx),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=r"ctx=.*expected a ReqContext"):
            call()
        assert snapshot(m) == before, name
    # Stores announced so far: 1, 2. Nothing of the refused calls leaked out.
    assert [e.keys for e in m.take_events()] == [keys(1, 2)]
    m.complete_store(keys(3), CTX)
    m.complete_load(keys(1), CTX)
    assert all_evictable(m)


def test_bad_positions_in_a_context_leave_a_store_pending_not_stranded() -> None:
    # kvaware finds a request's deepest key with max() over the positions: a None position
    # raised after the slot was marked ready, so the key was readable but never evictable.
    m = CPUOffloadingManager(2, "kvaware", enable_events=True)
    m.prepare_store(keys(1, 2), CTX)
    before = core(m)
    bad = ReqContext("r1", key_positions={key(1): 16, key(2): None})  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        m.complete_store(keys(1, 2), bad)
    assert core(m) == before
    assert m.get_stats().pending_writes == 2 and len(m.policy) == 0
    assert list(m.take_events()) == []
    m.complete_store(keys(1, 2), CTX)
    assert all_evictable(m)


def test_bad_positions_at_unpin_leave_the_key_pinned_in_both() -> None:
    m = CPUOffloadingManager(2, "kvaware")
    fill(m, CTX, 1, 2)
    m.prepare_load(keys(1, 2), CTX)
    bad = ReqContext("r2", key_positions={key(1): 16, key(2): None})  # type: ignore[dict-item]
    before = core(m)
    with pytest.raises(TypeError):
        m.complete_load(keys(1, 2), bad)
    assert m.get_stats().pinned == 2 and len(m.policy) == 0
    assert m.policy.table_sizes()["pinned"] == 2
    assert core(m) == before
    m.complete_load(keys(1, 2), CTX)
    assert all_evictable(m)


class _FailingLRU(LRUPolicy):
    """LRU that raises part-way through insert and unpin while `fail` is set."""

    fail = True

    def insert(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        super().insert(keys[:1], ctx)
        if self.fail:
            raise RuntimeError("policy failed part-way")
        super().insert(keys[1:], ctx)

    def unpin(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        super().unpin(keys[:1], ctx)
        if self.fail:
            raise RuntimeError("policy failed part-way")
        super().unpin(keys[1:], ctx)


def test_a_policy_that_raises_part_way_is_rolled_back() -> None:
    m = CPUOffloadingManager(3, _FailingLRU, enable_events=True)
    policy = m.policy
    assert isinstance(policy, _FailingLRU)
    m.prepare_store(keys(1, 2), CTX)
    before = snapshot(m)
    with pytest.raises(RuntimeError):
        m.complete_store(keys(1, 2), CTX)
    assert snapshot(m) == before and len(policy) == 0
    assert list(m.take_events()) == []
    policy.fail = False
    m.complete_store(keys(1, 2), CTX)
    m.take_events()
    m.prepare_load(keys(1, 2), CTX)
    policy.fail = True
    before = snapshot(m)
    with pytest.raises(RuntimeError):
        m.complete_load(keys(1, 2), CTX)
    # Key 1 was unpinned by the policy before it raised: pinned again, as the manager has it.
    assert snapshot(m) == before and len(policy) == 0
    policy.fail = False
    m.complete_load(keys(1, 2), CTX)
    assert m.get_stats().pinned == 0
    assert all_evictable(m)


def test_complete_load_of_a_repeated_key_unpins_once_its_last_load_ends(
    policy_name: str,
) -> None:
    m = CPUOffloadingManager(3, policy_name)
    fill(m, CTX, 1, 2)
    m.prepare_load(keys(1, 1, 2), CTX)
    m.complete_load(keys(1, 2), CTX)
    assert m.get_stats().pinned == 1 and key(1) not in m.policy and key(2) in m.policy
    m.complete_load(keys(1), CTX)
    assert m.get_stats().pinned == 0 and key(1) in m.policy
    m.prepare_load(keys(1, 2, 1), CTX)
    m.complete_load(keys(1, 2, 1), CTX)
    assert m.get_stats().pinned == 0 and len(m.policy) == 2


@pytest.mark.parametrize("bad", [5, "k", None, bytearray(b"x" * 12)])
def test_touch_refuses_keys_that_are_not_bytes_before_any_change(
    policy_name: str, bad: object
) -> None:
    m = CPUOffloadingManager(4, policy_name)
    fill(m, CTX, 1, 2, 3)
    before = snapshot(m)
    sketch = getattr(m.policy, "_sketch", None)
    counts = bytes(sketch._table) if sketch is not None else None
    # Keys are applied tail first by some policies: the bad key last and first.
    for batch in ([key(1), bad], [bad, key(2)]):
        with pytest.raises(TypeError, match=r"offload keys are bytes; got"):
            m.touch(batch, CTX)  # type: ignore[arg-type]
        assert snapshot(m) == before
        if sketch is not None:
            assert bytes(sketch._table) == counts


@pytest.mark.parametrize("bad", [["r"], 5, None, b"r"])
def test_reqcontext_refuses_a_request_id_that_is_not_a_str(bad: object) -> None:
    with pytest.raises(TypeError, match=r"req_id=.*expected str"):
        ReqContext(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [[16, 32], None, ((b"k", 16),)])
def test_reqcontext_refuses_positions_that_are_not_a_dict(bad: object) -> None:
    with pytest.raises(TypeError, match=r"key_positions=.*expected a dict"):
        ReqContext("r", key_positions=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [5, "k", None, bytearray(b"x" * 12), [1]])
def test_lookup_of_a_key_that_is_not_bytes_is_an_error_not_a_miss(
    policy_name: str, bad: object
) -> None:
    m = CPUOffloadingManager(4, policy_name)
    fill(m, CTX, 1)
    before = snapshot(m)
    with pytest.raises(TypeError, match=r"offload keys are bytes; got"):
        m.lookup(bad, CTX)  # type: ignore[arg-type]
    assert snapshot(m) == before and m.get_stats().misses == 0
