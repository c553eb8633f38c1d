"""kvaware review (2026-11-28): one key given as `protected`, key_positions that hold no
number, sketch shapes that are not positive integers, and key hashes of keys that are not
bytes."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from kvtier.base import OffloadKey, ReqContext, make_offload_key
from kvtier.policies import KVAwarePolicy
from kvtier.policies.kvaware import FrequencySketch, key_hash


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def _state(policy: KVAwarePolicy) -> tuple[object, ...]:
    """Everything a refused call must leave as it was: the keys and their order, the counts,
    the per-request tables and the mode."""
    return (
        list(policy._win.items()),
        dict(policy._credit),
        [(c, list(b)) for c, b in sorted(policy._buckets.items())],
        policy._floor,
        dict(policy._pinned),
        bytes(policy._sketch._table),
        {r: set(ks) for r, ks in policy._counted.items()},
        list(policy._tails),
        policy._tail_key,
        policy.filtering,
        policy.table_sizes(),
    )


def _filled(mode: str = "adaptive") -> KVAwarePolicy:
    """Four keys held (two in main, the window at its size), one pinned, one request live."""
    policy = KVAwarePolicy(4, mode=mode)
    keys = [key(i) for i in range(5)]
    policy.insert(
        keys, ReqContext("r0", key_positions={k: 16 * (i + 1) for i, k in enumerate(keys)})
    )
    assert policy.evict(1, ()) is not None  # the window's surplus moves to main
    policy.pin([key(4)])
    return policy


@pytest.mark.parametrize("one", [key(1), "abc"])
def test_one_key_given_as_protected_is_refused_before_any_change(one: object) -> None:
    # Taken for a collection of its bytes (ints), the key protected nothing and was evicted.
    policy = _filled()
    held = [k for k in map(key, range(5)) if k in policy]
    assert key(1) in held
    before = _state(policy)
    with pytest.raises(TypeError, match=r"protected=.* is one (bytes|str) object"):
        policy.evict(len(held), one)  # type: ignore[arg-type]
    assert _state(policy) == before
    # The same key in a list is protected.
    got = policy.evict(len(held) - 1, [key(1)])
    assert got is not None and key(1) not in got and key(1) in policy


@pytest.mark.parametrize(
    ("positions", "error"),
    [
        ({key(9): "16"}, TypeError),  # one entry: max() compared nothing
        ({key(9): None}, TypeError),
        ({key(9): "16", key(8): "9", key(7): "32"}, TypeError),  # strs compare as strs
        ({key(9): math.nan}, ValueError),  # NaN compares false with every position
    ],
)
@pytest.mark.parametrize("call", ["insert", "touch", "unpin"])
def test_key_positions_that_hold_no_number_are_refused_before_any_change(
    positions: dict[OffloadKey, object], error: type[Exception], call: str
) -> None:
    policy = _filled()
    before = _state(policy)
    ctx = ReqContext("r1", key_positions=positions)  # type: ignore[arg-type]
    args: list[OffloadKey] = [key(9), key(1), key(4)]
    with pytest.raises(error, match=r"key_positions of request 'r1' maps .*expected an int"):
        getattr(policy, call)(args, ctx)
    assert _state(policy) == before


@pytest.mark.parametrize(
    ("width", "period"),
    [(64.0, 8), ("64", 8), (True, 8), (64, math.nan), (64, 2.5), (64, "8")],
)
def test_a_sketch_shape_that_is_not_a_positive_integer_is_refused(
    width: object, period: object
) -> None:
    # A float width failed on a missing bit_length; a NaN period was taken, and the counts
    # then never aged.
    with pytest.raises(ValueError, match=r"width=.*, period=.* are invalid; expected both"):
        FrequencySketch(width, period)  # type: ignore[arg-type]


def test_a_sketch_of_numpy_integers_counts_and_ages() -> None:
    sketch = FrequencySketch(np.int64(64), np.int64(8))  # type: ignore[arg-type]
    h = key_hash(key(1))
    assert [sketch.add(h) for _ in range(8)][-1] == 4  # 8 counted, then halved


def test_a_sketch_wider_than_its_hash_is_refused_by_name() -> None:
    # bytearray raised "cannot fit 'int' into an index-sized integer", naming nothing.
    with pytest.raises(ValueError, match=r"width=2305843009213693952 is invalid; expected at"):
        FrequencySketch(1 << 61, 8)
    with pytest.raises(MemoryError, match=r"sketch_width=4611686018427387904 x capacity=1 is "):
        KVAwarePolicy(1, sketch_width=1 << 62)


@pytest.mark.parametrize("hashed", [key_hash, lambda k: FrequencySketch(64, 64).estimate_key(k)])
@pytest.mark.parametrize("bad", ["abc", ("abc",), bytearray(b"abc")])
def test_a_key_that_is_not_bytes_has_no_process_independent_hash(
    hashed: Callable[[object], int], bad: object
) -> None:
    # hash() of a str is salted per process: it was returned as if it were stable.
    with pytest.raises(TypeError, match="offload keys are bytes"):
        hashed(bad)
