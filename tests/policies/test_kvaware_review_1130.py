"""kvaware review (2026-11-30): bad arguments are refused by name before a call changes anything.

A key that was not bytes failed part-way through insert, touch (with a request), pin, unpin
and remove, after the keys before it had moved and been counted, or was taken as a key (a str's
hash is salted per process); `evict` given a float moved the window's surplus to the main area
before it failed. Each bad call below is checked against a policy given only the valid calls.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable

import pytest

from kvtier.base import OffloadKey, ReqContext, make_offload_key
from kvtier.policies import KVAwarePolicy

BadCall = Callable[[KVAwarePolicy], object]


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def ctx(req_id: str, ids: range) -> ReqContext:
    return ReqContext(req_id, key_positions={key(i): 16 * (n + 1) for n, i in enumerate(ids)})


def _run(mode: str, bad: BadCall | None, error: type[Exception], match: str) -> object:
    """Valid calls, `bad` (which must raise `error` and change nothing) part-way, then more
    valid calls; what the policy evicts and its whole state at the end."""
    policy = KVAwarePolicy(10, mode=mode)
    policy.insert([key(i) for i in range(8)], ctx("a", range(8)))
    policy.evict(2, ())
    policy.pin([key(2), key(3)])
    if bad is not None:
        before = pickle.dumps(policy)
        with pytest.raises(error) as raised:
            bad(policy)
        assert pickle.dumps(policy) == before  # first: the old failure changed state
        assert re.search(match, str(raised.value)), raised.value
    policy.touch([key(i) for i in range(6)], ctx("b", range(6)))
    policy.unpin([key(2), key(3)], ctx("b", range(6)))
    policy.insert([key(i) for i in range(8, 12)], ctx("c", range(8, 12)))
    return policy.evict(6, ()), pickle.dumps(policy)


_BAD_KEYS = {"bytearray": bytearray(b"k"), "str": "k", "int": 7}

_CALLS: dict[str, Callable[[KVAwarePolicy, list[object]], object]] = {
    "insert": lambda p, ks: p.insert(ks, ctx("x", range(20, 22))),  # type: ignore[arg-type]
    "touch": lambda p, ks: p.touch(ks, ctx("x", range(4, 6))),  # type: ignore[arg-type]
    "touch without a request": lambda p, ks: p.touch(ks, None),  # type: ignore[arg-type]
    "pin": lambda p, ks: p.pin(ks),  # type: ignore[arg-type]
    "unpin": lambda p, ks: p.unpin(ks, ctx("x", range(2, 4))),  # type: ignore[arg-type]
    "remove": lambda p, ks: p.remove(ks),  # type: ignore[arg-type]
}
# Held keys around the bad one, so that a call applied part-way would move or count them.
_AROUND = {
    "insert": (key(20), key(21)),
    "unpin": (key(2), key(3)),
    "remove": (key(4), key(5)),
}


@pytest.mark.parametrize("mode", ["adaptive", "filter"])
@pytest.mark.parametrize("bad_key", list(_BAD_KEYS), ids=list(_BAD_KEYS))
@pytest.mark.parametrize("call", list(_CALLS))
def test_a_key_that_is_not_bytes_is_refused_by_name_before_any_change(
    call: str, bad_key: str, mode: str
) -> None:
    first, last = _AROUND.get(call, (key(4), key(5)))
    keys = [first, _BAD_KEYS[bad_key], last]
    name = type(_BAD_KEYS[bad_key]).__name__
    got = _run(
        mode,
        lambda p: _CALLS[call](p, keys),
        TypeError,
        rf"^offload keys are bytes; got {name} {re.escape(repr(_BAD_KEYS[bad_key]))}$",
    )
    assert got == _run(mode, None, TypeError, "")


@pytest.mark.parametrize("one", [key(1), "k1"], ids=["bytes", "str"])
def test_one_key_given_as_the_keys_is_refused(one: object) -> None:
    """Iterated, a bytes key is the ints 0..255, which were inserted as twelve keys."""
    policy = KVAwarePolicy(16)
    with pytest.raises(TypeError, match=rf"is one {type(one).__name__} object; expected a list"):
        policy.insert(one, None)  # type: ignore[arg-type]
    assert len(policy) == 0


def test_evict_refuses_a_count_that_is_not_an_integer_before_any_change() -> None:
    """The window (1 slot, 7 over its size) handed its surplus to main, credited with the
    counts of then, before range(1.5) failed: later uses then evicted another key."""

    def run(bad: bool) -> list[OffloadKey] | None:
        policy = KVAwarePolicy(10, mode="filter")
        policy.insert([key(i) for i in range(8)], None)
        if bad:
            before = pickle.dumps(policy)
            with pytest.raises(ValueError, match=r"^n=1\.5 is invalid; expected an integer >= 0"):
                policy.evict(1.5, ())  # type: ignore[arg-type]
            assert pickle.dumps(policy) == before
        for ids in ([2, 9, 1], [4, 1, 7], [7, 7, 10], [6, 3, 1], [7, 0, 6], [6, 9, 0]):
            policy.touch([key(i) for i in ids], None)
        return policy.evict(5, ())

    assert run(bad=True) == run(bad=False)


def test_evict_names_a_protected_key_that_cannot_be_hashed() -> None:
    policy = KVAwarePolicy(10)
    policy.insert([key(i) for i in range(4)], None)
    with pytest.raises(TypeError, match=r"^protected=.* is not a collection of offload keys"):
        policy.evict(1, [key(0), bytearray(b"k")])  # type: ignore[list-item]
    assert len(policy) == 4


@pytest.mark.parametrize("call", ["insert", "touch", "unpin", "on_request_finished"])
@pytest.mark.parametrize("bad", ["r1", {"req_id": "r1"}], ids=["str", "dict"])
def test_a_context_that_is_not_a_reqcontext_is_named(call: str, bad: object) -> None:
    """A bare request id failed on a missing attribute, naming neither it nor ReqContext."""
    policy = KVAwarePolicy(10)
    policy.insert([key(i) for i in range(4)], None)
    policy.pin([key(1)])
    before = pickle.dumps(policy)
    args = (bad,) if call == "on_request_finished" else ([key(1), key(2)], bad)
    with pytest.raises(TypeError, match=rf"^ctx={re.escape(repr(bad))} has type "):
        getattr(policy, call)(*args)
    assert pickle.dumps(policy) == before
