import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import pytest

from helpers import key, keys
from kvtier.admission import (
    AdmissionPolicy,
    AlwaysAdmit,
    ReuseAdmission,
    make_admission_policy,
    registered_admission_policies,
)
from kvtier.base import OffloadKey, ReqContext
from kvtier.cpu import CPUOffloadingManager


def test_registry_lists_builtins() -> None:
    assert set(registered_admission_policies()) >= {"always", "reuse"}
    for cls in registered_admission_policies().values():
        assert cls.description


def test_threshold_below_two_admits_everything() -> None:
    for threshold in (0, 1):
        policy = make_admission_policy(threshold)
        assert isinstance(policy, AlwaysAdmit)
        assert policy.admit(keys(1, 2), ReqContext("a")) == keys(1, 2)


def test_negative_threshold_is_rejected() -> None:
    with pytest.raises(ValueError, match="store_threshold=-1"):
        make_admission_policy(-1)
    with pytest.raises(ValueError, match="store_threshold=1"):
        ReuseAdmission(1)
    with pytest.raises(ValueError, match="max_tracker_size=0"):
        ReuseAdmission(2, 0)


def test_counts_each_request_once() -> None:
    policy = ReuseAdmission(store_threshold=2)
    a, b = ReqContext("a"), ReqContext("b")
    # Re-offers inside one request (retries, preemption) are one sighting.
    for _ in range(5):
        assert policy.admit(keys(1), a) == []
    assert policy.admit(keys(1), b) == keys(1)


def test_threshold_three_needs_three_requests() -> None:
    policy = ReuseAdmission(store_threshold=3)
    assert policy.admit(keys(1, 2), ReqContext("a")) == []
    assert policy.admit(keys(1), ReqContext("b")) == []
    assert policy.admit(keys(1, 2), ReqContext("c")) == keys(1)
    assert policy.admit(keys(2), ReqContext("d")) == keys(2)


def test_a_request_offering_again_after_others_is_still_counted_once() -> None:
    policy = ReuseAdmission(store_threshold=3)
    assert policy.admit(keys(1), ReqContext("a")) == []
    assert policy.admit(keys(1), ReqContext("b")) == []
    # a's second offer, after b's, is not a third request.
    assert policy.preview(keys(1), ReqContext("a")) == []
    assert policy.admit(keys(1), ReqContext("a")) == []
    assert policy.admit(keys(1), ReqContext("c")) == keys(1)


def test_reuse_admission_counts_distinct_requests() -> None:
    rng = random.Random(11)
    for threshold in (2, 3, 4):
        policy = ReuseAdmission(store_threshold=threshold)
        offered_by: dict[OffloadKey, set[str]] = {}
        for _ in range(300):
            offer = keys(*rng.sample(range(10), rng.randint(1, 4)))
            req_id = f"r{rng.randrange(5)}"
            expected = [k for k in offer if len(offered_by.get(k, set()) | {req_id}) >= threshold]
            assert policy.admit(offer, ReqContext(req_id)) == expected
            for k in offer:
                offered_by.setdefault(k, set()).add(req_id)


def test_duplicate_keys_in_one_offer_take_one_tracker_entry() -> None:
    policy = ReuseAdmission(store_threshold=2, max_tracker_size=3)
    policy.admit(keys(1, 2), ReqContext("a"))
    policy.admit(keys(3, 3), ReqContext("b"))
    # Key 3 needs one entry, not two: keys 1 and 2 both stay tracked.
    assert policy.table_sizes()["tracker"] == 3
    assert policy.admit(keys(1, 2), ReqContext("c")) == keys(1, 2)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ReuseAdmission("2"), "store_threshold='2'"),  # type: ignore[arg-type]
        (lambda: ReuseAdmission(2.5), "store_threshold=2.5"),  # type: ignore[arg-type]
        (lambda: ReuseAdmission(2, "10"), "max_tracker_size='10'"),  # type: ignore[arg-type]
        (lambda: make_admission_policy("3"), "store_threshold='3'"),  # type: ignore[arg-type]
        (lambda: make_admission_policy(True), "store_threshold=True"),
    ],
)
def test_parameters_of_the_wrong_type_are_clear_errors(make: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_tracker_is_bounded_and_drops_oldest() -> None:
    policy = ReuseAdmission(store_threshold=2, max_tracker_size=3)
    policy.admit(keys(1), ReqContext("a"))
    policy.admit(keys(2, 3, 4), ReqContext("b"))
    assert policy.table_sizes()["tracker"] == 3
    # Key 1 was the oldest and was dropped: its next sighting counts as the first.
    assert policy.admit(keys(1), ReqContext("c")) == []
    assert policy.admit(keys(4), ReqContext("c")) == keys(4)


def test_offer_in_progress_is_never_dropped() -> None:
    policy = ReuseAdmission(store_threshold=2, max_tracker_size=2)
    policy.admit(keys(1, 2), ReqContext("a"))
    # The offer re-sights 1 and 2 and brings 3: there is no room for 3, but 1 and 2 stay.
    assert policy.admit(keys(1, 2, 3), ReqContext("b")) == keys(1, 2)
    assert policy.table_sizes()["tracker"] == 2
    assert policy.admit(keys(1, 2), ReqContext("c")) == keys(1, 2)


def test_clear_forgets_counts() -> None:
    policy = ReuseAdmission(store_threshold=2)
    policy.admit(keys(1), ReqContext("a"))
    policy.clear()
    assert policy.admit(keys(1), ReqContext("b")) == []


def test_preview_matches_admit_and_records_nothing() -> None:
    rng = random.Random(7)
    policy = ReuseAdmission(store_threshold=3, max_tracker_size=12)
    twin = ReuseAdmission(store_threshold=3, max_tracker_size=12)
    for step in range(400):
        offer = list(dict.fromkeys(keys(*rng.sample(range(20), rng.randint(1, 6)))))
        ctx = ReqContext(f"r{rng.randrange(8)}")
        before = list(policy._seen.items())
        previewed = policy.preview(offer, ctx)
        assert list(policy._seen.items()) == before, f"preview recorded at step {step}"
        assert previewed == policy.admit(offer, ctx) == twin.admit(offer, ctx)


def test_store_that_finds_no_room_records_no_sighting() -> None:
    mgr = CPUOffloadingManager(1, "lru", store_threshold=2)
    a, b, c = keys(1, 2, 3)
    for req, expected in (("p1", []), ("p2", [a])):
        out = mgr.prepare_store([a], ReqContext(req))
        assert out is not None and out.keys_to_store == expected
    out = mgr.prepare_store([b], ReqContext("r1"))
    assert out is not None and out.keys_to_store == []
    # b passes admission, but the only slot holds a's pending write: no room, nothing changed.
    sizes, skipped = mgr.table_sizes(), mgr.get_stats().stores_skipped
    assert mgr.prepare_store([b, c], ReqContext("r2")) is None
    assert mgr.table_sizes() == sizes
    assert mgr.get_stats().stores_skipped == skipped
    mgr.complete_store([a], ReqContext("p2"))
    # Had r2's refused offer been recorded, r3's would be c's second sighting and be stored.
    out = mgr.prepare_store([c], ReqContext("r3"))
    assert out is not None and out.keys_to_store == []
    out = mgr.prepare_store([c], ReqContext("r4"))
    assert out is not None and out.keys_to_store == [c]


class _OddKeys(AdmissionPolicy):
    """Admits keys whose last byte is odd, and logs every call: a custom policy."""

    def __init__(self, previews: bool) -> None:
        self.previews = previews
        self.calls: list[str] = []

    def admit(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
        self.calls.append("admit")
        return [k for k in keys if k[-5] % 2]

    def preview(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[OffloadKey] | None:
        if not self.previews:
            return None
        self.calls.append("preview")
        return [k for k in keys if k[-5] % 2]


@pytest.mark.parametrize("previews", [False, True])
def test_custom_admission_with_and_without_preview(previews: bool) -> None:
    policy = _OddKeys(previews)
    mgr = CPUOffloadingManager(1, "lru", admission=policy)
    a, b, c = keys(1, 2, 3)
    out = mgr.prepare_store([a, b], ReqContext("r1"))
    assert out is not None and out.keys_to_store == [a]
    assert mgr.get_stats().stores_skipped == 1
    # No room: a's write is pending in the only slot.
    assert mgr.prepare_store([c], ReqContext("r2")) is None
    # A policy that cannot preview has to be asked (and so may record) even then; one that
    # previews is told of the offer only when the store goes ahead (the default record: admit).
    expected = ["preview", "admit", "preview"] if previews else ["admit", "admit"]
    assert policy.calls == expected
    assert mgr.get_stats().stores_skipped == 1


class TrackerModel:
    """Reuse admission spelled out: distinct requests per key, most recently offered kept."""

    def __init__(self, threshold: int, size: int) -> None:
        self.threshold, self.size = threshold, size
        self.seen: OrderedDict[OffloadKey, set[str]] = OrderedDict()

    def preview(self, keys: list[OffloadKey], req: str) -> list[OffloadKey]:
        return [k for k in keys if k in self.seen and len(self.seen[k] | {req}) >= self.threshold]

    def record(self, keys: list[OffloadKey], req: str) -> None:
        offer = list(dict.fromkeys(keys))
        for k in keys:  # a key offered twice ends where its last offer puts it
            if k in self.seen:
                self.seen[k].add(req)
                self.seen.move_to_end(k)
        for k in [k for k in offer if k not in self.seen]:
            if len(self.seen) >= self.size:
                older = next((o for o in self.seen if o not in offer), None)
                if older is None:
                    break  # the offer's own entries are never dropped for each other
                del self.seen[older]
            self.seen[k] = {req}


@pytest.mark.parametrize("seed", range(8))
def test_reuse_admission_agrees_with_a_model(seed: int) -> None:
    rng = random.Random(seed)
    threshold, size = rng.choice([2, 3, 4]), rng.choice([1, 3, 8, 1000])
    policy, model = ReuseAdmission(threshold, size), TrackerModel(threshold, size)
    universe = [key(i) for i in range(20)]
    for _ in range(2000):
        req = f"r{rng.randrange(6)}"
        ctx = ReqContext(req)
        offer = [rng.choice(universe) for _ in range(rng.randint(0, 6))]  # repeats allowed
        op = rng.random()
        want = model.preview(offer, req)
        if op < 0.3:
            assert policy.preview(offer, ctx) == want
        elif op < 0.6:
            policy.record(offer, ctx)
            model.record(offer, req)
        elif op < 0.98:
            assert policy.admit(offer, ctx) == want
            model.record(offer, req)
        else:
            policy.clear()
            model.seen.clear()
        assert list(policy._seen) == list(model.seen)  # same keys, same age order
        assert policy.table_sizes()["tracker"] <= size
        for k, ids in policy._seen.items():
            # Per request, and bounded: at most `threshold` distinct ids, all real offerers.
            assert len(ids) == len(set(ids)) <= threshold
            assert set(ids) <= model.seen[k]


def test_reuse_threshold_counts_requests_not_offers_through_the_manager() -> None:
    m = CPUOffloadingManager(4, store_threshold=3)
    a = [key(1)]
    for _ in range(5):  # one request offering again and again never reaches 3
        out = m.prepare_store(a, ReqContext("r1"))
        assert out is not None and out.keys_to_store == []
    assert m.prepare_store(a, ReqContext("r2")).keys_to_store == []  # type: ignore[union-attr]
    assert m.prepare_store(a, ReqContext("r1")).keys_to_store == []  # type: ignore[union-attr]
    assert m.prepare_store(a, ReqContext("r3")).keys_to_store == a  # type: ignore[union-attr]
