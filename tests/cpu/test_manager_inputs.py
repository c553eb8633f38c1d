"""The manager given one key where a collection of keys belongs."""

from __future__ import annotations

import pytest

from helpers import MANAGER_KEY_CALLS, key
from kvtier.base import ReqContext
from kvtier.cpu import CPUOffloadingManager

CTX = ReqContext("r1")


def state(m: CPUOffloadingManager) -> tuple[object, ...]:
    return (
        dict(m._slot_of),
        list(m._ref),
        m.get_stats(),
        m.table_sizes(),
        m.policy.table_sizes(),
    )


CALLS = MANAGER_KEY_CALLS


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize(
    "one", [key(1), bytearray(key(1)), "k1"], ids=["bytes", "bytearray", "str"]
)
def test_one_key_instead_of_a_list_is_a_type_error_that_changes_nothing(
    policy_name: str, call: str, one: object
) -> None:
    # A bytes key is iterable: its bytes were taken as keys 0..255. touch ignored them without
    # a word (kvaware counted them in its sketch and replayed them in its shadows), the others
    # raised about "key 0" being absent or not bytes.
    m = CPUOffloadingManager(4, policy_name)
    out = m.prepare_store([key(1), key(2)], CTX)
    assert out is not None
    m.complete_store([key(1)], CTX)
    before = state(m)
    with pytest.raises(TypeError, match=r"one .* expected a collection of keys"):
        CALLS[call](m, one)
    assert state(m) == before
