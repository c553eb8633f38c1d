"""A bad tracker size is refused whatever the store threshold (review 4)."""

from __future__ import annotations

import pytest

from kvtier.admission import AlwaysAdmit, make_admission_policy
from kvtier.cpu import CPUOffloadingManager


@pytest.mark.parametrize("bad", [0, -1, "64", 2.0, True, None])
@pytest.mark.parametrize("threshold", [0, 1])
def test_bad_max_tracker_size_is_refused_below_threshold_two(bad: object, threshold: int) -> None:
    # Below threshold 2 the size was ignored; the same settings with threshold 2 raised.
    with pytest.raises(ValueError, match=r"max_tracker_size=.*expected an integer >= 1"):
        make_admission_policy(threshold, bad)  # type: ignore[arg-type]
    if bad is None:
        return  # the manager's default: the built-in tracker size
    with pytest.raises(ValueError, match=r"max_tracker_size="):
        CPUOffloadingManager(4, store_threshold=threshold, max_tracker_size=bad)  # type: ignore[arg-type]


def test_good_settings_below_threshold_two_admit_everything() -> None:
    assert type(make_admission_policy(1, 1)) is AlwaysAdmit
    assert type(CPUOffloadingManager(4, max_tracker_size=1).admission) is AlwaysAdmit
