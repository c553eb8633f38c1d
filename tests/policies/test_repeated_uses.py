"""Cache policies: one request's use counts once however often it is reported; registry errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import key, run_reports
from kvtier.base import ReqContext
from kvtier.cpu import CPUOffloadingManager
from kvtier.policies import (
    CachePolicy,
    S3FIFOPolicy,
    get_policy_cls,
    make_policy,
    registered_policies,
)

# kvaware counts a key once per request too, but has no per-call rule without a request (its
# own tests pin that), so the call-level checks below cover the four simple policies.
SIMPLE = ("lru", "arc", "s3fifo", "sieve")
CAPACITY = 10


def behaviour(policy: CachePolicy) -> list[object]:
    """What a policy does from here on: each step inserts a new key and evicts one (with its
    table sizes), so the order and every frequency the policy keeps shows in the victims."""
    seen: list[object] = []
    for i in range(3 * CAPACITY):
        victims = policy.evict(1, ()) if len(policy) else []
        policy.insert([key(1000 + i)], None)
        seen.append((victims, policy.table_sizes()))
    return seen


def history_twin(name: str) -> CachePolicy:
    """A full policy with a few uses behind it; each call builds the same state afresh."""
    policy = make_policy(name, CAPACITY)
    policy.insert([key(i) for i in range(CAPACITY)], ReqContext("r0"))
    policy.touch([key(1), key(3)], ReqContext("r1"))
    return policy


@pytest.mark.parametrize("ctx", [None, ReqContext("r2")], ids=["no-request", "request"])
@pytest.mark.parametrize("name", SIMPLE)
def test_a_key_given_twice_in_one_touch_is_one_use(name: str, ctx: ReqContext | None) -> None:
    # LRU, ARC and SIEVE record a use by position or a bit, so a repeat changes nothing; the
    # manager's complete_load unpins a key loaded twice once. S3-FIFO counted the repeat: a
    # key reported twice in one call left the small queue as if two requests had reused it.
    once, twice = history_twin(name), history_twin(name)
    once.touch([key(5)], ctx)
    twice.touch([key(5), key(5)], ctx)
    assert behaviour(twice) == behaviour(once)


@pytest.mark.parametrize("name", SIMPLE)
def test_one_requests_repeated_reports_are_one_use(name: str) -> None:
    # The connector reports one use more than once: a device hit when the request arrives and
    # again when it ends, a load's unpin and then the end-of-request touch (docs/policies.md).
    r2 = ReqContext("r2")
    once = history_twin(name)
    once.touch([key(5)], r2)
    repeated = history_twin(name)
    repeated.touch([key(5)], r2)
    repeated.touch([key(5)], r2)
    assert behaviour(repeated) == behaviour(once)

    loaded_once = history_twin(name)
    loaded_once.pin([key(5)])
    loaded_once.unpin([key(5)], r2)
    loaded = history_twin(name)
    loaded.pin([key(5)])
    loaded.unpin([key(5)], r2)
    loaded.touch([key(5)], r2)
    assert behaviour(loaded) == behaviour(loaded_once)


def test_s3fifo_promotes_a_key_two_requests_used_but_not_one_request_twice() -> None:
    def small_keys_after(reports: list[ReqContext | None]) -> set[object]:
        s3 = S3FIFOPolicy(20)  # small target 2: key 0 leaves small at the first eviction
        s3.insert([key(i) for i in range(20)], ReqContext("r0"))
        for ctx in reports:
            s3.touch([key(0)], ctx)
        s3.evict(1, ())
        return {k for k in s3._small}

    # Two requests (or two reports without a request): promoted to main, out of small.
    assert key(0) not in small_keys_after([ReqContext("r1"), ReqContext("r2")])
    assert key(0) not in small_keys_after([None, None])
    # One request reporting its use twice is one use: key 0 is the victim and goes to ghost.
    s3 = S3FIFOPolicy(20)
    s3.insert([key(i) for i in range(20)], ReqContext("r0"))
    s3.touch([key(0)], ReqContext("r1"))
    s3.touch([key(0)], ReqContext("r1"))
    assert s3.evict(1, ()) == [key(0)]
    # A, B, A: still at least two requests, so promoted.
    s3 = S3FIFOPolicy(20)
    s3.insert([key(i) for i in range(20)], None)
    for req in ("a", "b", "a"):
        s3.touch([key(0)], ReqContext(req))
    assert s3.evict(1, ()) == [key(1)]


def test_s3fifo_load_then_end_of_request_touch_is_one_use() -> None:
    # The connector's calls for a chunk one later request loads: unpinned when the load ends,
    # then touched when the request finishes. One use, as if the touch had not come.
    def victims(end_of_request_touch: bool) -> list[list[object]]:
        manager = CPUOffloadingManager(20, "s3fifo")
        chunks = [key(i) for i in range(20)]
        for k in chunks:
            out = manager.prepare_store([k], ReqContext("writer"))
            assert out is not None
            manager.complete_store(out.keys_to_store, ReqContext("writer"))
        reader = ReqContext("reader")
        manager.prepare_load([chunks[0]], reader)
        manager.complete_load([chunks[0]], reader)
        if end_of_request_touch:
            manager.touch([chunks[0]], reader)
        evicted: list[list[object]] = []
        for i in range(40):
            out = manager.prepare_store([key(100 + i)], ReqContext(f"next{i}"))
            assert out is not None
            manager.complete_store(out.keys_to_store, ReqContext(f"next{i}"))
            evicted.append(list(out.evicted_keys))
        return evicted

    assert victims(end_of_request_touch=True) == victims(end_of_request_touch=False)


def test_s3fifo_per_request_table_is_bounded_and_cleared() -> None:
    s3 = S3FIFOPolicy(8)
    for i in range(200):
        k = key(i)
        if len(s3) == 8:
            s3.evict(1, ())
        s3.insert([k], None)
        s3.touch([k], ReqContext(f"r{i}"))
        s3.pin([k])
        s3.unpin([k], ReqContext(f"r{i}x"))
        sizes = s3.table_sizes()
        assert sizes.pop("request_tokens") <= 512  # requests never finished: bounded apart
        assert all(v <= 2 * 8 for v in sizes.values())
    s3.remove([key(199)])
    s3.clear()
    assert all(v == 0 for v in s3.table_sizes().values())


@pytest.mark.parametrize("bad", [5, None, ["lru"], 2.5, object()])
def test_a_policy_spec_of_the_wrong_type_is_named(bad: object) -> None:
    # A spec that is neither a name nor a class failed inside the registry lookup
    # ("argument of type 'int' is not iterable", "unhashable type: 'list'").
    with pytest.raises(TypeError, match=r"cache policy .* has type"):
        get_policy_cls(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"cache policy .* has type"):
        CPUOffloadingManager(4, bad)  # type: ignore[arg-type]


def test_an_instance_instead_of_a_class_is_named() -> None:
    with pytest.raises(TypeError, match=r"cache policy .*LRUPolicy.* has type LRUPolicy"):
        make_policy(make_policy("lru", 4), 4)  # type: ignore[arg-type]


def test_s3fifo_promote_freq_takes_a_numpy_integer() -> None:
    # Sizes and counts take anything with __index__ (kvtier.base.checked_int); promote_freq
    # refused np.int64(2) as "expected an integer from 1 to 3".
    two: Any = np.int64(2)
    assert S3FIFOPolicy(10, promote_freq=two)._promote_freq == 2


# -- repeated reports, property-based ------------------------------------------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "touch", "load", "evict"]),
        st.lists(st.integers(0, 11), min_size=1, max_size=4),
        st.integers(0, 3),  # request
    ),
    max_size=60,
)


@pytest.mark.parametrize("name", sorted(registered_policies()))
@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_a_use_reported_again_by_its_request_changes_nothing(
    name: str, ops: list[tuple[str, list[int], int]]
) -> None:
    assert run_reports(name, ops, repeat=True) == run_reports(name, ops, repeat=False)
