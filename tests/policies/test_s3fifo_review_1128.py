"""S3-FIFO's per-request tokens: taken only by a request that uses a key the policy holds."""

from __future__ import annotations

from kvtier.base import OffloadKey, ReqContext, make_offload_key
from kvtier.policies import S3FIFOPolicy
from kvtier.policies.s3fifo import _LIVE_REQUESTS


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def test_a_request_naming_only_keys_the_policy_does_not_hold_takes_no_token() -> None:
    """A token only tells one request's repeated reports apart; a request whose calls reach no
    held key had one anyway (and, for a late empty unpin, one never dropped)."""
    p = S3FIFOPolicy(10)
    p.insert([key(0), key(1)], None)
    p.pin([key(1)])
    p.touch([key(100)], ReqContext("absent"))  # not held
    p.touch([key(1)], ReqContext("pinned"))  # pinned: touch ignores it
    p.touch([], ReqContext("nothing"))
    p.unpin([key(0)], ReqContext("not-pinned"))  # held, but no load pinned it
    p.unpin([], ReqContext("late"))  # a load ending after its request, its key still pinned
    assert p.table_sizes()["request_tokens"] == 0
    # A request that does use a held key is remembered, and counted once for its two reports.
    user = ReqContext("pinned")
    p.unpin([key(1)], user)
    p.touch([key(1), key(100)], user)
    assert p.table_sizes()["request_tokens"] == 1
    p.on_request_finished(user)
    assert p.table_sizes()["request_tokens"] == 0
    p.insert([key(i) for i in range(2, 10)], None)
    # Small target 1, promotion at frequency 2: key 1's single request did not promote it.
    assert p.evict(2, ()) == [key(0), key(1)]


def test_requests_naming_only_other_keys_do_not_push_out_a_live_requests_token() -> None:
    """With a token for every request, as many live requests naming only keys the tier does
    not hold as the bound pushed out the token of one still running, whose end-of-request
    report then counted again: one request promoted its key."""
    p = S3FIFOPolicy(10)  # small target 1, promotion at frequency 2
    p.insert([key(0)], None)
    first = ReqContext("r")
    p.touch([key(0)], first)
    for i in range(_LIVE_REQUESTS):
        p.touch([key(1_000 + i)], ReqContext(f"other-{i}"))
    assert p.table_sizes()["request_tokens"] == 1
    p.touch([key(0)], first)  # the same request's end-of-request report
    p.on_request_finished(first)
    p.insert([key(i) for i in range(1, 10)], None)
    assert p.evict(1, ()) == [key(0)]  # one request's use: not promoted
