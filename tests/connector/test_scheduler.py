"""Lifecycle tests of the connector halves, driven by a step-by-step engine on CPU tensors."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

import pytest

from engine_sim import TOKENS_PER_BLOCK, Engine, Request, assert_clean, block_hashes
from kvtier.base import OffloadKey, ReqContext, TransferResult, make_offload_key
from kvtier.connector import OffloadingScheduler, StepProgress
from kvtier.cpu import CPUOffloadingManager
from kvtier.policies import LRUPolicy

SYSTEM = block_hashes("system", 4)


@pytest.fixture
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    params = getattr(request, "param", {})
    e = Engine(**params)
    yield e
    e.close()


def run_to_completion(e: Engine, req: Request) -> None:
    """Admit, run one step, store everything, finish."""
    assert e.add(req) is not None
    e.step()
    e.drain()
    assert not e.finish(req.req_id)


@pytest.mark.parametrize(
    "engine", [{"blocks_per_chunk": 1}, {"blocks_per_chunk": 2}], indirect=True
)
def test_second_request_loads_the_shared_prefix_byte_exact(engine: Engine) -> None:
    e = engine
    run_to_completion(e, Request("a", block_hashes("a", 3, SYSTEM)))
    stored = e.manager.get_stats().stores
    assert stored == 7 // e.scheduler.blocks_per_chunk
    b = Request("b", block_hashes("b", 2, SYSTEM))
    n = e.add(b)
    assert n == len(SYSTEM) * TOKENS_PER_BLOCK
    e.step()
    assert e.loaded_blocks == len(SYSTEM)
    e.finish("b")
    assert_clean(e)
    assert e.manager.get_stats().hits > 0


def test_load_starts_mid_chunk_when_the_device_holds_part_of_it() -> None:
    e = Engine(blocks_per_chunk=2)
    try:
        run_to_completion(e, Request("a", block_hashes("a", 2, SYSTEM)))
        b = Request("b", block_hashes("b", 1, SYSTEM))
        e.scheduler.add_request("b", b.hashes, b.num_prompt_tokens)
        # The device already has the first block: the load starts in the middle of chunk 0.
        n = e.scheduler.get_num_new_matched_tokens("b", TOKENS_PER_BLOCK)
        assert n == 3 * TOKENS_PER_BLOCK
        b.blocks = [e.free_blocks.pop() for _ in range(len(b.hashes) + 1)]
        e.scheduler.update_state_after_alloc("b", [b.blocks], n)
        meta = e.scheduler.build_step_metadata()
        (load,) = meta.loads
        assert load.skip_blocks == 1
        assert load.device_blocks.tolist() == b.blocks[1:4]
        e.worker.start_step(meta)
        e.worker.wait_for_loads(meta)
        for i in range(1, 4):
            assert bool((e.kv[b.blocks[i]] == e.kv.new_tensor(0)).all()) is False
        e.scheduler.on_worker_results(e.worker.get_finished())
        e.scheduler.request_finished("b")
        assert e.manager.get_stats().pinned == 0
    finally:
        e.close()


def test_abort_with_load_in_flight_holds_blocks_and_leaks_no_pin(engine: Engine) -> None:
    e = engine
    run_to_completion(e, Request("a", block_hashes("a", 2, SYSTEM)))
    e.gate.hold["load"] = gate = threading.Event()
    b = Request("b", block_hashes("b", 1, SYSTEM))
    assert e.add(b)
    meta = e.scheduler.build_step_metadata()
    e.worker.start_step(meta)
    assert e.finish("b") is True  # the load still writes into b's blocks: hold them
    assert e.manager.get_stats().pinned == len(SYSTEM)
    gate.set()
    e.drain()
    assert "b" in e.last_finished.sending
    assert_clean(e)


def test_abort_with_store_in_flight_holds_blocks_until_stored(engine: Engine) -> None:
    e = engine
    e.gate.hold["store"] = gate = threading.Event()
    a = Request("a", block_hashes("a", 3))
    e.add(a)
    e.step()
    assert e.finish("a") is True
    blocks = e.held["a"]
    assert not set(blocks) & set(e.free_blocks)
    gate.set()
    e.drain()
    assert "a" in e.last_finished.sending
    assert set(blocks) <= set(e.free_blocks)
    assert e.manager.get_stats().stores == 3
    assert_clean(e)


def test_preempted_request_stores_finish_before_its_blocks_are_reused(engine: Engine) -> None:
    e = engine
    e.gate.hold["store"] = gate = threading.Event()
    a = Request("a", block_hashes("a", 3))
    e.add(a)
    e.step()  # a's stores are queued and held by the gate
    a_blocks = list(a.blocks)
    e.preempt("a")
    other = Request("x", block_hashes("x", 3))
    e.add(other)
    assert set(other.blocks) & set(a_blocks), "x should reuse a's freed blocks"
    # The next step must first wait for a's stores, or x's compute would overwrite their source.
    gate_timer = threading.Timer(0.2, gate.set)
    gate_timer.start()
    meta = e.step()
    assert meta.wait_for, "the preempted request's stores were not waited for"
    e.drain()
    # a's chunks were stored with a's KV, not x's: load them into fresh blocks and compare.
    again = Request("a2", list(a.hashes))
    e.finish("x")
    assert e.add(again) == 3 * TOKENS_PER_BLOCK
    e.step()
    assert e.loaded_blocks == 3
    e.finish("a2")
    assert not e.scheduler.request_finished("a")
    assert_clean(e)


def test_preempted_request_is_readmitted_and_loads_its_own_chunks(engine: Engine) -> None:
    e = engine
    a = Request("a", block_hashes("a", 3))
    e.add(a)
    e.step()
    e.drain()
    e.preempt("a")
    assert e.admit(a) == 3 * TOKENS_PER_BLOCK
    e.step()
    assert e.loaded_blocks == 3
    e.finish("a")
    assert_clean(e)


def test_failed_load_is_reported_and_recomputed(engine: Engine) -> None:
    e = engine
    run_to_completion(e, Request("a", block_hashes("a", 2, SYSTEM)))
    e.gate.fail_directions.add("load")
    b = Request("b", block_hashes("b", 1, SYSTEM))
    assert e.add(b)
    e.step()
    done = e.last_finished
    assert "b" in done.failed_loads
    assert set(b.blocks[: len(SYSTEM)]) <= done.failed_load_blocks
    assert e.loaded_blocks == 0  # nothing was served from the failed load
    # Asked again (an engine's recompute path), the request is offered nothing more.
    assert e.scheduler.get_num_new_matched_tokens("b", 0) == 0
    e.gate.fail_directions.clear()
    e.finish("b")
    assert_clean(e)


def test_failed_store_is_never_served(engine: Engine) -> None:
    e = engine
    e.gate.fail_directions.add("store")
    run_to_completion(e, Request("a", block_hashes("a", 3)))
    assert e.manager.get_stats().failed_stores == 3
    e.gate.fail_directions.clear()
    assert e.add(Request("b", block_hashes("a", 3))) == 0
    e.step()
    e.finish("b")
    assert_clean(e)


def test_reset_with_jobs_in_flight_ignores_their_late_completions(engine: Engine) -> None:
    e = engine
    run_to_completion(e, Request("a", block_hashes("a", 2, SYSTEM)))
    b = Request("b", block_hashes("b", 2, SYSTEM))
    e.add(b)
    e.step()  # b loads the shared prefix
    e.drain()
    e.gate.hold["store"] = gate = threading.Event()
    meta = e.step()  # b's own chunks are stored, held by the gate
    assert meta.stores
    e.scheduler.reset_cache()
    # Jobs of before the reset are still in flight: their slots are quarantined.
    assert e.manager.get_stats().used_slots > 0
    gate.set()
    e.drain()
    stats = e.manager.get_stats()
    assert (stats.ready, stats.pinned, stats.pending_writes, stats.used_slots) == (0, 0, 0, 0)
    e.finish("b")
    # The tier works again after the flush.
    run_to_completion(e, Request("c", block_hashes("c", 2)))
    assert e.manager.get_stats().ready == 2
    assert_clean(e)


def test_reset_between_offer_and_alloc_fails_the_load_and_recomputes(engine: Engine) -> None:
    e = engine
    run_to_completion(e, Request("a", block_hashes("a", 2, SYSTEM)))
    b = Request("b", block_hashes("b", 1, SYSTEM))
    e.scheduler.add_request(b.req_id, b.hashes, b.num_prompt_tokens)
    offered = e.scheduler.get_num_new_matched_tokens("b", 0)
    assert offered
    e.scheduler.reset_cache()  # the offered chunks are gone before the engine allocates
    b.blocks = [e.free_blocks.pop() for _ in range(len(b.hashes) + 1)]
    e.scheduler.update_state_after_alloc("b", [b.blocks], offered)
    b.num_loaded_tokens, b.waiting_for_load = offered, True
    e.running["b"] = b
    meta = e.step()
    assert meta.loads == []
    done = e.last_finished
    assert "b" in done.recving and "b" in done.failed_loads
    assert set(b.blocks[: offered // TOKENS_PER_BLOCK]) == done.failed_load_blocks
    assert e.loaded_blocks == 0
    # b recomputed its prompt, so all of it is stored into the emptied tier.
    assert sum(len(j.device_blocks) for j in meta.stores) == len(b.hashes)
    e.drain()
    assert e.manager.get_stats().ready == len(b.hashes)
    e.finish("b")
    assert_clean(e)


def test_stores_overlap_but_nothing_is_stored_beside_a_load(engine: Engine) -> None:
    e = engine
    e.gate.hold["store"] = store_gate = threading.Event()
    a = Request("a", block_hashes("a", 2))
    e.add(a)
    meta = e.step()
    assert len(meta.stores) == 1
    a.hashes.extend(block_hashes("more", 2, a.hashes)[2:])  # decode grew the sequence
    a.blocks.extend(e.free_blocks.pop() for _ in range(2))
    meta = e.step()
    # a's first stores are still in flight: the new chunks are stored beside them, so that
    # a request ending now (vLLM frees it before it reads the step's reports) leaves none
    # unstored. Its lookups still wait for them.
    (job,) = meta.stores
    assert job.device_blocks.tolist() == a.blocks[2:4]
    assert e.scheduler.get_num_new_matched_tokens("a", 0) is None
    assert e.scheduler.request_finished("a")  # held until both sets are reported
    e.held["a"] = e.running.pop("a").blocks
    store_gate.set()
    e.drain()
    assert e.manager.get_stats().ready == 4
    # b loads a's 4 chunks: its own 2 new ones are not stored while the load writes its blocks.
    e.gate.hold["load"] = load_gate = threading.Event()
    b = Request("b", [*a.hashes, *block_hashes("b", 2, a.hashes)[4:]])
    assert e.add(b) == 4 * TOKENS_PER_BLOCK
    meta = e.step()
    assert len(meta.loads) == 1 and meta.stores == []
    load_gate.set()
    e.drain()
    meta = e.step()
    (job,) = meta.stores
    assert job.device_blocks.tolist() == b.blocks[4:6]
    e.finish("b")
    assert_clean(e)


def test_job_completes_only_when_every_worker_reported() -> None:
    m = CPUOffloadingManager(8)
    s = OffloadingScheduler(m, tokens_per_block=4, num_workers=2)
    s.add_request("a", block_hashes("a", 2), 9)
    s.get_num_new_matched_tokens("a", 0)

    meta = s.build_step_metadata([StepProgress("a", [[0, 1, 2]], 8)])
    (job,) = meta.stores
    s.on_worker_results([TransferResult(job.job_id, True)])
    assert m.get_stats().pending_writes == 2
    s.on_worker_results([TransferResult(job.job_id, False)])  # the second worker failed
    assert m.get_stats().pending_writes == 0
    assert m.get_stats().failed_stores == 2
    with pytest.raises(ValueError, match="not in flight"):
        s.on_worker_results([TransferResult(job.job_id, True)])


def test_no_room_in_one_group_reserves_nothing_in_the_others() -> None:
    m = CPUOffloadingManager(3)
    s = OffloadingScheduler(m, tokens_per_block=4, groups=(0, 1))
    a = block_hashes("a", 1)
    s.add_request("a", a, 5)
    assert s.get_num_new_matched_tokens("a", 0) == 0
    stores = s.build_step_metadata([StepProgress("a", [[0, 1], [0, 1]], 4)]).stores
    s.on_worker_results([TransferResult(j.job_id, True) for j in stores])
    s.request_finished("a")
    # b loads a's chunk in both groups: two of the three slots are pinned until it ends.
    s.add_request("b", block_hashes("b", 1, a), 9)
    assert s.get_num_new_matched_tokens("b", 0) == 4
    s.update_state_after_alloc("b", [[2, 3, 4], [2, 3, 4]], 4)
    # c's chunk fits in group 0's free slot but finds no room in group 1.
    s.add_request("c", block_hashes("c", 1), 5)
    assert s.get_num_new_matched_tokens("c", 0) == 0
    meta = s.build_step_metadata([StepProgress("c", [[5, 6], [5, 6]], 4)])
    assert meta.stores == []  # group 0 alone could never be loaded
    stats = m.get_stats()
    assert (stats.used_slots, stats.pinned, stats.pending_writes) == (2, 2, 0)
    assert (stats.stores_no_room, stats.failed_stores) == (2, 0)


def test_a_store_that_cannot_fit_in_every_group_evicts_nothing() -> None:
    """Group by group, the first group's call made room (evicting a's chunks) for chunks the
    second group then found no room for: b stored nothing and a's prefix was gone."""
    m = CPUOffloadingManager(4)
    s = OffloadingScheduler(m, tokens_per_block=4, groups=(0, 1))
    a = block_hashes("a", 2)
    s.add_request("a", a, 9)
    assert s.get_num_new_matched_tokens("a", 0) == 0
    stores = s.build_step_metadata([StepProgress("a", [[0, 1, 2], [0, 1, 2]], 8)]).stores
    s.on_worker_results([TransferResult(j.job_id, True) for j in stores])
    assert not s.request_finished("a")
    # b's three chunks need six slots: the tier has four.
    s.add_request("b", block_hashes("b", 3), 13)
    assert s.get_num_new_matched_tokens("b", 0) == 0
    meta = s.build_step_metadata([StepProgress("b", [[3, 4, 5, 6], [3, 4, 5, 6]], 12)])
    assert meta.stores == []
    stats = m.get_stats()
    assert (stats.evictions, stats.failed_stores, stats.stores_no_room) == (0, 0, 6)
    s.add_request("a2", a, 9)
    assert s.get_num_new_matched_tokens("a2", 0) == 8  # a's prefix is still there, whole


def test_bad_arguments_get_clear_errors() -> None:
    m = CPUOffloadingManager(8)
    with pytest.raises(ValueError, match="tokens_per_block=0"):
        OffloadingScheduler(m, tokens_per_block=0)
    with pytest.raises(ValueError, match="groups"):
        OffloadingScheduler(m, tokens_per_block=4, groups=(0, 0))
    s = OffloadingScheduler(m, tokens_per_block=4)
    with pytest.raises(ValueError, match="'nope' is not tracked"):
        s.get_num_new_matched_tokens("nope", 0)
    s.add_request("a", block_hashes("a", 2), 9)
    with pytest.raises(ValueError, match="already tracked"):
        s.add_request("a", [], 1)
    with pytest.raises(ValueError, match="num_external_tokens=8"):
        s.update_state_after_alloc("a", [[0, 1, 2]], 8)
    assert not s.request_finished("a")
    with pytest.raises(ValueError, match="not tracked"):
        s.request_finished("a")


def test_a_grown_prompt_is_looked_up_to_its_new_length() -> None:
    """A streaming-input session's prompt grows in place: `extend_prompt` lets lookups reach
    it (one prompt token is always left to compute); a shrinking or bad length is refused
    with nothing changed."""
    m = CPUOffloadingManager(8)
    hashes = block_hashes("a", 3)
    stored = [make_offload_key(h, 0) for h in hashes]
    assert m.prepare_store(stored, ReqContext("w")) is not None
    m.complete_store(stored, ReqContext("w"), True)
    s = OffloadingScheduler(m, tokens_per_block=4)
    s.add_request("a", hashes, 5)
    assert s.get_num_new_matched_tokens("a", 0) == 4
    s.extend_prompt("a", 13)
    assert s.get_num_new_matched_tokens("a", 0) == 12
    for bad, match in ((12, "num_prompt_tokens=12 is shorter than the prompt of 13"),
                       (-1, "num_prompt_tokens"), ("13", "num_prompt_tokens")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            s.extend_prompt("a", bad)  # type: ignore[arg-type]
    assert s.get_num_new_matched_tokens("a", 0) == 12
    with pytest.raises(ValueError, match="'b' is not tracked"):
        s.extend_prompt("b", 13)


def test_full_prompt_hits_reach_the_prompts_last_token_and_read_false_looks_nothing_up() -> None:
    """A 12-token prompt of 3 stored 4-token blocks: by default the hit leaves the last block
    to compute (its last token gives the logits); an engine that recomputes that token itself
    (`full_prompt_hits`) gets all three. `read=False` answers 0 and looks nothing up."""
    m = CPUOffloadingManager(8)
    hashes = block_hashes("a", 3)
    stored = [make_offload_key(h, 0) for h in hashes]
    assert m.prepare_store(stored, ReqContext("w")) is not None
    m.complete_store(stored, ReqContext("w"), True)
    for full, expected in ((False, 8), (True, 12)):
        s = OffloadingScheduler(m, tokens_per_block=4, full_prompt_hits=full)
        s.add_request("a", hashes, 12)
        assert s.get_num_new_matched_tokens("a", 0) == expected
        assert s.get_num_new_matched_tokens("a", 4) == expected - 4
        hits = m.get_stats().hits
        assert s.get_num_new_matched_tokens("a", 0, read=False) == 0
        assert m.get_stats().hits == hits
        assert not s.request_finished("a")
    with pytest.raises(ValueError, match="full_prompt_hits='yes' is invalid; expected a bool"):
        OffloadingScheduler(m, tokens_per_block=4, full_prompt_hits="yes")  # type: ignore[arg-type]


class _TouchLog(LRUPolicy):
    """LRU that records every touch, to see what the connector reports as a use."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.touched: list[list[OffloadKey]] = []

    def touch(self, keys: Iterable[OffloadKey], ctx: ReqContext | None) -> None:
        keys = list(keys)
        self.touched.append(keys)
        super().touch(keys, ctx)


def test_only_reused_chunks_count_as_uses() -> None:
    m = CPUOffloadingManager(16, _TouchLog)
    policy = m.policy
    assert isinstance(policy, _TouchLog)
    s = OffloadingScheduler(m, tokens_per_block=4)
    hashes = block_hashes("a", 3)
    s.add_request("a", hashes, 13)
    assert s.get_num_new_matched_tokens("a", 0) == 0
    (job,) = s.build_step_metadata([StepProgress("a", [[0, 1, 2, 3]], 12)]).stores
    s.on_worker_results([TransferResult(job.job_id, True)])
    s.request_finished("a")
    # Storing is not using: a frequency-aware policy must not see new chunks as reused.
    assert policy.touched == []

    s.add_request("b", hashes, 13)
    # The device holds block 0; kvtier serves blocks 1 and 2.
    assert s.get_num_new_matched_tokens("b", 4) == 8
    s.update_state_after_alloc("b", [[5, 6, 7, 8]], 8)
    (load,) = s.build_step_metadata().loads
    s.on_worker_results([TransferResult(load.job_id, True)])
    s.request_finished("b")
    assert policy.touched[0] == [make_offload_key(hashes[0], 0)]  # the device hit, at admission
    assert policy.touched[-1] == [make_offload_key(h, 0) for h in hashes]  # all of b's prefix


def test_named_workers_cannot_report_a_job_twice() -> None:
    m = CPUOffloadingManager(8)
    s = OffloadingScheduler(m, tokens_per_block=4, num_workers=2)
    s.add_request("a", block_hashes("a", 2), 9)
    s.get_num_new_matched_tokens("a", 0)
    (job,) = s.build_step_metadata([StepProgress("a", [[0, 1, 2]], 8)]).stores

    s.on_worker_results([TransferResult(job.job_id, True)], worker=0)
    # Without its id, worker 0's second report would pass for worker 1's and end the job.
    with pytest.raises(ValueError, match=f"job {job.job_id} was already reported by worker 0"):
        s.on_worker_results([TransferResult(job.job_id, True)], worker=0)
    assert s.job_ids_in_flight() == [job.job_id]
    assert m.get_stats().pending_writes == 2
    s.on_worker_results([TransferResult(job.job_id, True)], worker=1)
    assert s.num_jobs_in_flight() == 0
    assert (m.get_stats().pending_writes, m.get_stats().ready) == (0, 2)


@pytest.mark.parametrize("worker", [-1, 2, True, 1.0, "0"])
def test_a_bad_worker_index_is_refused_before_any_report(worker: object) -> None:
    m = CPUOffloadingManager(8)
    s = OffloadingScheduler(m, tokens_per_block=4, num_workers=2)
    s.add_request("a", block_hashes("a", 2), 9)
    s.get_num_new_matched_tokens("a", 0)
    (job,) = s.build_step_metadata([StepProgress("a", [[0, 1, 2]], 8)]).stores
    with pytest.raises(
        ValueError, match=r"worker=.* is invalid; expected a worker index in \[0, 2\)"
    ):
        s.on_worker_results([TransferResult(job.job_id, True)], worker=worker)  # type: ignore[arg-type]
    s.on_worker_results([TransferResult(job.job_id, True)], worker=0)
    s.on_worker_results([TransferResult(job.job_id, True)], worker=1)
    assert s.num_jobs_in_flight() == 0


def test_one_named_report_with_a_job_twice_applies_nothing() -> None:
    m = CPUOffloadingManager(8)
    s = OffloadingScheduler(m, tokens_per_block=4, num_workers=3)
    s.add_request("a", block_hashes("a", 1), 5)
    s.get_num_new_matched_tokens("a", 0)
    (job,) = s.build_step_metadata([StepProgress("a", [[0, 1]], 4)]).stores
    with pytest.raises(ValueError, match="already reported by worker 1"):
        s.on_worker_results([TransferResult(job.job_id, True)] * 2, worker=1)
    for w in range(3):
        assert s.num_jobs_in_flight() == 1
        s.on_worker_results([TransferResult(job.job_id, True)], worker=w)
    assert s.num_jobs_in_flight() == 0


def test_a_load_ending_after_its_request_counts_as_that_requests_use() -> None:
    """The policy hears of a request's end only when its last job ended: a load that outlives
    its aborted request is the same use as the request's end-of-request touch, not another."""
    from kvtier.policies import KVAwarePolicy

    m = CPUOffloadingManager(8, cache_policy="kvaware")
    s = OffloadingScheduler(m, tokens_per_block=4)
    a = block_hashes("a", 2)
    s.add_request("a", a, 9)
    s.get_num_new_matched_tokens("a", 0)
    stores = s.build_step_metadata([StepProgress("a", [[0, 1, 2]], 8)]).stores
    s.on_worker_results([TransferResult(j.job_id, True) for j in stores])
    s.request_finished("a")

    s.add_request("b", block_hashes("b", 1, a), 13)
    assert s.get_num_new_matched_tokens("b", 0) == 8
    s.update_state_after_alloc("b", [[3, 4, 5, 6]], 8)
    (load,) = s.build_step_metadata([]).loads
    assert s.request_finished("b")  # aborted mid-load: its blocks are held
    s.on_worker_results([TransferResult(load.job_id, True)])
    assert s.num_requests() == 0
    policy = m._policy
    assert isinstance(policy, KVAwarePolicy)
    keys = [make_offload_key(h, 0) for h in a]
    # One use by "a" (its store) and one by "b" (its load), not a third for the late unpin.
    assert [policy._sketch.estimate_key(bytes(k)) for k in keys] == [2, 2]
