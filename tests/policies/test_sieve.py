"""SIEVE-specific behaviour."""

from __future__ import annotations

from kvtier.base import OffloadKey, make_offload_key
from kvtier.policies import SIEVEPolicy


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def test_visited_keys_survive_in_place_and_hand_remembers_position() -> None:
    sieve = SIEVEPolicy(4)
    sieve.insert([key(i) for i in range(4)], None)  # tail (oldest) 0 .. 3 head
    sieve.touch([key(0), key(2)], None)
    assert sieve.evict(1, set()) == [key(1)]  # 0 visited: spared, bit cleared
    assert sieve.evict(1, set()) == [key(3)]  # hand continues from 1's place; 2 spared
    assert sieve.evict(1, set()) == [key(0)]  # wraps to the tail; 0 lost its bit
    assert sieve.evict(1, set()) == [key(2)]


def test_new_keys_do_not_jump_ahead_of_the_hand() -> None:
    sieve = SIEVEPolicy(4)
    sieve.insert([key(i) for i in range(3)], None)
    sieve.touch([key(0)], None)
    assert sieve.evict(1, set()) == [key(1)]
    sieve.insert([key(9)], None)  # at the head, behind the hand's next stop
    assert sieve.evict(1, set()) == [key(2)]


def test_pinned_key_keeps_place_and_is_visited_after_unpin() -> None:
    sieve = SIEVEPolicy(4)
    sieve.insert([key(i) for i in range(3)], None)
    sieve.pin([key(0)])
    assert sieve.evict(1, set()) == [key(1)]
    sieve.unpin([key(0)], None)
    assert sieve.evict(1, set()) == [key(2)]
    assert sieve.evict(1, set()) == [key(0)]
