"""ARC-specific behaviour."""

from __future__ import annotations

from kvtier.base import OffloadKey, make_offload_key
from kvtier.policies import ARCPolicy


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def test_b1_ghost_hit_grows_target_and_enters_t2() -> None:
    arc = ARCPolicy(4)
    arc.insert([key(i) for i in range(4)], None)
    assert arc.evict(1, set()) == [key(0)]  # T1 over target p=0: its LRU goes to B1
    assert arc.table_sizes()["b1"] == 1
    arc.insert([key(0)], None)
    assert arc.target_t1 > 0
    assert arc.table_sizes()["t2"] == 1 and arc.table_sizes()["b1"] == 0


def test_b2_ghost_hit_shrinks_target() -> None:
    arc = ARCPolicy(4)
    arc.insert([key(i) for i in range(4)], None)
    arc.evict(1, set())
    arc.insert([key(0)], None)  # p grows to 1; key(0) in T2
    p = arc.target_t1
    arc.touch([key(1), key(2)], None)  # T1 = {3}, T2 = {0, 1, 2}
    assert arc.evict(1, set()) == [key(0)]  # |T1| = 1 is not over p = 1: T2's LRU goes to B2
    arc.insert([key(0)], None)
    assert arc.target_t1 < p


def test_unpin_counts_as_hit_into_t2() -> None:
    arc = ARCPolicy(4)
    arc.insert([key(1), key(2)], None)
    arc.pin([key(1)])
    arc.unpin([key(1)], None)
    assert arc.table_sizes()["t2"] == 1 and arc.table_sizes()["t1"] == 1


def test_ghost_lists_bounded_by_capacity() -> None:
    arc = ARCPolicy(8)
    for i in range(1000):
        if len(arc) >= 8:
            arc.evict(1, set())
        arc.insert([key(i % 50)], None)
        sizes = arc.table_sizes()
        assert sizes["t1"] + sizes["b1"] <= 8
        assert sum(sizes.values()) <= 16
