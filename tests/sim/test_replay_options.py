"""Edges of the simulator's Python options: bad values fail once, when given, and say what."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvtier.sim.bounds import opt_result
from kvtier.sim.runner import ReplayOptions
from kvtier.sim.shapes import parse_capacity
from kvtier.sim.trace import Trace

MakeTrace = Callable[..., Trace]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"mode": "engine", "store_on": "on_evict"}, "store_on"),
        ({"mode": "flat", "store_on": "later"}, "store_on"),
        ({"mode": "engine", "device_blocks": -1}, "device_blocks"),
        ({"mode": "engine", "device_blocks": 2.0}, "device_blocks"),
        ({"store_threshold": -1}, "store_threshold"),
        ({"max_tracker_size": 0}, "max_tracker_size"),
        ({"store_threshold": 2, "tracker_per_slot": float("nan")}, "tracker_per_slot"),
        ({"store_threshold": 2, "tracker_per_slot": 0.0}, "tracker_per_slot"),
        ({"store_threshold": 2, "tracker_per_slot": -5.0}, "tracker_per_slot"),
    ],
)
def test_replay_options_refuse_bad_values_when_built(kwargs: dict[str, Any], field: str) -> None:
    """Before, these were accepted and every run of a grid failed on its own (NaN with
    "cannot convert float NaN to integer"), or, for 0 or a negative per-slot tracker, the
    tracker silently held one key."""
    with pytest.raises(ValueError, match=field):
        ReplayOptions(**kwargs)


def test_replay_options_keep_accepting_what_the_cli_builds() -> None:
    ReplayOptions(mode="engine", device_blocks=0, store_on="on-evict", hits_as="touch")
    ReplayOptions(store_threshold=2, max_tracker_size=1, tracker_per_slot=float("inf"))
    ReplayOptions(store_threshold=2, tracker_per_slot=1e300)


def test_opt_calls_a_misspelt_store_on_invalid(make_trace: MakeTrace) -> None:
    """Not "opt is exact only where every miss may be stored at once ... not supported",
    which reads as if `on_evict` were a mode that OPT merely cannot bound."""
    trace = make_trace(1)
    with pytest.raises(ValueError, match=r"store_on='on_evict' is invalid; expected one of"):
        opt_result(trace, 2, mode="engine", device_blocks=1, store_on="on_evict")
    with pytest.raises(ValueError, match="not supported"):
        opt_result(trace, 2, mode="engine", device_blocks=1, store_on="on-evict")


@pytest.mark.parametrize("spec", ["1" * 5000, "1" * 5000 + "%", "1" * 5000 + "GiB"])
def test_a_capacity_of_thousands_of_digits_is_refused_as_a_capacity(spec: str) -> None:
    """Before: Python's "Exceeds the limit (4300 digits) for integer string conversion"."""
    with pytest.raises(ValueError, match=r"^capacity '1{10}.*digits"):
        parse_capacity(spec, unique_blocks=1000, block_bytes=64)
    with pytest.raises(ValueError, match="too large"):
        parse_capacity("1" * 400, unique_blocks=1000)
