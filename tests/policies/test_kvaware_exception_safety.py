"""kvaware keeps every key it holds when a use's count raises part-way (review 4).

A context whose positions cannot be compared (a None position) makes the deepest-key lookup
raise. touch took a main-area key out of its bucket and unpin took a key off the pinned table
before counting the use: the key was then held nowhere, so the manager's slot could never be
evicted again.
"""

from __future__ import annotations

import pickle
import re

import numpy as np
import pytest

from kvtier.base import OffloadKey, ReqContext, make_offload_key
from kvtier.policies import KVAwarePolicy


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def bad_ctx(*ids: int) -> ReqContext:
    positions = {key(i): 16 for i in ids}
    positions[key(999)] = None  # type: ignore[assignment]
    return ReqContext("bad", key_positions=positions)


@pytest.mark.parametrize("mode", ["adaptive", "filter", "open"])
def test_touch_of_a_main_key_that_raises_keeps_the_key(mode: str) -> None:
    policy = KVAwarePolicy(16, mode=mode)
    ks = [key(i) for i in range(8)]
    policy.insert(ks, None)
    policy.evict(1, set(ks[1:]))  # the window hands its surplus to the main area
    main = [k for k in ks[1:] if k in policy._credit]
    assert main
    held = len(policy)
    with pytest.raises(TypeError):
        policy.touch(main, bad_ctx(1))
    assert len(policy) == held and all(k in policy for k in main)


@pytest.mark.parametrize("mode", ["adaptive", "filter", "open"])
def test_unpin_that_raises_leaves_the_key_pinned(mode: str) -> None:
    policy = KVAwarePolicy(16, mode=mode)
    ks = [key(i) for i in range(8)]
    policy.insert(ks, None)
    policy.evict(1, set(ks[1:]))
    policy.pin(ks[1:3])
    with pytest.raises(TypeError):
        policy.unpin(ks[1:3], bad_ctx(1, 2))
    # Each key is either back among the candidates or still pinned: never neither.
    for k in ks[1:3]:
        assert (k in policy) != (k in policy._pinned)
    policy.unpin(ks[1:3], None)
    assert all(k in policy for k in ks[1:3]) and not policy._pinned


@pytest.mark.parametrize("call", ["insert", "touch", "unpin"])
def test_unreadable_positions_are_refused_by_name_before_any_change(call: str) -> None:
    policy = KVAwarePolicy(16)
    ks = [key(i) for i in range(8)]
    policy.insert(ks, None)
    policy.evict(1, set(ks[1:]))
    policy.pin(ks[1:3])
    before = pickle.dumps(policy)
    target = {"insert": [key(50), key(51)], "touch": ks[3:6], "unpin": ks[1:3]}[call]
    with pytest.raises(TypeError, match=r"key_positions of request 'bad' maps .* to None"):
        getattr(policy, call)(target, bad_ctx(1, 2, 3))
    assert pickle.dumps(policy) == before


def test_the_error_names_the_unreadable_position_among_numpy_ints() -> None:
    positions: dict[OffloadKey, int] = {key(1): np.int64(16), key(2): np.int64(32)}  # type: ignore[dict-item]
    positions[key(3)] = None  # type: ignore[assignment]
    with pytest.raises(TypeError, match=re.escape(f"maps {key(3)!r} to None")):
        KVAwarePolicy(16).insert([key(1)], ReqContext("r", key_positions=positions))
