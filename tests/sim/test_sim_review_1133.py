"""The simulator's Python API refuses what it cannot replay, before any replay, with an error
naming the value and what was expected: device-cache and tracker options that the mode or
admission would ignore (the CLI refuses them too), a misspelt policy, `opt` where it is not
exact, a trace that is not a `Trace` or holds no blocks, options of the wrong type, a target
or resolution `advise` cannot search for, and capacity and shape specs of the wrong type."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.base import make_offload_key
from kvtier.cli import main
from kvtier.sim import (
    ReplayOptions,
    Request,
    Trace,
    advise,
    opt_result,
    parse_capacity,
    parse_model_shape,
    run_grid,
    run_one,
)

MakeTrace = Callable[..., Trace]
ENGINE_ONLY = "only to mode='engine', not mode='flat'"


def _never(*args: object, **kwargs: object) -> None:
    raise AssertionError("a replay ran before the arguments were checked")


@pytest.fixture
def no_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.sim import runner

    monkeypatch.setattr(runner, "run_one", _never)
    monkeypatch.setattr(runner, "opt_result", _never)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"device_blocks": 5}, "device_blocks=5 applies"),
        ({"store_on": "on-evict"}, "store_on='on-evict' applies"),
        ({"device_blocks": 5, "store_on": "on-evict"}, "device_blocks=5 and store_on="),
    ],
)
def test_device_options_in_flat_mode_are_refused_as_the_cli_refuses_them(
    kwargs: dict[str, Any],
    named: str,
    make_trace: MakeTrace,
    tmp_path: Path,
    trace_file: Callable[[Path, list[dict[str, object]]], Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """They were ignored: the row of a flat replay read as if a device were in front."""
    with pytest.raises(ValueError, match=rf"^{named}.*{ENGINE_ONLY}; expected mode='engine'"):
        ReplayOptions(mode="flat", **kwargs)
    trace = make_trace(2, num_requests=20)
    with pytest.raises(ValueError, match=ENGINE_ONLY):
        opt_result(trace, 2, **kwargs)
    # What describes flat mode exactly passes, and engine mode takes them all.
    ReplayOptions(mode="flat", device_blocks=0, store_on="eager")
    ReplayOptions(mode="engine", **kwargs)
    # The CLI's own refusal comes first and reads as it did.
    path = trace_file(tmp_path / "t.jsonl", [{"input_length": 8, "hash_ids": [1, 2]}])
    flags = {"device_blocks": ["--device-capacity", "5"], "store_on": ["--store", "on-evict"]}
    args = [flag for name in kwargs for flag in flags[name]]
    assert main(["simulate", str(path), "-q", *args]) == 2
    given = " and ".join(args[::2])
    verb = "apply" if len(kwargs) > 1 else "applies"
    assert capsys.readouterr().err == (
        f"kvtier simulate: error: {given} {verb} only to --mode engine\n"
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tracker_size": 10},
        {"tracker_per_slot": 5.0},
        {"store_threshold": 1, "max_tracker_size": 10},
    ],
)
def test_a_tracker_bound_without_reuse_admission_is_refused(kwargs: dict[str, Any]) -> None:
    """Only reuse admission (store_threshold 2 or more) has a tracker: the bound was ignored
    and the row showed no tracker."""
    with pytest.raises(ValueError, match=r"has no effect with store_threshold=[01]; expected "):
        ReplayOptions(**kwargs)
    ReplayOptions(**{**kwargs, "store_threshold": 2})


def test_a_misspelt_policy_fails_the_grid_before_any_replay(
    make_trace: MakeTrace, no_replay: None
) -> None:
    """Every run before it was replayed first (minutes each on a real trace), and the error
    came wrapped as a failed replay."""
    trace = make_trace(2, num_requests=20)
    with pytest.raises(ValueError, match="unknown cache policy 'lruu'; expected one of: "):
        run_grid(trace, [("lru", 2), ("opt", 2), ("lruu", 2)], ReplayOptions())
    with pytest.raises(TypeError, match="cache policy 5 has type int"):
        run_grid(trace, [("lru", 2), (5, 2)], ReplayOptions())  # type: ignore[list-item]


def test_opt_with_stores_on_eviction_fails_the_grid_before_any_replay(
    make_trace: MakeTrace, no_replay: None
) -> None:
    trace = make_trace(2, num_requests=20)
    opts = ReplayOptions(mode="engine", device_blocks=2, store_on="on-evict")
    with pytest.raises(ValueError, match=r"policy 'opt' is exact only where .* store_on='on-evi"):
        run_grid(trace, [("lru", 2), ("opt", 2)], opts)


@pytest.mark.parametrize(
    ("runs", "message"),
    [
        ("lru", r"runs='lru' is invalid; expected \(policy, capacity\) pairs"),
        ([("lru", 2), "lru"], r"runs\[1\]='lru' is invalid; expected a \(policy, capacity\) pa"),
        ([("lru", 2, 3)], r"runs\[0\]=\('lru', 2, 3\) is invalid"),
    ],
)
def test_runs_that_are_not_policy_capacity_pairs_are_named(
    make_trace: MakeTrace, runs: Any, message: str, no_replay: None
) -> None:
    """It said only `not enough values to unpack (expected 2, got 1)`."""
    with pytest.raises(ValueError, match=message):
        run_grid(make_trace(2, num_requests=20), runs, ReplayOptions())


def test_a_trace_that_is_not_a_trace_or_holds_no_blocks_is_refused(
    make_trace: MakeTrace, no_replay: None
) -> None:
    """A list of requests failed deep in the replay; a trace without blocks gave rows of
    0/0 ratios reported as 0.0 (the CLI refuses such a trace)."""
    trace = make_trace(2, num_requests=20)
    for call in (
        lambda t: run_grid(t, [("lru", 2)], ReplayOptions()),
        lambda t: advise(t, "lru", 0.5, ReplayOptions(), 1),
    ):
        with pytest.raises(TypeError, match="trace has type list; expected a Trace"):
            call(trace.requests)
        with pytest.raises(ValueError, match="trace 'none' has no blocks to replay"):
            call(Trace([Request("r1", [], 0, 4)], name="none"))
    with pytest.raises(TypeError, match="trace has type list; expected a Trace"):
        run_one(trace.requests, "lru", 2, ReplayOptions())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="trace has type list; expected a Trace"):
        opt_result(trace.requests, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="trace 'none' has no blocks to replay"):
        opt_result(Trace([], name="none"), 2)


def test_options_of_another_type_are_refused(make_trace: MakeTrace, no_replay: None) -> None:
    """`{"mode": "engine"}` failed every run, each with an AttributeError."""
    trace = make_trace(2, num_requests=20)
    with pytest.raises(TypeError, match=r"opts=\{'mode': 'engine'\} has type dict; expected Re"):
        run_grid(trace, [("lru", 2)], {"mode": "engine"})  # type: ignore[arg-type]


@pytest.mark.parametrize("target", [math.nan, -0.5, 1.5, "0.5", True])
def test_advise_refuses_a_target_no_hit_ratio_can_be(
    make_trace: MakeTrace, target: Any, no_replay: None
) -> None:
    """NaN was answered `never`, a negative target 1 block, a str failed deep in the search."""
    trace = make_trace(2, num_requests=20)
    with pytest.raises(ValueError, match="is invalid; expected a block hit ratio from 0 to 1"):
        advise(trace, "lru", target, ReplayOptions(), 1)


@pytest.mark.parametrize("resolution", [2.5, True, "1"])
def test_advise_refuses_a_resolution_that_is_no_block_count(
    make_trace: MakeTrace, resolution: Any, no_replay: None
) -> None:
    trace = make_trace(2, num_requests=20)
    with pytest.raises(ValueError, match=rf"resolution={resolution!r} is invalid; expected an in"):
        advise(trace, "lru", 0.5, ReplayOptions(), resolution)


def test_advise_refuses_a_policy_it_cannot_replay_before_any_replay(
    make_trace: MakeTrace, no_replay: None
) -> None:
    """A misspelt name came back as a failed replay (`ReplayError`) after the first replay."""
    trace = make_trace(2, num_requests=20)
    with pytest.raises(ValueError, match="unknown cache policy 'lruu'"):
        advise(trace, "lruu", 0.5, ReplayOptions(), 1)
    opts = ReplayOptions(mode="engine", store_on="on-evict")
    with pytest.raises(ValueError, match="policy 'opt' is exact only where"):
        advise(trace, "opt", 0.5, opts, 1)


def test_a_trace_of_anything_but_requests_is_refused() -> None:
    """A path given as the requests was read a character at a time, failing on `.keys`."""
    with pytest.raises(TypeError, match=r"requests\[0\]='t' has type str; expected a Request"):
        Trace("t.jsonl")  # type: ignore[arg-type]
    key = make_offload_key(b"k", 0)
    with pytest.raises(TypeError, match=r"requests\[1\]=\{'keys'"):
        Trace([Request("r", [key], 4, 4), {"keys": [key]}])  # type: ignore[list-item]


def test_capacity_and_shape_specs_of_another_type_are_named() -> None:
    with pytest.raises(TypeError, match="capacity 5 has type int; expected a str such as '5%'"):
        parse_capacity(5, unique_blocks=10)  # type: ignore[arg-type]
    # A negative count gave "less than one block" for 50%; a float a share of a fraction.
    for unique in (-10, 10.5, "10"):
        with pytest.raises(ValueError, match=rf"unique_blocks={unique!r} is invalid"):
            parse_capacity("50%", unique_blocks=unique)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_bytes=0 is invalid"):
        parse_capacity("1GiB", unique_blocks=10, block_bytes=0)
    with pytest.raises(TypeError, match="model shape None has type NoneType; expected a str"):
        parse_model_shape(None)  # type: ignore[arg-type]


def test_a_replay_through_no_manager_is_refused(make_trace: MakeTrace) -> None:
    """It failed on the first hit: `'NoneType' object has no attribute 'touch'`."""
    from kvtier.sim import replay_engine, replay_flat

    trace = make_trace(2, num_requests=20)
    with pytest.raises(TypeError, match="mgr=None has type NoneType; expected a CPUOffloadin"):
        replay_flat(trace, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mgr='lru' has type str; expected a CPUOffloadingMan"):
        replay_engine(trace, "lru", device_blocks=2)  # type: ignore[arg-type]


def test_a_replay_row_reports_the_managers_store_threshold() -> None:
    """The row said store_threshold 0 for a manager admitting on the third sighting (its
    skipped stores unexplained), and 2 for one admitting every block, as the caller said."""
    from kvtier.sim import make_manager, replay_engine, replay_flat

    key = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(2)]
    trace = Trace([Request(f"r{i}", key, 8, 4) for i in range(5)])
    row = replay_flat(trace, make_manager("lru", 4, store_threshold=3))
    assert (row.store_threshold, row.stores_skipped) == (3, 4)
    with pytest.raises(ValueError, match=r"store_threshold=2 does not match the manager's adm"):
        replay_engine(trace, make_manager("lru", 4), device_blocks=1, store_threshold=2)
    # Below 2 every threshold admits every block: a 1 given is the caller's to report.
    assert replay_flat(trace, make_manager("lru", 4), store_threshold=1).store_threshold == 1


def test_two_requests_of_one_id_are_refused() -> None:
    """Reuse admission counts the distinct ids that offer a block: five requests of one id
    were one request, and a store threshold of 2 stored nothing (0% hits, without a word)."""
    key = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(2)]
    with pytest.raises(ValueError, match=r"requests\[1\] has req_id 'r', as requests\[0\] has"):
        Trace([Request("r", key, 8, 4) for _ in range(5)])
