"""Cache and admission plugins that raise in the manager's fault paths (review 1134).

Before: a policy whose `unpin` or `insert` could not read a request's ctx left the keys pinned
or pending for good (the connector cannot repeat a cancelled job, and its recovery repeated the
same failing call); a plugin `evict` that raised after taking keys out put them back as its
newest candidates without a word; an admission `record` that raised after the eviction put the
victims back as the newest, changing a built-in policy's order; a `pin` and an undoing `unpin`
that both raised left keys ready but never evictable.
"""

from __future__ import annotations

import pickle
from collections.abc import Collection, Iterable, Sequence

import pytest

from helpers import all_evictable, fill, key, keys
from kvtier.admission import AdmissionPolicy
from kvtier.base import OffloadKey, ReqContext, TransferResult
from kvtier.connector import OffloadingScheduler, StepProgress
from kvtier.cpu import CPUOffloadingManager
from kvtier.policies.lru import LRUPolicy

CTX = ReqContext("r")
WRITER = ReqContext("w", {"priority": 1})  # one every plugin here can read
HASHES = [bytes([i + 1]) * 32 for i in range(2)]


def _priority(ctx: ReqContext | None) -> None:
    """What a plugin reading a priority from the transfer params does: fails without them."""
    if ctx is not None:
        _ = ctx.kv_transfer_params["priority"]  # type: ignore[index]


class _UnpinCtxBlind(LRUPolicy):
    """LRU whose `unpin` cannot read a ctx without transfer params."""

    def unpin(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        _priority(ctx)
        super().unpin(keys, ctx)


class _CtxBlind(_UnpinCtxBlind):
    """LRU whose `unpin` and `insert` cannot read a ctx without transfer params."""

    def insert(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        _priority(ctx)
        super().insert(keys, ctx)


class _Broken(LRUPolicy):
    """LRU whose `insert`, `unpin` and `pin` raise part-way (after their first key), with a
    ctx or without, while named in `armed`."""

    armed: frozenset[str] = frozenset()

    def insert(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        super().insert(keys[:1], ctx)
        if "insert" in self.armed:
            raise RuntimeError("insert bug")
        super().insert(keys[1:], ctx)

    def unpin(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        super().unpin(keys[:1], ctx)
        if "unpin" in self.armed:
            raise RuntimeError("unpin bug")
        super().unpin(keys[1:], ctx)

    def pin(self, keys: Iterable[OffloadKey]) -> None:
        keys = list(keys)
        super().pin(keys[:1])
        if "pin" in self.armed:
            raise RuntimeError("pin bug")
        super().pin(keys[1:])


def _state(m: CPUOffloadingManager) -> bytes:
    tables = (m._slot_of, m._ref, m._free, m._num_pinned, m._num_pending)
    return pickle.dumps((*tables, m.get_stats(), m.table_sizes()))


def _notes(e: pytest.ExceptionInfo[BaseException]) -> str:
    return " ".join(getattr(e.value, "__notes__", []))


# -- a policy that cannot read the request's ctx ------------------------------------------------


def test_complete_load_unpins_without_a_ctx_the_policy_cannot_read() -> None:
    m = CPUOffloadingManager(2, _CtxBlind)
    fill(m, WRITER, 1, 2)
    m.prepare_load(keys(1, 2), CTX)
    with pytest.raises(TypeError, match="not subscriptable") as e:
        m.complete_load(keys(1, 2), CTX)
    assert "could not unpin 2 keys with the ctx of request 'r'; done without it" in _notes(e)
    stats = m.get_stats()
    assert (stats.pinned, stats.ready, len(m.policy)) == (0, 2, 2)
    # Applied: a repeat is refused as for any load already completed.
    with pytest.raises(ValueError, match="that no load pinned"):
        m.complete_load(keys(1, 2), CTX)
    assert all_evictable(m)


def test_complete_store_inserts_without_a_ctx_the_policy_cannot_read() -> None:
    m = CPUOffloadingManager(2, _CtxBlind, enable_events=True)
    m.prepare_store(keys(1, 2), CTX)
    with pytest.raises(TypeError, match="not subscriptable") as e:
        m.complete_store(keys(1, 2), CTX)
    assert "could not insert 2 keys" in _notes(e)
    stats = m.get_stats()
    assert (stats.pending_writes, stats.ready, stats.stores, len(m.policy)) == (0, 2, 2, 2)
    assert [(ev.keys, ev.removed) for ev in m.take_events()] == [(keys(1, 2), False)]
    with pytest.raises(ValueError, match="no store pending"):
        m.complete_store(keys(1, 2), CTX)
    assert all_evictable(m)


def _stored(m: CPUOffloadingManager) -> OffloadingScheduler:
    """A scheduler over `m` whose request "w" stored the two chunks of HASHES, and ended."""
    s = OffloadingScheduler(m, tokens_per_block=4)
    s.add_request("w", HASHES, 9)
    meta = s.build_step_metadata([StepProgress("w", [[0, 1, 2]], 8)])
    s.on_worker_results([TransferResult(j.job_id, True) for j in meta.stores])
    assert s.request_finished("w") is False
    return s


def test_a_cancelled_load_whose_policy_cannot_read_the_ctx_releases_its_pins() -> None:
    # Before: the connector dropped the job, the manager kept both chunks pinned for good.
    m = CPUOffloadingManager(2, _UnpinCtxBlind)
    s = _stored(m)
    s.add_request("r", HASHES, 9)
    assert s.get_num_new_matched_tokens("r", 0) == 8
    s.update_state_after_alloc("r", [[4, 5, 6]], 8)
    assert m.get_stats().pinned == 2
    with pytest.raises(TypeError, match="not subscriptable"):
        s.request_finished("r")  # cancels the unsent load
    assert s.num_requests() == 0 and s.num_jobs_in_flight() == 0
    assert m.get_stats().pinned == 0 and len(m.policy) == 2
    assert all_evictable(m)


def test_a_store_job_whose_policy_cannot_read_the_ctx_recovers_via_fail_unreported() -> None:
    # Before: every completion repeated the failing insert; the job stayed in flight, the
    # slots pending and the request's device blocks held, for good.
    m = CPUOffloadingManager(2, _CtxBlind)
    s = OffloadingScheduler(m, tokens_per_block=4)
    s.add_request("w", HASHES, 9)
    meta = s.build_step_metadata([StepProgress("w", [[0, 1, 2]], 8)])
    stores = [j.job_id for j in meta.stores]
    with pytest.raises(TypeError, match="not subscriptable"):
        s.on_worker_results([TransferResult(j, True) for j in stores])
    assert s.fail_unreported() == stores
    assert s.num_jobs_in_flight() == 0 and s.request_finished("w") is False
    stats = m.get_stats()
    assert (stats.pending_writes, stats.ready, stats.stores) == (0, 2, 2)
    assert all_evictable(m)


def test_a_policy_failing_without_the_ctx_too_leaves_the_manager_unchanged_and_says_so() -> None:
    m = CPUOffloadingManager(4, _Broken)
    policy = m.policy
    assert isinstance(policy, _Broken)
    fill(m, WRITER, 1, 2)
    m.prepare_load(keys(1, 2), CTX)
    assert m.prepare_store(keys(3, 4), CTX) is not None
    before = _state(m)
    policy.armed = frozenset({"unpin", "insert"})
    with pytest.raises(RuntimeError, match="unpin bug") as e:
        m.complete_load(keys(1, 2), CTX)
    assert "called again without the ctx, unpin raised" in _notes(e)
    assert _state(m) == before
    with pytest.raises(RuntimeError, match="insert bug") as e:
        m.complete_store(keys(3, 4), CTX)
    assert "called again without the ctx, insert raised" in _notes(e)
    assert _state(m) == before
    policy.armed = frozenset()
    m.complete_load(keys(1, 2), CTX)
    m.complete_store(keys(3, 4), CTX)
    assert all_evictable(m)


class _SumsPositions(LRUPolicy):
    """A plugin that reads the ctx's positions: one that is not a number makes it raise."""

    def unpin(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        if ctx is not None:
            sum(ctx.key_positions.values())
        super().unpin(keys, ctx)


def test_a_malformed_ctx_is_refused_naming_the_position_with_nothing_applied() -> None:
    # The caller's error, not the policy's: not done without the ctx, so that the caller
    # learns of it and can call again with a good one.
    m = CPUOffloadingManager(2, _SumsPositions)
    fill(m, WRITER, 1, 2)
    m.prepare_load(keys(1, 2), CTX)
    before = _state(m)
    bad = ReqContext("r", key_positions={key(1): 4, key(2): None})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"maps key [0-9a-f]+ to position None; expected an int"):
        m.complete_load(keys(1, 2), bad)
    assert _state(m) == before
    m.complete_load(keys(1, 2), ReqContext("r", key_positions={key(1): 4, key(2): 8}))
    assert all_evictable(m)


# -- prepare_load's undo --------------------------------------------------------------------


def test_a_pin_and_its_undoing_unpin_that_both_raise_strand_no_slot() -> None:
    m = CPUOffloadingManager(2, _Broken)
    policy = m.policy
    assert isinstance(policy, _Broken)
    fill(m, WRITER, 1, 2)
    policy.armed = frozenset({"pin", "unpin"})
    with pytest.raises(RuntimeError, match=r"^pin bug") as e:
        m.prepare_load(keys(1, 2), CTX)
    assert "unpin raised RuntimeError('unpin bug') too" in _notes(e)
    policy.armed = frozenset()
    stats = m.get_stats()
    assert (stats.pinned, stats.ready, stats.loads, len(m.policy)) == (0, 2, 0, 2)
    assert all_evictable(m)


# -- a plugin evict that takes keys out and fails -------------------------------------------


class _EvictsWrongly(LRUPolicy):
    """LRU whose `evict` takes its victims out, then misbehaves as `how` says."""

    how = ""

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        victims = super().evict(n, protected)
        if self.how == "raises":
            raise RuntimeError("evict bug")
        if self.how == "none":
            return None
        if self.how == "drops more":
            self._order.popitem(last=False)
        if self.how == "wrong victim":
            return [key(99)]
        return victims


@pytest.mark.parametrize("how", ["raises", "none", "drops more", "wrong victim"])
def test_a_plugin_evict_that_fails_after_taking_keys_out_says_they_came_back_newest(
    how: str,
) -> None:
    m = CPUOffloadingManager(3, _EvictsWrongly, enable_events=True)
    policy = m.policy
    assert isinstance(policy, _EvictsWrongly)
    fill(m, WRITER, 1, 2, 3)
    m.take_events()
    before = m.get_stats()
    policy.how = how
    with pytest.raises((RuntimeError, ValueError)) as e:
        m.prepare_store(keys(4), CTX)
    said = f"{e.value} {_notes(e)}"
    assert "ready keys it had taken out were inserted again, as its newest candidates" in said
    assert "eviction order changed" in said
    # Nothing leaked: every chunk still stored, a candidate, the counters as before.
    assert m.get_stats() == before and len(policy) == 3 and list(m.take_events()) == []
    policy.how = ""
    assert all_evictable(m)


# -- an admission plugin whose record raises -------------------------------------------------


class _RecordFails(AdmissionPolicy):
    """Admits everything (previewed); `record` raises `error` while it is set."""

    error: BaseException | None = None

    def admit(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
        return list(keys)

    def preview(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
        return list(keys)

    def record(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize("error", [RuntimeError("record bug"), KeyboardInterrupt()])
def test_a_record_that_raises_leaves_the_eviction_order_as_it_was(error: BaseException) -> None:
    # Before: the victim was chosen, then put back as the newest candidate, so the next
    # store evicted another key than it would have.
    failing, twin = _RecordFails(), _RecordFails()
    managers = [CPUOffloadingManager(3, "lru", admission=a) for a in (failing, twin)]
    for m in managers:
        fill(m, WRITER, 1)
        fill(m, WRITER, 2)
        fill(m, WRITER, 3)
    before = _state(managers[0])
    failing.error = error
    with pytest.raises(type(error)):
        managers[0].prepare_store(keys(4), CTX)
    assert _state(managers[0]) == before
    failing.error = None
    outs = [m.prepare_store(keys(4), CTX) for m in managers]
    assert outs[0] is not None and outs[1] is not None
    assert outs[0].evicted_keys == outs[1].evicted_keys == keys(1)
