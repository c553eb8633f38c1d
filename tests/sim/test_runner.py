"""`run_grid` and `map_trace`: forked workers, their failures, results in order."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest

from kvtier.base import OffloadKey, ReqContext
from kvtier.policies.base import _REGISTRY
from kvtier.policies.lru import LRUPolicy
from kvtier.sim.advise import advise
from kvtier.sim.runner import ReplayError, ReplayOptions, map_trace, run_grid
from kvtier.sim.trace import Trace

pytestmark = pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="workers need fork"
)


class _Boom(LRUPolicy):
    """Raises on its third store."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.stores = 0

    def insert(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        self.stores += 1
        if self.stores > 2:
            raise RuntimeError("kaboom")
        super().insert(keys, ctx)


class _Slow(LRUPolicy):
    """Sleeps on every use and store: a run of half a minute."""

    def touch(self, keys: Iterable[OffloadKey], ctx: ReqContext | None) -> None:
        time.sleep(0.2)
        super().touch(keys, ctx)

    def insert(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        time.sleep(0.2)
        super().insert(keys, ctx)


class _Dies(LRUPolicy):
    """Kills its own process, as the OOM killer would."""

    def insert(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture(autouse=True)
def _test_policies(monkeypatch: pytest.MonkeyPatch) -> None:
    # Registered for this test only; forked workers inherit the registry.
    monkeypatch.setitem(_REGISTRY, "boom", _Boom)
    monkeypatch.setitem(_REGISTRY, "slow", _Slow)
    monkeypatch.setitem(_REGISTRY, "dies", _Dies)


def _stable(result: object) -> dict[str, object]:
    row = dataclasses.asdict(result)  # type: ignore[call-overload]
    return {k: v for k, v in row.items() if k not in ("seconds", "blocks_per_s")}


def test_jobs_give_the_same_rows_in_the_same_order(make_trace: Callable[..., Trace]) -> None:
    trace = make_trace(3, num_requests=150)
    runs = [(p, c) for p in ("lru", "arc", "opt", "s3fifo") for c in (3, 9, 30)]
    runs.append(("infinite", trace.num_unique_blocks))
    opts = ReplayOptions(mode="engine", device_blocks=4)
    one = run_grid(trace, runs, opts, jobs=1)
    for jobs in (2, 3, 100):
        calls: list[int] = []
        many = run_grid(trace, runs, opts, jobs=jobs, progress=calls.append)
        assert [_stable(r) for r in many] == [_stable(r) for r in one]
        assert sum(calls) == len(trace) * len(runs)  # the bar reaches its total


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_failing_run_is_named(make_trace: Callable[..., Trace], jobs: int) -> None:
    trace = make_trace(1)
    with pytest.raises(ReplayError, match=r"^policy 'boom' at capacity 7 blocks failed: "):
        run_grid(trace, [("lru", 5), ("boom", 7)], ReplayOptions(), jobs=jobs)
    with pytest.raises(ReplayError, match=r"RuntimeError: kaboom$"):
        advise(trace, "boom", 0.5, ReplayOptions(), 1)


def test_a_failure_stops_the_other_workers_at_once(make_trace: Callable[..., Trace]) -> None:
    trace = make_trace(1)
    start = time.monotonic()
    with pytest.raises(ReplayError, match="'boom' at capacity 3 blocks"):
        runs = [("slow", 5), ("boom", 3), ("slow", 6), ("slow", 7)]
        run_grid(trace, runs, ReplayOptions(), jobs=2)
    # Waiting for the slow runs would take a minute and more.
    assert time.monotonic() - start < 10
    assert not multiprocessing.active_children()


def test_a_worker_that_dies_is_reported(make_trace: Callable[..., Trace]) -> None:
    trace = make_trace(1)
    with pytest.raises(ReplayError, match="a worker process died"):
        run_grid(trace, [("lru", 5), ("dies", 6)], ReplayOptions(), jobs=2)
    assert not multiprocessing.active_children()


def test_request_contexts_are_built_once_before_the_fork(make_trace: Callable[..., Trace]) -> None:
    # Built in each worker they would cost every worker a copy of them.
    trace = make_trace(2)
    run_grid(trace, [("lru", 5), ("arc", 5)], ReplayOptions(), jobs=2)
    assert all(req._ctx is not None for req in trace.requests)


def test_jobs_are_checked(make_trace: Callable[..., Trace]) -> None:
    trace = make_trace(1)
    jobs: Any
    for jobs in (0, -2, True, 2.0):  # True ran as one job, 2.0 as two
        with pytest.raises(ValueError, match=f"jobs={jobs} is invalid"):
            map_trace(trace, advise, [("lru", 0.1, ReplayOptions(), 1)], jobs=jobs)
    assert map_trace(trace, advise, [], jobs=4) is None  # nothing to fork for
