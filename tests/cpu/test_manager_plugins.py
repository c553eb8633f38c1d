"""The manager and the policies of its plugins that misbehave, or that it cannot finish asking: a
custom admission policy's `record` that raises after victims were chosen, an answer that is not
a subset of the offer, a cache policy that evicts what it must not, an interrupted reset, a
store that finds no room. Each must leave the manager consistent, with every slot reachable and
every key turned away counted once."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import pytest

from helpers import key, keys
from kvtier.admission import AdmissionPolicy, ReuseAdmission
from kvtier.base import LookupResult, OffloadKey, ReqContext
from kvtier.cpu import CPUOffloadingManager
from kvtier.policies.lru import LRUPolicy


class _PerTenant(AdmissionPolicy):
    """Admits everything, and records usage per tenant: a request without one makes `record`
    raise, after the manager has chosen its victims."""

    def __init__(self) -> None:
        self.used: dict[str, int] = {}

    def admit(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
        self.record(keys, ctx)
        return list(keys)

    def preview(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
        return list(keys)

    def record(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        tenant = (ctx.kv_transfer_params or {})["tenant"]
        self.used[tenant] = self.used.get(tenant, 0) + len(keys)


def test_a_record_that_raises_leaves_the_victims_evictable() -> None:
    m = CPUOffloadingManager(2, "lru", admission=_PerTenant())
    ok = ReqContext("a", {"tenant": "t1"})
    out = m.prepare_store(keys(1, 2), ok)
    assert out is not None
    m.complete_store(out.keys_to_store, ok)
    with pytest.raises(KeyError, match="tenant"):
        m.prepare_store([key(3)], ReqContext("b", {}))
    # Both chunks are still stored, and still candidates: the next stores find room.
    assert [m.lookup(k, ok) for k in keys(1, 2)] == [LookupResult.HIT] * 2
    assert len(m.policy) == 2
    out = m.prepare_store(keys(4, 5), ok)
    assert out is not None and sorted(out.evicted_keys) == sorted(keys(1, 2))
    assert m.get_stats().evictions == 2


class _Answers(AdmissionPolicy):
    """Returns whatever `answer` makes of the offer."""

    def __init__(self, answer: object) -> None:
        self.answer = answer

    def admit(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
        return self.answer(list(keys))  # type: ignore[operator, no-any-return]


@pytest.mark.parametrize(
    ("answer", "error", "match"),
    [
        (lambda offer: offer + offer[:1], ValueError, "returned twice"),
        (lambda offer: [*offer, key(1)], ValueError, "not offered"),  # already in the tier
        (lambda offer: [key(99)], ValueError, "not offered"),
        (set, TypeError, "returned set"),
    ],
)
def test_an_admission_answer_that_is_not_a_subset_of_the_offer_is_refused(
    answer: object, error: type[Exception], match: str
) -> None:
    m = CPUOffloadingManager(4, "lru", admission=_Answers(lambda offer: offer))
    ctx = ReqContext("a")
    out = m.prepare_store([key(1)], ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)
    before = (dict(m._slot_of), list(m._ref), m.get_stats())
    m.admission.answer = answer  # type: ignore[attr-defined]
    with pytest.raises(error, match=match) as info:
        m.prepare_store(keys(1, 2, 3), ctx)
    assert "_Answers" in str(info.value)  # names the policy
    assert (dict(m._slot_of), list(m._ref), m.get_stats()) == before
    m.admission.answer = lambda offer: offer  # type: ignore[attr-defined]
    out = m.prepare_store(keys(2, 3), ctx)
    assert out is not None and len(set(out.store_spec.block_ids.tolist())) == 2  # type: ignore[attr-defined]


class _ClearInterrupted(LRUPolicy):
    def clear(self) -> None:
        super().clear()
        raise KeyboardInterrupt


def test_an_interrupt_in_the_policy_clear_still_clears_the_tracker() -> None:
    m = CPUOffloadingManager(4, _ClearInterrupted, store_threshold=2)
    out = m.prepare_store([key(1)], ReqContext("a"))  # the first sighting
    assert out is not None and out.keys_to_store == []
    with pytest.raises(KeyboardInterrupt):
        m.reset_cache()
    assert m.admission.table_sizes() == {"tracker": 0}
    out = m.prepare_store([key(1)], ReqContext("b"))
    assert out is not None and out.keys_to_store == []  # a first sighting again


def test_a_store_that_finds_no_room_counts_every_key_it_turned_away() -> None:
    """Rejected keys included: the connector does not offer any of them again, and vLLM's
    `skipped_chunks` (stores_skipped + stores_no_room) promises every chunk turned away."""
    m = CPUOffloadingManager(2, "lru", store_threshold=2)
    m.prepare_store(keys(1, 2), ReqContext("a"))
    out = m.prepare_store(keys(1, 2), ReqContext("b"))  # their second sighting
    assert out is not None and out.keys_to_store == keys(1, 2)
    m.complete_store(out.keys_to_store, ReqContext("b"))
    m.prepare_load(keys(1, 2), ReqContext("c"))  # pinned: no room can be made
    m.prepare_store([key(3)], ReqContext("x"))  # rejected, needing no room: skipped
    # Key 3 admitted on its second sighting, 4 and 5 rejected; no room for any of them.
    assert m.prepare_store(keys(3, 4, 5), ReqContext("y")) is None
    stats = m.get_stats()
    assert (stats.stores_no_room, stats.stores_skipped) == (3, 3)  # a: 2, x: 1


def test_a_tracker_size_beside_an_admission_policy_is_refused() -> None:
    with pytest.raises(ValueError, match=r"max_tracker_size=10 with admission=.*only one"):
        CPUOffloadingManager(4, admission=ReuseAdmission(2), max_tracker_size=10)
    m = CPUOffloadingManager(4, store_threshold=2)
    assert m.admission.max_tracker_size == 64_000  # type: ignore[attr-defined]


def test_an_unhashable_key_in_a_store_is_named() -> None:
    m = CPUOffloadingManager(4)
    with pytest.raises(TypeError, match=r"offload keys are bytes; got bytearray"):
        m.prepare_store([key(1), bytearray(b"x")], ReqContext("a"))  # type: ignore[list-item]
    assert m.get_stats().used_slots == 0


class _Evicts(LRUPolicy):
    """LRU whose `evict` answer `wrong` rewrites, once armed (a cache policy plugin's bug)."""

    wrong: Callable[[list[OffloadKey]], object] | None = None

    def evict(self, n: int, protected: Collection[OffloadKey]) -> Any:
        victims = super().evict(n, protected)
        if _Evicts.wrong is None or victims is None:
            return victims
        wrong, _Evicts.wrong = _Evicts.wrong, None
        return wrong(victims)


@pytest.mark.parametrize(
    ("wrong", "match"),
    [
        (lambda v: [key(2)], r"evicted .*, which is pinned by a load"),  # key 1's victim swapped
        (lambda v: [key(3)], r"evicted .*, which is being written"),
        (lambda v: [key(99)], r"evicted .*, which the tier does not hold"),
        (lambda v: v + v, r"evicted .* twice"),
        (lambda v: [], r"evicted 0 keys"),
        (tuple, r"returned tuple"),
    ],
)
def test_a_cache_policy_plugin_cannot_evict_what_it_must_not(wrong: Any, match: str) -> None:
    """Evicting key 2 while a load reads it would let the store overwrite its slot; a key not
    held, or twice, failed part-way through the eviction."""
    m = CPUOffloadingManager(3, _Evicts)
    ctx = ReqContext("a")
    out = m.prepare_store(keys(1, 2), ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)
    assert m.prepare_store([key(3)], ctx) is not None  # key 3 pending: the tier is full
    m.prepare_load([key(2)], ctx)  # key 2 pinned: key 1 is the only victim
    before = (dict(m._slot_of), list(m._ref), m.get_stats())
    _Evicts.wrong = wrong
    with pytest.raises(ValueError, match=match) as info:
        m.prepare_store([key(4)], ReqContext("b"))
    assert "_Evicts" in str(info.value) and "expected 1 distinct ready keys" in str(info.value)
    # The policy by its class's name, not object's repr with an address.
    assert f"cache policy {__name__}._Evicts " in str(info.value)
    assert " object at 0x" not in str(info.value)
    assert (dict(m._slot_of), list(m._ref), m.get_stats()) == before
    out = m.prepare_store([key(4)], ReqContext("b"))  # key 1 is still evictable
    assert out is not None and out.evicted_keys == [key(1)]
