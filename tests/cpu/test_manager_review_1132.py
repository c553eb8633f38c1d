"""Review of the scheduler side (manager, admission, connector scheduler, plain policies):
defects found on a fresh read, each with the scenario that showed it."""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.base import OffloadKey, ReqContext, TransferResult, make_offload_key
from kvtier.connector import OffloadingScheduler, StepProgress
from kvtier.cpu import CPUOffloadingManager

TPB = 4  # tokens per block, one block a chunk
PROMPT = 9  # two full chunks, and the token the engine computes itself


def _hashes(tag: str, n: int) -> list[bytes]:
    return [f"{tag}{i}".encode().ljust(32, b".") for i in range(n)]


def _keys(hashes: Iterable[bytes]) -> list[OffloadKey]:
    return [make_offload_key(h, 0) for h in hashes]


def _results(job_ids: Iterable[int], success: bool) -> list[TransferResult]:
    return [TransferResult(j, success, 1 if success else 0, 0.0) for j in job_ids]


def _store(s: OffloadingScheduler, req_id: str, hashes: list[bytes], blocks: list[int]) -> None:
    """A request that computes and stores every chunk of `hashes`, then ends."""
    s.add_request(req_id, hashes, len(hashes) * TPB + 1)
    assert s.get_num_new_matched_tokens(req_id, 0) == 0
    meta = s.build_step_metadata([StepProgress(req_id, [blocks], len(hashes) * TPB)])
    s.on_worker_results(_results((j.job_id for j in meta.stores), True))
    assert s.request_finished(req_id) is False


def _load_planned(policy: str, slots: int) -> tuple[CPUOffloadingManager, OffloadingScheduler]:
    """ "a" stores p0 p1; "b", with the same prefix, is allocated a load of both."""
    m = CPUOffloadingManager(slots, policy)
    s = OffloadingScheduler(m, tokens_per_block=TPB)
    prefix = _hashes("p", 2)
    _store(s, "a", prefix, [0, 1])
    s.add_request("b", prefix, PROMPT)
    n = s.get_num_new_matched_tokens("b", 0)
    assert n == 2 * TPB
    s.update_state_after_alloc("b", [[4, 5, 6]], n)
    return m, s


def _evicted_after_a_load_that(success: bool) -> list[OffloadKey]:
    """LRU, 3 slots: "a" stores p0 p1; "b" loads them (the load succeeds or fails); "c"
    stores q0 into the last slot; "b" ends; "d" stores one chunk. What "d" evicts."""
    m, s = _load_planned("lru", 3)
    meta = s.build_step_metadata()
    s.on_worker_results(_results((j.job_id for j in meta.loads), success))
    assert ("b" in s.take_finished().failed_loads) is not success
    _store(s, "c", _hashes("q", 1), [7])
    assert s.request_finished("b") is False
    out = m.prepare_store(_keys(_hashes("r", 1)), ReqContext("d"))
    assert out is not None
    return list(out.evicted_keys)


def test_a_failed_load_is_not_touched_as_reused_at_the_request_end() -> None:
    """The scheduler counted the chunks of a load as the request's reuse when it planned the
    load, so the request's end touched them even when the load failed: a chunk that served
    nothing was made most recent again, and a chunk stored since (q0) was evicted before it.
    A successful load still refreshes them."""
    p1, q0 = _keys(_hashes("p", 2))[1], _keys(_hashes("q", 1))[0]
    assert _evicted_after_a_load_that(success=True) == [q0]
    # Before: [q0], as if the failed load had served p0 and p1.
    assert _evicted_after_a_load_that(success=False) == [p1]


def test_a_cancelled_load_does_not_make_the_requests_own_stores_reused() -> None:
    """ARC: "b" is preempted before its load is sent (the load is cancelled), the tier is
    reset, and "b", resumed, computes and stores the prefix itself. Its end touched those
    chunks as reused (the cancelled load's), moving its own new chunks from ARC's once-used
    list T1 to the reused list T2, which the connector avoids for chunks a request only
    stored."""
    m, s = _load_planned("arc", 8)
    s.request_preempted("b")  # before any step sent the load
    s.reset_cache()
    assert s.get_num_new_matched_tokens("b", 0) == 0
    meta = s.build_step_metadata([StepProgress("b", [[8, 9, 10]], 2 * TPB)])
    s.on_worker_results(_results((j.job_id for j in meta.stores), True))
    assert m.policy.table_sizes()["t1"] == 2
    assert s.request_finished("b") is False
    # Before: {"t1": 0, "t2": 2}.
    assert (m.policy.table_sizes()["t1"], m.policy.table_sizes()["t2"]) == (2, 0)


def test_a_load_outlived_by_a_preemption_is_not_reused() -> None:
    """Request "b" is preempted while its load is in flight; the load succeeds, but into
    blocks the engine took back. Resumed after a reset, "b" stores the prefix itself, and
    its end must not count the lost load as a reuse of those chunks."""
    m, s = _load_planned("arc", 8)
    meta = s.build_step_metadata()
    s.request_preempted("b")
    assert s.build_step_metadata().wait_for == [j.job_id for j in meta.loads]
    s.on_worker_results(_results((j.job_id for j in meta.loads), True))
    s.take_finished()
    s.reset_cache()
    assert s.get_num_new_matched_tokens("b", 0) == 0
    meta = s.build_step_metadata([StepProgress("b", [[8, 9, 10]], 2 * TPB)])
    s.on_worker_results(_results((j.job_id for j in meta.stores), True))
    assert s.request_finished("b") is False
    # Before: {"t1": 0, "t2": 2}.
    assert (m.policy.table_sizes()["t1"], m.policy.table_sizes()["t2"]) == (2, 0)
