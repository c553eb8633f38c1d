"""Reuse admission with a large `store_threshold`: exact counts at a bounded cost per sighting.

Each tracked key kept its requests' ids in a tuple, copied and searched linearly on every
sighting, so a huge threshold made a replay quadratic in the requests sharing a chunk (20,000
of them: 33 s). The cost is counted here in id comparisons, not timed.
"""

from __future__ import annotations

import itertools
import random
from typing import ClassVar

import pytest

from helpers import key
from kvtier.admission import ReuseAdmission
from kvtier.base import ReqContext
from test_admission import TrackerModel as Model

# A sighting may search a short tuple of ids (preview, then record) and no more.
MAX_COMPARISONS_PER_KEY = 20


class CountedId(str):
    """A request id that counts the equality tests made on it."""

    comparisons: ClassVar[int] = 0

    def __eq__(self, other: object) -> bool:
        CountedId.comparisons += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def ctx(name: str) -> ReqContext:
    # A new id object each time, as an engine builds one per call: equal, never identical.
    return ReqContext(CountedId(name))


@pytest.mark.parametrize("threshold", [1_000, 10**9])
def test_a_huge_threshold_counts_distinct_requests_exactly_at_a_bounded_cost(
    threshold: int,
) -> None:
    policy = ReuseAdmission(threshold)
    k = key(1)
    CountedId.comparisons = 0
    calls = 0
    for i in range(1_000):
        # The i-th distinct request, then an earlier one again (A, B, A counts two, not three).
        for name in (f"req-{i}", f"req-{i // 2}"):
            distinct = i + 1
            admitted = policy.admit([k], ctx(name))
            calls += 1
            assert admitted == ([k] if distinct >= threshold else []), (i, name)
    assert CountedId.comparisons <= MAX_COMPARISONS_PER_KEY * calls
    assert policy.table_sizes() == {"tracker": 1}


@pytest.mark.parametrize("seed", range(2))
def test_thresholds_past_a_short_tuple_agree_with_a_model_at_a_bounded_cost(seed: int) -> None:
    """Thresholds around and far past the ids a key keeps in a tuple (8), with preview,
    record and admit mixed, repeats in an offer, and a tracker small enough to drop keys
    (but not the hot one)."""
    rng = random.Random(seed)
    universe = [key(i) for i in range(6)]
    for size, threshold in itertools.product((3, 1_000), (8, 9, 12, 250)):
        policy, model = ReuseAdmission(threshold, size), Model(threshold, size)
        CountedId.comparisons = 0
        offered = 0
        for _ in range(3_000):
            req = f"r{rng.randrange(400)}"
            offer = [rng.choice(universe) for _ in range(rng.randint(0, 4))]
            if rng.random() < 0.8:
                offer.insert(0, universe[0])  # a hot key, offered often enough to stay tracked
            offered += 2 * len(offer)
            want = model.preview(offer, req)
            op = rng.random()
            if op < 0.2:
                assert policy.preview(offer, ctx(req)) == want
            elif op < 0.4:
                policy.record(offer, ctx(req))
                model.record(offer, req)
            else:
                assert policy.admit(offer, ctx(req)) == want
                model.record(offer, req)
            assert list(policy._seen) == list(model.seen)  # same keys, same age order
        assert policy.table_sizes()["tracker"] <= size
        assert CountedId.comparisons <= MAX_COMPARISONS_PER_KEY * offered, (size, threshold)
