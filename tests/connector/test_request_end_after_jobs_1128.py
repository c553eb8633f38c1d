"""The cache policy hears of a request's end only after the request's last transfer.

Before, `request_finished` ended the request in the policy at once, even with jobs in flight.
Their completions then reached the policy with the request's ctx after its end, and kvaware
and S3-FIFO, which count a key once per request, counted it again: a request that loaded a
prefix, was preempted, loaded it again and was aborted while that load ran counted the prefix
twice. Now the connector ends the request in the policy when the request leaves the
scheduler: at `request_finished` if nothing is in flight, else at its last job's completion
(in `on_worker_results`, or `fail_unreported`, after a `reset_cache` too).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import pytest

from kvtier.base import OffloadKey, ReqContext, TransferResult, make_offload_key
from kvtier.connector import OffloadingScheduler, StepProgress
from kvtier.cpu import CPUOffloadingManager
from kvtier.policies.kvaware import KVAwarePolicy
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.s3fifo import S3FIFOPolicy

TPB = 4  # tokens per block
PROMPT = 9  # two full chunks, and the token the engine computes itself


def _hashes(n: int, salt: int = 0) -> list[bytes]:
    return [bytes([salt * 16 + i + 1]) * 32 for i in range(n)]


class Recording(LRUPolicy):
    """LRU that logs every call naming a request, as (call, req_id); `fail` names calls to
    raise in (after logging), with the error to raise."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.log: list[tuple[str, str]] = []
        self.fail: dict[tuple[str, str], BaseException] = {}

    def _record(self, call: str, ctx: ReqContext | None) -> None:
        if ctx is not None:
            self.log.append((call, ctx.req_id))
            error = self.fail.get((call, ctx.req_id))
            if error is not None:
                raise error

    def insert(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        self._record("insert", ctx)
        super().insert(keys, ctx)

    def touch(self, keys: Iterable[OffloadKey], ctx: ReqContext | None) -> None:
        self._record("touch", ctx)
        super().touch(keys, ctx)

    def unpin(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        self._record("unpin", ctx)
        super().unpin(keys, ctx)

    def on_request_finished(self, ctx: ReqContext) -> None:
        self._record("end", ctx)

    def calls(self, req_id: str) -> list[str]:
        return [call for call, r in self.log if r == req_id]


def _setup(policy: Any, groups: Sequence[int] = (0,)) -> tuple[OffloadingScheduler, Any]:
    manager = CPUOffloadingManager(16, policy)
    s = OffloadingScheduler(manager, tokens_per_block=TPB, groups=groups)
    return s, manager.policy


def _ok(job_ids: Iterable[int]) -> list[TransferResult]:
    return [TransferResult(j, True) for j in job_ids]


def _store(s: OffloadingScheduler, req_id: str, salt: int = 0) -> None:
    """A request that computes and stores two chunks, then ends."""
    s.add_request(req_id, _hashes(2, salt), PROMPT)
    blocks = [[0, 1, 2]] * len(s.groups)
    meta = s.build_step_metadata([StepProgress(req_id, blocks, 8)])
    s.on_worker_results(_ok(j.job_id for j in meta.stores))
    assert s.request_finished(req_id) is False


def _load(s: OffloadingScheduler, req_id: str) -> list[int]:
    """Plan and send a load of the request's two stored chunks; the job ids (one per group)."""
    n = s.get_num_new_matched_tokens(req_id, 0)
    assert n == 2 * TPB
    s.update_state_after_alloc(req_id, [[4, 5, 6]] * len(s.groups), n)
    jobs = [j.job_id for j in s.build_step_metadata().loads]
    assert len(jobs) == len(s.groups)
    return jobs


def _count(policy: Any, key: OffloadKey) -> int:
    if isinstance(policy, KVAwarePolicy):
        return int(policy._sketch.estimate_key(key))
    assert isinstance(policy, S3FIFOPolicy)
    freq = policy._small.get(key)
    return policy._main[key] if freq is None else freq


def _load_preempt_load(s: OffloadingScheduler, abort_during_load: bool) -> None:
    """Request "r" loads the stored prefix, is preempted, loads it again, and ends: during
    that load (aborted) or after it."""
    s.add_request("r", _hashes(2), PROMPT)
    s.on_worker_results(_ok(_load(s, "r")))
    s.take_finished()
    s.request_preempted("r")
    s.build_step_metadata()
    jobs = _load(s, "r")
    if abort_during_load:
        assert s.request_finished("r") is True  # its blocks are held for the load
        s.on_worker_results(_ok(jobs))
        assert "r" in s.take_finished().sending
    else:
        s.on_worker_results(_ok(jobs))
        assert s.request_finished("r") is False
    assert s.num_requests() == 0 and s.num_jobs_in_flight() == 0


def _a_ended_storing_b_loading(s: OffloadingScheduler) -> tuple[list[int], list[int]]:
    """Request "a" ended with its stores in flight, "b" loading "w"'s prefix: their job ids."""
    _store(s, "w")
    s.add_request("a", _hashes(2, salt=1), PROMPT)
    stores = [j.job_id for j in s.build_step_metadata([StepProgress("a", [[0, 1, 2]], 8)]).stores]
    s.add_request("b", _hashes(2), PROMPT)
    loads = _load(s, "b")
    assert s.request_finished("a") is True
    return stores, loads


@pytest.mark.parametrize("policy", ["kvaware", "s3fifo"])
def test_a_key_counts_once_for_a_request_aborted_during_its_second_load(policy: str) -> None:
    """Aborted during the second load, the request counts the key as often as when it finishes
    after it: once. Before: kvaware's sketch 1 -> 2 -> 3 and S3-FIFO's freq 0 -> 1 -> 2 (the
    load completing after the request's end counted the key again), against 2 and 1."""
    key = make_offload_key(_hashes(2)[0], 0)
    counts: list[int] = []
    for abort_during_load in (False, True):
        s, p = _setup(policy)
        _store(s, "w")
        before = _count(p, key)
        _load_preempt_load(s, abort_during_load)
        counts.append(_count(p, key) - before)
        # The request is over in the policy: another request counts the key anew.
        s.add_request("q", _hashes(2), PROMPT)
        s.on_worker_results(_ok(_load(s, "q")))
        assert _count(p, key) - before == counts[-1] + 1
    assert counts == [1, 1]


def test_the_end_is_the_last_call_naming_the_request() -> None:
    """Before, aborted: [unpin, touch, end, unpin] (the second load's unpin after the end).
    Finished after the load (nothing in flight), it ends at `request_finished`, as before."""
    for abort_during_load, expected in (
        (False, ["unpin", "unpin", "touch", "end"]),
        (True, ["unpin", "touch", "unpin", "end"]),
    ):
        s, p = _setup(Recording)
        _store(s, "w")
        _load_preempt_load(s, abort_during_load)
        assert p.calls("r") == expected


def test_stores_in_flight_end_the_request_when_the_last_one_completes() -> None:
    """Two KV-cache groups, a store job each: the end comes with the second's completion,
    after its insert. Before: at `request_finished`, before either insert."""
    s, p = _setup(Recording, groups=(0, 1))
    s.add_request("a", _hashes(2), PROMPT)
    meta = s.build_step_metadata([StepProgress("a", [[0, 1, 2], [3, 4, 5]], 8)])
    first, second = (j.job_id for j in meta.stores)
    assert s.request_finished("a") is True
    assert "end" not in p.calls("a")
    s.on_worker_results(_ok([first]))
    assert "end" not in p.calls("a") and s.num_requests() == 1
    s.on_worker_results(_ok([second]))
    assert p.calls("a") == ["insert", "insert", "end"]
    assert s.num_requests() == 0 and "a" in s.take_finished().sending


def test_fail_unreported_ends_the_request_in_the_policy() -> None:
    """A worker dies with an aborted request's load in flight: `fail_unreported` ends the
    request in the scheduler, and in the policy with it, after the load's unpin."""
    s, p = _setup(Recording)
    _store(s, "w")
    s.add_request("r", _hashes(2), PROMPT)
    jobs = _load(s, "r")
    assert s.request_finished("r") is True
    assert p.calls("r") == ["touch"]
    assert s.fail_unreported() == jobs
    assert p.calls("r") == ["touch", "unpin", "end"]
    assert s.num_requests() == 0 and s.num_jobs_in_flight() == 0
    done = s.take_finished()
    assert "r" in done.sending and "r" in done.failed_loads


def test_a_job_older_than_a_reset_still_ends_its_request() -> None:
    """After `reset_cache` the load's completion leaves the manager's keys alone (no unpin),
    but the request it was the last job of still ends in the policy."""
    s, p = _setup(Recording)
    _store(s, "w")
    s.add_request("r", _hashes(2), PROMPT)
    jobs = _load(s, "r")
    assert s.request_finished("r") is True
    s.reset_cache()
    assert p.calls("r") == ["touch"]
    s.on_worker_results(_ok(jobs))
    assert p.calls("r") == ["touch", "end"]
    assert s.num_requests() == 0 and "r" in s.take_finished().sending


def test_a_policy_raising_at_the_deferred_end_raises_after_the_whole_batch() -> None:
    """The policy raises ending "a" (its store is the first report of the batch): the error
    propagates once the batch is applied; "b"'s load and "c"'s end are not lost, and nothing is
    left for `fail_unreported` to fail."""
    s, p = _setup(Recording)
    _store(s, "w")
    s.add_request("a", _hashes(2, salt=1), PROMPT)
    stores = [j.job_id for j in s.build_step_metadata([StepProgress("a", [[0, 1, 2]], 8)]).stores]
    s.add_request("b", _hashes(2), PROMPT)
    loads = _load(s, "b")
    s.add_request("c", _hashes(2, salt=2), PROMPT)
    more = [j.job_id for j in s.build_step_metadata([StepProgress("c", [[7, 8, 9]], 8)]).stores]
    assert s.request_finished("a") is True and s.request_finished("c") is True
    p.fail[("end", "a")] = RuntimeError("policy bug ending a")
    with pytest.raises(RuntimeError, match="policy bug ending a"):
        s.on_worker_results(_ok(stores + loads + more))
    assert p.calls("a")[-1] == "end" and p.calls("c")[-1] == "end"
    assert s.num_jobs_in_flight() == 0 and s.num_requests() == 1  # "b" is still running
    done = s.take_finished()
    assert done.sending == {"a", "c"} and done.recving == {"b"} and not done.failed_loads
    assert s.fail_unreported() == []
    assert s.store_jobs_failed == 0 and s.load_jobs_failed == 0
    # The stored chunks are served: the store's effects were all applied.
    s.add_request("d", _hashes(2, salt=1), PROMPT)
    assert s.get_num_new_matched_tokens("d", 0) == 2 * TPB


def test_of_several_policy_errors_the_first_is_raised_and_the_rest_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s, p = _setup(Recording)
    jobs = []
    for i, r in enumerate("ab"):
        s.add_request(r, _hashes(2, salt=i), PROMPT)
        meta = s.build_step_metadata([StepProgress(r, [[0, 1, 2]], 8)])
        jobs += [j.job_id for j in meta.stores]
        assert s.request_finished(r) is True
        p.fail[("end", r)] = RuntimeError(f"policy bug ending {r}")
    with (
        caplog.at_level(logging.ERROR, logger="kvtier.connector.scheduler"),
        pytest.raises(RuntimeError, match="policy bug ending a"),
    ):
        s.on_worker_results(_ok(jobs))
    assert [str(r.exc_info[1]) for r in caplog.records if r.exc_info] == ["policy bug ending b"]
    assert s.num_requests() == 0 and s.num_jobs_in_flight() == 0


def test_a_policy_error_is_logged_when_a_later_completion_in_the_batch_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A manager call raising later in the batch propagates as documented (its job stays in
    flight); the policy's earlier error is logged, not lost."""
    s, p = _setup(Recording)
    stores, loads = _a_ended_storing_b_loading(s)
    p.fail[("end", "a")] = RuntimeError("policy bug ending a")
    p.fail[("unpin", "b")] = ValueError("policy bug unpinning b")
    with (
        caplog.at_level(logging.ERROR, logger="kvtier.connector.scheduler"),
        pytest.raises(ValueError, match="policy bug unpinning b"),
    ):
        s.on_worker_results(_ok(stores + loads))
    assert [str(r.exc_info[1]) for r in caplog.records if r.exc_info] == ["policy bug ending a"]
    assert s.job_ids_in_flight() == loads and s.num_requests() == 1
    del p.fail[("unpin", "b")]
    assert s.fail_unreported() == loads  # recovered with its reported outcome
    assert s.num_jobs_in_flight() == 0 and "b" in s.take_finished().recving


def test_an_interrupt_in_the_deferred_end_calls_it_once() -> None:
    """A KeyboardInterrupt inside the policy's end propagates at once (the batch's later
    reports are failed by the documented recovery); the job and the request are already gone,
    so the recovery does not end the request a second time."""
    s, p = _setup(Recording)
    stores, loads = _a_ended_storing_b_loading(s)
    p.fail[("end", "a")] = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        s.on_worker_results(_ok(stores + loads))
    assert s.job_ids_in_flight() == loads and s.num_requests() == 1
    del p.fail[("end", "a")]
    assert s.fail_unreported() == loads
    assert p.calls("a").count("end") == 1
    done = s.take_finished()
    assert done.sending == {"a"} and done.failed_loads == {"b"}


def test_a_touch_that_raises_with_jobs_in_flight_defers_the_end_all_the_same() -> None:
    """The reused prefix's touch raises in `request_finished`: the error propagates, the
    request stays tracked only until its load ends, and then ends in the policy."""
    s, p = _setup(Recording)
    _store(s, "w")
    s.add_request("r", _hashes(2), PROMPT)
    jobs = _load(s, "r")
    p.fail[("touch", "r")] = RuntimeError("policy bug in touch")
    with pytest.raises(RuntimeError, match="policy bug in touch"):
        s.request_finished("r")
    assert "end" not in p.calls("r") and s.num_requests() == 1
    s.on_worker_results(_ok(jobs))
    assert p.calls("r") == ["touch", "unpin", "end"]
    assert s.num_requests() == 0 and "r" in s.take_finished().sending
