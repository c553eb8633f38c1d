"""`run_grid` and `run_named` with a capacity that is not a number of blocks."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from kvtier.sim.runner import ReplayError, ReplayOptions, run_grid, run_named
from kvtier.sim.trace import Trace

MakeTrace = Callable[..., Trace]


@pytest.mark.parametrize("jobs", [1, 2])
@pytest.mark.parametrize(
    ("policy", "capacity"), [("lru", True), ("opt", False), ("infinite", True), ("arc", 2.0)]
)
def test_a_capacity_that_is_not_a_block_count_is_refused_before_any_run(
    policy: str, capacity: object, jobs: int, make_trace: MakeTrace
) -> None:
    """A bool was reported as "at capacity 1 blocks failed" (True) after the runs before it,
    or, for the infinite cache, replayed as if valid."""
    trace = make_trace(1)
    heard: list[int] = []
    runs = [("lru", 4), (policy, capacity)]
    expected = f"capacity={capacity!r} for policy {policy!r} is invalid; expected a number of"
    with pytest.raises(ValueError, match="^" + re.escape(expected)) as info:
        run_grid(trace, runs, ReplayOptions(), jobs=jobs, progress=heard.append)  # type: ignore[arg-type]
    assert not isinstance(info.value, ReplayError)
    assert heard == []  # refused before the valid run ahead of it started


def test_run_named_names_a_capacity_that_is_no_int_as_given(make_trace: MakeTrace) -> None:
    # `{capacity:,}` printed True as 1, and a str raised "Cannot specify ',' with 's'." from
    # inside the error handler instead of the ReplayError.
    trace = make_trace(1)
    for capacity, shown in ((True, "True"), ("3", "'3'")):
        with pytest.raises(ReplayError, match=rf"^policy 'lru' at capacity {shown} failed: "):
            run_named(trace, "lru", capacity, ReplayOptions())  # type: ignore[arg-type]
