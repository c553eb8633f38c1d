"""Admission policies: the registry."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvtier.admission import (
    AdmissionPolicy,
    AlwaysAdmit,
    register_admission_policy,
    registered_admission_policies,
)
from kvtier.base import OffloadKey, ReqContext


def test_a_name_registered_twice_by_another_class_is_refused() -> None:
    # The cache-policy registry refuses this; the admission registry replaced the built-in
    # silently, so `kvtier policies` listed another class under "reuse".
    class Impostor(AdmissionPolicy):
        def admit(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
            return []

    before = registered_admission_policies()
    with pytest.raises(ValueError, match=r"admission policy 'reuse' is already registered"):
        register_admission_policy("reuse", "stores nothing")(Impostor)
    assert registered_admission_policies() == before
    assert registered_admission_policies()["reuse"].description == before["reuse"].description
    # The same class again (a module imported twice by two names) is not a clash.
    assert register_admission_policy("always", AlwaysAdmit.description)(AlwaysAdmit) is AlwaysAdmit
