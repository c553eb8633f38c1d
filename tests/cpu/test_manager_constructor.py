"""The manager's constructor refuses settings it would misread or ignore (review 4)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.admission import AlwaysAdmit, ReuseAdmission
from kvtier.cpu import CPUOffloadingManager


@pytest.mark.parametrize("bad", ["false", "no", 0, 1, None])
def test_enable_events_must_be_a_bool(bad: object) -> None:
    # "false" is truthy: events were collected (and merged with a warning) for nobody.
    with pytest.raises(ValueError, match=rf"enable_events={bad!r} is invalid; expected a bool"):
        CPUOffloadingManager(4, enable_events=bad)  # type: ignore[arg-type]


def test_enable_events_accepts_python_and_numpy_bools() -> None:
    assert CPUOffloadingManager(4, enable_events=np.bool_(True))._events == []  # type: ignore[arg-type]
    assert CPUOffloadingManager(4, enable_events=False)._events is None


@pytest.mark.parametrize("bad", ["reuse", ReuseAdmission, 2])
def test_admission_must_be_an_admission_policy_instance(bad: object) -> None:
    with pytest.raises(TypeError, match=r"admission=.*expected an AdmissionPolicy instance"):
        CPUOffloadingManager(4, admission=bad)  # type: ignore[arg-type]


def test_admission_and_store_threshold_together_are_refused() -> None:
    # The threshold was silently ignored in favour of the admission object.
    with pytest.raises(ValueError, match=r"store_threshold=2 with admission=.*only one"):
        CPUOffloadingManager(4, admission=AlwaysAdmit(), store_threshold=2)
    policy = ReuseAdmission(3)
    assert CPUOffloadingManager(4, admission=policy).admission is policy
