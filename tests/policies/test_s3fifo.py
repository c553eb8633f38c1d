"""S3-FIFO-specific behaviour."""

from __future__ import annotations

import pytest

from kvtier.base import OffloadKey, make_offload_key
from kvtier.policies import S3FIFOPolicy


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def test_one_hit_wonders_leave_from_small_queue_into_ghost() -> None:
    s3 = S3FIFOPolicy(20)  # small queue target: 2
    s3.insert([key(i) for i in range(20)], None)
    assert s3.evict(1, set()) == [key(0)]
    assert s3.table_sizes()["ghost"] == 1
    s3.insert([key(0)], None)  # ghost hit: straight into main
    assert s3.table_sizes()["main"] == 1 and s3.table_sizes()["ghost"] == 0


def test_reused_small_key_is_promoted_not_evicted() -> None:
    s3 = S3FIFOPolicy(20)
    s3.insert([key(i) for i in range(20)], None)
    s3.touch([key(0)], None)
    s3.touch([key(0)], None)  # freq 2 > 1: the paper's promotion threshold
    assert s3.evict(1, set()) == [key(1)]
    assert key(0) in s3 and s3.table_sizes()["main"] == 1


def test_main_queue_gives_reused_keys_a_second_chance() -> None:
    s3 = S3FIFOPolicy(10)
    for i in range(10):
        s3.insert([key(i)], None)
        s3.touch([key(i)], None)
        s3.touch([key(i)], None)
    for _ in range(9):  # promote most of them; the small queue is 1 key
        s3.evict(1, set())
    assert s3.table_sizes()["ghost"] == 0


def test_bad_small_ratio_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"small_ratio=1\.5"):
        S3FIFOPolicy(10, small_ratio=1.5)


@pytest.mark.parametrize("bad", [0, -1, 4, 1.5, True])
def test_bad_promote_freq_is_rejected(bad: object) -> None:
    # Frequencies stop at 3: a threshold of 4 would promote nothing, 0 everything.
    with pytest.raises(ValueError, match=f"promote_freq={bad!r}"):
        S3FIFOPolicy(10, promote_freq=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("second_id", ["chat-8", "chat-7"])
def test_a_request_reusing_a_finished_requests_id_is_counted_anew(second_id: str) -> None:
    """The policy kept the id of the request that counted a key past its end: a new request
    with that id got no count for its use, and the key left as a one-hit wonder."""
    from kvtier.base import ReqContext

    p = S3FIFOPolicy(10)  # small target 1, promotion at frequency 2
    p.insert([key(0)], ReqContext("writer"))
    for req_id in ("chat-7", second_id):
        ctx = ReqContext(req_id)
        p.touch([key(0)], ctx)
        p.on_request_finished(ctx)
    p.insert([key(i) for i in range(1, 10)], None)
    assert p.evict(1, ()) == [key(1)]  # key 0 was promoted by its two requests
    assert p.table_sizes()["request_tokens"] == 0


def test_a_request_still_running_is_not_forgotten_among_many_live_ones() -> None:
    """An engine touches a request's device hits when it arrives and again when it ends; with
    a bound of 512 live requests, 512 others arriving in between made the second touch count
    again, and one request promoted its key."""
    from kvtier.base import ReqContext

    p = S3FIFOPolicy(10)
    p.insert([key(0)], ReqContext("writer"))
    first = ReqContext("r")
    p.touch([key(0)], first)
    for i in range(1_000):  # other live requests, touching nothing the tier holds
        p.touch([key(100 + i)], ReqContext(f"other-{i}"))
    p.touch([key(0)], first)  # the same request's end-of-request report
    p.on_request_finished(first)
    p.insert([key(i) for i in range(1, 10)], None)
    assert p.evict(1, ()) == [key(0)]  # one request's use: not promoted
