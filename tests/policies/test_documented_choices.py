"""Choices of LRU, ARC, S3-FIFO and SIEVE that docs/policies.md states and the reference
models of test_policy_models.py follow: the order in which one call's keys are applied, and
S3-FIFO's small-queue target."""

from __future__ import annotations

import pytest

from helpers import key
from kvtier.policies import ARCPolicy, CachePolicy, LRUPolicy, S3FIFOPolicy, SIEVEPolicy

POLICIES: dict[str, type[CachePolicy]] = {
    "lru": LRUPolicy,
    "arc": ARCPolicy,
    "s3fifo": S3FIFOPolicy,
    "sieve": SIEVEPolicy,
}


@pytest.mark.parametrize(("name", "victim"), [("lru", 2), ("arc", 0), ("s3fifo", 0), ("sieve", 0)])
def test_order_within_one_call_is_as_documented(name: str, victim: int) -> None:
    # docs/policies.md "Order within a call": LRU applies a call's keys tail first (the head
    # ends most recent); ARC, S3-FIFO and SIEVE in the order given (the head leaves first).
    pol = POLICIES[name](3)
    ks = [key(0), key(1), key(2)]
    pol.insert(ks, None)
    assert pol.evict(1, ()) == [ks[victim]]


def test_s3fifo_small_target_rounds_down_and_ignores_pinned_keys() -> None:
    # docs/policies.md: target max(1, int(0.1 * capacity)); pinned small keys do not count.
    assert S3FIFOPolicy(15)._small_target == 1
    assert S3FIFOPolicy(1828)._small_target == 182
    pol = S3FIFOPolicy(20)  # target 2
    x, a, b = key(0), key(1), key(2)
    pol.insert([x], None)
    assert pol.evict(1, ()) == [x]  # main is empty: from small, into the ghost
    pol.insert([x], None)  # a ghost hit: into main
    pol.insert([a, b], None)
    pol.pin([a])
    # Small holds one candidate (a is pinned): below its target, so main gives the victim.
    assert pol.evict(1, ()) == [x]
