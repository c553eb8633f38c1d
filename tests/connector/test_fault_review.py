"""Fault sequences of the connector halves over the real manager: partial reports, refused
submissions, bad step input, failed stores racing other requests, and multi-group loads."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from engine_sim import TOKENS_PER_BLOCK, Engine, Request, assert_clean, block_hashes
from helpers import FakeTransfer
from kvtier.base import LookupResult, ReqContext, TransferResult, make_offload_key
from kvtier.connector import OffloadingScheduler, OffloadingWorker, StepProgress, TransferJob
from kvtier.cpu import CPUOffloadingManager

TPB = 4  # tokens per block of the engine-free tests


def stored_events(m: CPUOffloadingManager) -> set[bytes]:
    """Keys announced as stored (and not removed since) by the events taken now."""
    out: set[bytes] = set()
    for ev in m.take_events():
        if ev.removed:
            out.difference_update(ev.keys)
        else:
            out.update(ev.keys)
    return out


def store_all(s: OffloadingScheduler, req_id: str, blocks: list[list[int]], tokens: int) -> None:
    """Plan, run and report (successfully) the stores of `tokens` computed tokens."""
    meta = s.build_step_metadata([StepProgress(req_id, blocks, tokens)])
    assert meta.stores
    s.on_worker_results(TransferResult(j.job_id, True) for j in meta.stores)


# -- one store fails while another request offered the same chunks --------------------------


def test_same_chunks_offered_by_two_requests_and_the_writer_fails(engine: Engine) -> None:
    e = engine
    e.gate.hold["store"] = gate = threading.Event()
    e.gate.fail_directions.add("store")
    a = Request("a", block_hashes("a", 3))
    e.add(a)
    e.step()  # a's three chunks are being written (and will fail)
    b = Request("b", list(a.hashes))
    # b sees a's writes in flight: it must ask again, never load them.
    assert e.add(b) is None
    e.scheduler.update_state_after_alloc("b", [], 0)
    b.blocks = [e.free_blocks.pop() for _ in range(len(b.hashes) + 1)]
    e.running["b"] = b
    meta = e.step()
    # b computed the same chunks but does not write them twice: they are a's pending writes.
    assert meta.stores == []
    gate.set()
    e.drain()
    assert e.manager.get_stats().failed_stores == 3
    ctx = ReqContext("probe")
    for h in a.hashes:
        assert e.manager.lookup(make_offload_key(h, 0), ctx) is LookupResult.MISS
    assert stored_events(e.manager) == set()  # a failed store is never announced
    e.gate.fail_directions.clear()
    e.finish("a")
    e.finish("b")
    assert e.add(Request("c", list(a.hashes))) == 0  # nothing served from the failed writes
    e.finish("c")
    assert_clean(e)


def test_abort_with_a_failing_store_in_flight_releases_everything(engine: Engine) -> None:
    e = engine
    e.gate.hold["store"] = gate = threading.Event()
    e.gate.fail_directions.add("store")
    e.add(Request("a", block_hashes("a", 3)))
    e.step()
    assert e.finish("a") is True  # the store still reads a's blocks
    assert e.manager.get_stats().pending_writes == 3
    gate.set()
    e.drain()
    assert "a" in e.last_finished.sending
    assert "a" not in e.last_finished.failed_loads
    stats = e.manager.get_stats()
    assert (stats.failed_stores, stats.stores, stats.used_slots) == (3, 0, 0)
    assert stored_events(e.manager) == set()
    assert e.scheduler.num_requests() == 0
    assert_clean(e)


def test_failed_load_leaves_the_host_copy_servable_to_the_next_request(engine: Engine) -> None:
    e = engine
    shared = block_hashes("s", 3)
    a = Request("a", shared + block_hashes("a", 1, shared)[3:])
    e.add(a)
    e.step()
    e.drain()
    e.finish("a")
    e.gate.fail_directions.add("load")
    b = Request("b", shared + block_hashes("b", 1, shared)[3:])
    assert e.add(b) == 3 * TOKENS_PER_BLOCK
    e.step()
    assert "b" in e.last_finished.failed_loads
    assert e.manager.get_stats().pinned == 0  # the failed load released its pins
    e.gate.fail_directions.clear()
    e.finish("b")
    # The device copy failed, not the host one: a new request loads the same prefix intact.
    c = Request("c", shared + block_hashes("c", 1, shared)[3:])
    assert e.add(c) == 3 * TOKENS_PER_BLOCK
    e.step()
    assert "c" not in e.last_finished.failed_loads
    assert e.loaded_blocks == 3
    e.finish("c")
    assert_clean(e)


def test_late_failure_of_a_store_from_before_a_reset_spares_the_new_copy() -> None:
    m = CPUOffloadingManager(4, enable_events=True)
    s = OffloadingScheduler(m, tokens_per_block=TPB)
    hashes = block_hashes("a", 2)
    s.add_request("a", hashes, 2 * TPB + 1)
    (old,) = s.build_step_metadata([StepProgress("a", [[0, 1, 2]], 2 * TPB)]).stores
    s.reset_cache()
    # The same chunks, stored again after the reset, into slots the old job cannot touch.
    s.add_request("b", hashes, 2 * TPB + 1)
    assert s.get_num_new_matched_tokens("b", 0) == 0
    (new,) = s.build_step_metadata([StepProgress("b", [[3, 4, 5]], 2 * TPB)]).stores
    assert not set(new.slots.tolist()) & set(old.slots.tolist())
    s.on_worker_results([TransferResult(new.job_id, True)])
    s.on_worker_results([TransferResult(old.job_id, False)])  # the old write failed, late
    ctx = ReqContext("probe")
    keys = [make_offload_key(h, 0) for h in hashes]
    assert all(m.lookup(k, ctx) is LookupResult.HIT for k in keys)
    assert stored_events(m) == set(keys)  # no removal of the new copy, no stored of the old
    stats = m.get_stats()
    assert (stats.used_slots, stats.ready, stats.failed_stores) == (2, 2, 0)
    s.add_request("c", hashes, 2 * TPB + 1)
    assert s.get_num_new_matched_tokens("c", 0) == 2 * TPB


# -- multi-group loads: the request is received only when every group's load ended -----------


def _two_group_load() -> tuple[CPUOffloadingManager, OffloadingScheduler, list[TransferJob]]:
    m = CPUOffloadingManager(16)
    s = OffloadingScheduler(m, tokens_per_block=TPB, groups=(0, 1))
    hashes = block_hashes("g", 3)
    s.add_request("a", hashes, 3 * TPB + 1)
    assert s.get_num_new_matched_tokens("a", 0) == 0
    store_all(s, "a", [[0, 1, 2, 3], [10, 11, 12, 13]], 3 * TPB)
    assert not s.request_finished("a")
    s.add_request("b", hashes, 3 * TPB + 1)
    assert s.get_num_new_matched_tokens("b", 0) == 3 * TPB
    s.update_state_after_alloc("b", [[20, 21, 22, 23], [30, 31, 32, 33]], 3 * TPB)
    loads = s.build_step_metadata().loads
    assert [j.group for j in loads] == [0, 1]
    return m, s, loads


def test_multi_group_load_is_received_only_after_every_group_loaded() -> None:
    m, s, (g0, g1) = _two_group_load()
    s.on_worker_results([TransferResult(g0.job_id, True)])
    done = s.take_finished()
    # Group 1's blocks are still being written: the engine must not use b's KV yet.
    assert "b" not in done.recving
    s.on_worker_results([TransferResult(g1.job_id, True)])
    done = s.take_finished()
    assert done.recving == {"b"} and not done.failed_loads
    assert m.get_stats().pinned == 0


def test_multi_group_load_failing_late_is_reported_with_the_receive() -> None:
    m, s, (g0, g1) = _two_group_load()
    s.on_worker_results([TransferResult(g0.job_id, True)])
    first = s.take_finished()
    s.on_worker_results([TransferResult(g1.job_id, False)])
    second = s.take_finished()
    # The request is never announced as received while a failure of its load is still to come.
    assert "b" not in first.recving
    assert "b" in second.recving and "b" in second.failed_loads
    assert set(g1.device_blocks.tolist()) <= first.failed_load_blocks | second.failed_load_blocks
    assert m.get_stats().pinned == 0


# -- bad input in the middle of a batch: an error and no change ------------------------------


def test_bad_report_in_a_batch_changes_nothing_and_the_batch_can_be_retried() -> None:
    m = CPUOffloadingManager(16)
    s = OffloadingScheduler(m, tokens_per_block=TPB)
    for r in "ab":
        s.add_request(r, block_hashes(r, 2), 2 * TPB + 1)
    meta = s.build_step_metadata(
        [StepProgress("a", [[0, 1, 2]], 2 * TPB), StepProgress("b", [[3, 4, 5]], 2 * TPB)]
    )
    ja, jb = (j.job_id for j in meta.stores)
    with pytest.raises(ValueError, match="999"):
        s.on_worker_results(
            [TransferResult(ja, True), TransferResult(999, True), TransferResult(jb, True)]
        )
    with pytest.raises(ValueError, match=str(ja)):
        s.on_worker_results([TransferResult(ja, True), TransferResult(ja, True)])
    # Neither call completed any job: the good reports are not half applied.
    assert sorted(s.job_ids_in_flight()) == sorted([ja, jb])
    assert m.get_stats().pending_writes == 4
    s.on_worker_results([TransferResult(ja, True), TransferResult(jb, True)])
    stats = m.get_stats()
    assert (stats.pending_writes, stats.ready) == (0, 4)


def test_store_progress_with_too_few_device_blocks_leaks_no_pending_write() -> None:
    m = CPUOffloadingManager(16)
    s = OffloadingScheduler(m, tokens_per_block=TPB, blocks_per_chunk=2)
    s.add_request("a", block_hashes("a", 4), 4 * TPB + 1)
    with pytest.raises(ValueError, match="device blocks"):
        s.build_step_metadata([StepProgress("a", [[0, 1, 2]], 4 * TPB)])  # 4 blocks needed
    with pytest.raises(ValueError, match="groups"):
        s.build_step_metadata([StepProgress("a", [], 4 * TPB)])
    # No slot was reserved for the refused plan: the chunks are absent, not pending forever.
    assert m.get_stats().pending_writes == 0
    assert s.num_jobs_in_flight() == 0
    s.add_request("b", block_hashes("a", 4), 4 * TPB + 1)
    assert s.get_num_new_matched_tokens("b", 0) == 0  # a MISS, not "ask again" (None)
    store_all(s, "a", [[0, 1, 2, 3]], 4 * TPB)
    assert m.get_stats().ready == 2


def test_short_block_table_for_a_load_keeps_the_offer() -> None:
    m = CPUOffloadingManager(16)
    s = OffloadingScheduler(m, tokens_per_block=TPB)
    hashes = block_hashes("a", 3)
    s.add_request("a", hashes, 3 * TPB + 1)
    store_all(s, "a", [[0, 1, 2, 3]], 3 * TPB)
    s.add_request("b", hashes, 3 * TPB + 1)
    assert s.get_num_new_matched_tokens("b", 0) == 3 * TPB
    with pytest.raises(ValueError, match="device blocks"):
        s.update_state_after_alloc("b", [[7]], 3 * TPB)
    assert m.get_stats().pinned == 0
    # The engine fixes its call: the offer still stands.
    s.update_state_after_alloc("b", [[7, 8, 9, 10]], 3 * TPB)
    (load,) = s.build_step_metadata().loads
    assert load.device_blocks.tolist() == [7, 8, 9]


# -- the worker half: a submission the transfer worker refuses -------------------------------


class _RefusingBackend(FakeTransfer):
    """A transfer backend that refuses chosen job ids and finishes the others at once."""

    def __init__(self, refuse: set[int]) -> None:
        super().__init__()
        self.refuse = refuse
        self.submitted: list[int] = []

    def _submit(self, job_id: int) -> None:
        if job_id in self.refuse:
            raise RuntimeError(f"could not queue job {job_id} (out of memory)")
        self.submitted.append(job_id)
        self.done.append(TransferResult(job_id, True))


def test_refused_submission_is_a_failed_transfer_and_the_rest_still_run() -> None:
    m = CPUOffloadingManager(16, enable_events=True)
    s = OffloadingScheduler(m, tokens_per_block=TPB)
    for r in "abc":
        s.add_request(r, block_hashes(r, 2), 2 * TPB + 1)
    meta = s.build_step_metadata(
        [StepProgress(r, [[3 * i, 3 * i + 1, 3 * i + 2]], 2 * TPB) for i, r in enumerate("abc")]
    )
    ja, jb, jc = (j.job_id for j in meta.stores)
    backend = _RefusingBackend({jb})
    worker = OffloadingWorker(backend)
    worker.finish_step(meta)
    assert backend.submitted == [ja, jc]  # one refusal does not strand the jobs behind it
    s.on_worker_results(worker.get_finished())
    assert s.num_jobs_in_flight() == 0
    stats = m.get_stats()
    assert (stats.pending_writes, stats.stores, stats.failed_stores) == (0, 4, 2)
    ctx = ReqContext("probe")
    b_keys = [make_offload_key(h, 0) for h in block_hashes("b", 2)]
    assert all(m.lookup(k, ctx) is LookupResult.MISS for k in b_keys)
    assert not set(b_keys) & stored_events(m)

    # A refused load: the request is received as failed (so it recomputes) and unpinned.
    s.add_request("d", block_hashes("a", 2), 2 * TPB + 1)
    assert s.get_num_new_matched_tokens("d", 0) == 2 * TPB
    s.update_state_after_alloc("d", [[20, 21, 22]], 2 * TPB)
    meta = s.build_step_metadata()
    (load,) = meta.loads
    backend.refuse.add(load.job_id)
    worker.start_step(meta)
    assert m.get_stats().pinned == 2
    s.on_worker_results(worker.get_finished())
    done = s.take_finished()
    assert "d" in done.recving and "d" in done.failed_loads
    assert done.failed_load_blocks == {20, 21}
    assert m.get_stats().pinned == 0


# -- an offered chunk evicted before the engine allocates for it ------------------------------


def test_chunk_evicted_between_offer_and_alloc_fails_the_load_without_raising() -> None:
    m = CPUOffloadingManager(2)
    s = OffloadingScheduler(m, tokens_per_block=TPB)
    hashes = block_hashes("a", 2)
    s.add_request("a", hashes, 2 * TPB + 1)
    store_all(s, "a", [[0, 1, 2]], 2 * TPB)
    assert not s.request_finished("a")
    s.add_request("b", hashes, 2 * TPB + 1)
    assert s.get_num_new_matched_tokens("b", 0) == 2 * TPB  # a lookup, not a pin
    # Another request's stores need the room before the engine allocates b's blocks.
    s.add_request("c", block_hashes("c", 2), 2 * TPB + 1)
    assert s.build_step_metadata([StepProgress("c", [[5, 6, 7]], 2 * TPB)]).stores
    assert m.get_stats().evictions == 2
    s.update_state_after_alloc("b", [[8, 9, 10]], 2 * TPB)
    done = s.take_finished()
    assert "b" in done.recving and "b" in done.failed_loads
    assert done.failed_load_blocks == {8, 9}
    assert s.build_step_metadata().loads == []
    assert m.get_stats().pinned == 0
    assert s.get_num_new_matched_tokens("b", 0) == 0  # recomputed, not offered again


def test_multi_group_load_with_one_group_evicted_unpins_the_other() -> None:
    m = CPUOffloadingManager(4)
    s = OffloadingScheduler(m, tokens_per_block=TPB, groups=(0, 1))
    hashes = block_hashes("g", 2)
    s.add_request("a", hashes, 2 * TPB + 1)
    store_all(s, "a", [[0, 1, 2], [10, 11, 12]], 2 * TPB)
    assert not s.request_finished("a")
    s.add_request("b", hashes, 2 * TPB + 1)
    assert s.get_num_new_matched_tokens("b", 0) == 2 * TPB
    # Group 0's chunks are the most recently used: new stores evict group 1's only.
    ctx = ReqContext("other")
    m.touch([make_offload_key(h, 0) for h in hashes], ctx)
    new_keys = [make_offload_key(h, 0) for h in block_hashes("x", 2)]
    out = m.prepare_store(new_keys, ctx)
    assert out is not None and sorted(out.evicted_keys) == sorted(
        make_offload_key(h, 1) for h in hashes
    )
    s.update_state_after_alloc("b", [[20, 21, 22], [30, 31, 32]], 2 * TPB)
    done = s.take_finished()
    assert "b" in done.failed_loads and done.failed_load_blocks == {20, 21, 30, 31}
    assert s.num_jobs_in_flight() == 0
    assert m.get_stats().pinned == 0  # group 0's pins were given back


# -- bad step input: an error and no change ---------------------------------------------------


def test_negative_num_computed_tokens_is_a_clear_error() -> None:
    s = OffloadingScheduler(CPUOffloadingManager(4), tokens_per_block=TPB)
    s.add_request("a", block_hashes("a", 3), 3 * TPB + 1)
    for bad in (-TPB, -1, True, 1.5):
        with pytest.raises(
            ValueError, match=r"num_computed_tokens=.* is invalid; expected an integer >= 0"
        ):
            s.get_num_new_matched_tokens("a", bad)  # type: ignore[arg-type]
    assert s.get_num_new_matched_tokens("a", np.int64(0)) == 0  # type: ignore[arg-type]


def test_bad_block_table_in_a_step_plans_no_store_for_the_requests_before_it() -> None:
    m = CPUOffloadingManager(16)
    s = OffloadingScheduler(m, tokens_per_block=TPB)
    for r in "ab":
        s.add_request(r, block_hashes(r, 2), 2 * TPB + 1)
    good = StepProgress("a", [[0, 1, 2]], 2 * TPB)
    with pytest.raises(ValueError, match="device blocks"):
        s.build_step_metadata([good, StepProgress("b", [[3]], 2 * TPB)])
    assert (m.get_stats().pending_writes, s.num_jobs_in_flight()) == (0, 0)
    # The engine corrects its call: both requests' stores are planned, once.
    meta = s.build_step_metadata([good, StepProgress("b", [[3, 4, 5]], 2 * TPB)])
    assert [j.req_id for j in meta.stores] == ["a", "b"]
    assert m.get_stats().pending_writes == 4


# -- the worker half: the same step fed twice ---------------------------------------------------


def test_metadata_fed_twice_submits_each_job_once(engine: Engine) -> None:
    e = engine
    a = Request("a", block_hashes("a", 3))
    e.add(a)
    e.step()
    e.drain()
    e.finish("a")
    assert e.add(Request("b", list(a.hashes))) == 3 * TOKENS_PER_BLOCK
    meta = e.scheduler.build_step_metadata()
    e.worker.start_step(meta)
    e.worker.start_step(meta)  # an engine that repeats a call must not fail the running load
    e.worker.wait_for_loads(meta)
    results = e.worker.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(meta.loads[0].job_id, True)]
    e.scheduler.on_worker_results(results)
    done = e.scheduler.take_finished()
    assert "b" in done.recving and not done.failed_loads
    e.finish("b")
    assert_clean(e)


def test_bad_num_prompt_tokens_is_refused_when_the_request_is_added() -> None:
    m = CPUOffloadingManager(4)
    s = OffloadingScheduler(m, tokens_per_block=TPB)
    for bad in (-1, "9", None, 2.0):
        with pytest.raises(
            ValueError, match=r"num_prompt_tokens=.* is invalid; expected an integer >= 0"
        ):
            s.add_request("a", block_hashes("a", 2), bad)  # type: ignore[arg-type]
    assert s.num_requests() == 0
    s.add_request("a", block_hashes("a", 2), np.int64(2 * TPB + 1))  # type: ignore[arg-type]
    assert s.get_num_new_matched_tokens("a", TPB) == 0


def test_bytes_count_only_jobs_that_succeeded_on_every_worker() -> None:
    m = CPUOffloadingManager(16)
    s = OffloadingScheduler(m, tokens_per_block=TPB, num_workers=2)
    for r in "ab":
        s.add_request(r, block_hashes(r, 2), 2 * TPB + 1)
    meta = s.build_step_metadata(
        [StepProgress("a", [[0, 1, 2]], 2 * TPB), StepProgress("b", [[3, 4, 5]], 2 * TPB)]
    )
    ja, jb = (j.job_id for j in meta.stores)
    s.on_worker_results([TransferResult(ja, True, 100), TransferResult(jb, True, 100)])
    s.on_worker_results([TransferResult(ja, True, 100), TransferResult(jb, False)])
    # b's store failed on the second worker: the chunks are gone, and so are its bytes.
    assert s.bytes_stored == 200
    assert m.get_stats().failed_stores == 2


# -- random step loops: nothing leaks, whatever the order of events ----------------------------


def _random_step_loop(seed: int) -> None:
    """Requests sharing prefixes arrive, load, store, get preempted, finish or abort, while
    workers report jobs late, out of order and sometimes failed, other requests' stores run
    between an offer and its allocation, and the cache is reset."""
    rng = random.Random(seed)
    groups = (0, 1) if rng.random() < 0.5 else (0,)
    workers = rng.choice([1, 2])
    m = CPUOffloadingManager(rng.randint(2, 12), rng.choice(["lru", "arc"]))
    bpc = rng.choice([1, 2])
    s = OffloadingScheduler(
        m, tokens_per_block=TPB, blocks_per_chunk=bpc, groups=groups, num_workers=workers
    )
    prefixes = [block_hashes(f"p{i}", rng.randint(1, 4)) for i in range(3)]
    running: dict[str, tuple[list[list[int]], int]] = {}
    waiting: dict[str, list[bytes]] = {}
    hashes_of: dict[str, list[bytes]] = {}
    in_flight: list[list[int]] = []  # [job id, reports left]

    def step() -> None:
        meta = s.build_step_metadata(StepProgress(r, b, n) for r, (b, n) in running.items())
        in_flight.extend([j.job_id, workers] for j in meta.loads + meta.stores)

    for n in range(60):
        if rng.random() < 0.3:
            hashes = rng.choice(prefixes) + block_hashes(f"r{n}", rng.randint(0, 3))
            s.add_request(f"r{n}", hashes, len(hashes) * TPB + 1)
            waiting[f"r{n}"] = hashes_of[f"r{n}"] = hashes
        for r, hashes in list(waiting.items()):
            offered = s.get_num_new_matched_tokens(r, 0)
            if offered is None:
                continue
            if rng.random() < 0.2:
                step()  # other requests' stores, between this offer and its allocation
            blocks = [list(range(100 * g, 100 * g + len(hashes) + 1)) for g in groups]
            s.update_state_after_alloc(r, blocks, offered)
            running[r] = (blocks, len(hashes) * TPB)
            del waiting[r]
        if running and rng.random() < 0.15:
            r = rng.choice(list(running))
            s.request_preempted(r)
            del running[r]
            waiting[r] = hashes_of[r]
        for table in (running, waiting):
            if table and rng.random() < 0.15:
                r = rng.choice(list(table))
                del table[r]
                s.request_finished(r)
        if rng.random() < 0.03:
            s.reset_cache()
        step()
        rng.shuffle(in_flight)
        reports = []
        for item in in_flight:
            if rng.random() < 0.5:
                reports.append(TransferResult(item[0], rng.random() < 0.85))
                item[1] -= 1
        in_flight[:] = [item for item in in_flight if item[1]]
        s.on_worker_results(reports)
        s.take_finished()
    for r in [*running, *waiting]:
        s.request_finished(r)
    s.on_worker_results(TransferResult(j, True) for j, left in in_flight for _ in range(left))
    stats = m.get_stats()
    assert (stats.pinned, stats.pending_writes, stats.used_slots) == (0, 0, stats.ready)
    assert (s.num_jobs_in_flight(), s.num_requests()) == (0, 0)


@pytest.mark.parametrize("seed", range(40))
def test_random_step_loops_leak_nothing(seed: int) -> None:
    _random_step_loop(seed)
