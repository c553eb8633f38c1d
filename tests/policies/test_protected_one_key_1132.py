"""`evict(n, protected)` given one key instead of a collection: every registered policy took
the key for a collection of its bytes (ints), protected nothing, and could evict the key it
was asked to keep. Now a TypeError names it, and nothing changes."""

from __future__ import annotations

import pytest

from kvtier.base import make_offload_key
from kvtier.policies import get_policy_cls, registered_policies


@pytest.mark.parametrize("name", sorted(registered_policies()))
@pytest.mark.parametrize("one", ["bytes", "str"])
def test_one_key_as_protected_is_refused_and_changes_nothing(name: str, one: str) -> None:
    policy = get_policy_cls(name)(4)
    keys = [make_offload_key(bytes([i]) * 8, 0) for i in range(2)]
    policy.insert(keys, None)
    protected = keys[0] if one == "bytes" else "abc"
    with pytest.raises(TypeError, match=r"protected=.* is one (bytes|str) object; expected a"):
        policy.evict(1, protected)  # type: ignore[arg-type]
    assert len(policy) == 2 and all(k in policy for k in keys)
    # A collection of that one key still protects it.
    assert policy.evict(1, [keys[0]]) == [keys[1]]
