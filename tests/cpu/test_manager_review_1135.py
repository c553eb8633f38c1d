"""Review 1135 of the manager's retry of a policy call without the request's ctx.

Before: a ctx whose position is NaN, which kvaware refuses as "expected an int token
position" just as it does a str, passed the manager's malformed-ctx check (NaN is a `Real`):
the call was applied without the ctx and the error said so, where a str position is refused
with nothing applied so that the caller can call again with a good ctx.
"""

from __future__ import annotations

import pytest

from helpers import all_evictable, fill, key, keys
from kvtier.base import OffloadKey, ReqContext
from kvtier.cpu import CPUOffloadingManager

CTX = ReqContext("r1")


def _nan_ctx() -> ReqContext:
    # NaN first: kvaware takes the deepest position with max(), which keeps a leading NaN.
    nan: dict[OffloadKey, int] = {key(1): float("nan"), key(2): 16}  # type: ignore[dict-item]
    return ReqContext("r2", key_positions=nan)


def test_a_nan_position_at_unpin_is_refused_with_the_keys_still_pinned() -> None:
    m = CPUOffloadingManager(2, "kvaware")
    fill(m, CTX, 1, 2)
    m.prepare_load(keys(1, 2), CTX)
    with pytest.raises(TypeError, match=r"position nan; expected an int token position"):
        m.complete_load(keys(1, 2), _nan_ctx())
    assert m.get_stats().pinned == 2 and len(m.policy) == 0
    m.complete_load(keys(1, 2), CTX)  # the caller can call again with a good ctx
    assert all_evictable(m)


def test_a_nan_position_at_insert_is_refused_with_the_keys_still_pending() -> None:
    m = CPUOffloadingManager(2, "kvaware", enable_events=True)
    m.prepare_store(keys(1, 2), CTX)
    with pytest.raises(TypeError, match=r"position nan; expected an int token position"):
        m.complete_store(keys(1, 2), _nan_ctx())
    assert m.get_stats().pending_writes == 2 and len(m.policy) == 0
    assert list(m.take_events()) == []
    m.complete_store(keys(1, 2), CTX)
    assert all_evictable(m)
