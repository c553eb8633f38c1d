"""A request whose load failed is offered hits again once the engine preempts it.

Before, a failed load stopped every offer to the request for good: preempted and readmitted,
it recomputed chunks the tier still held. Now a failure stops offers only until the next
preemption, so a chunk that always fails costs one failed load per preemption, never a loop.
"""

from __future__ import annotations

import numpy as np

from engine_sim import TOKENS_PER_BLOCK, Engine, Request, assert_clean, block_hashes
from kvtier.base import TransferResult
from kvtier.connector import OffloadingScheduler, StepMetadata, StepProgress
from kvtier.cpu import CPUOffloadingManager

SYSTEM = block_hashes("system", 4)


def _store_prefix(e: Engine) -> None:
    """A first request computes and stores SYSTEM plus two blocks of its own, then ends."""
    a = Request("a", block_hashes("a", 2, SYSTEM))
    assert e.add(a) == 0
    e.step()
    e.drain()
    assert not e.finish("a")


def _load_jobs(e: Engine) -> int:
    return sum(direction == "load" for _, direction in e.gate.started)


def test_preempted_after_a_failed_load_reloads_its_chunks_byte_exact(engine: Engine) -> None:
    e = engine
    _store_prefix(e)
    e.gate.fail_directions.add("load")
    b = Request("b", block_hashes("b", 1, SYSTEM))
    assert e.add(b) == len(SYSTEM) * TOKENS_PER_BLOCK
    e.step()  # the load fails; b recomputes its whole prompt
    assert "b" in e.last_finished.failed_loads
    e.step()  # b's own block is stored now that its load is over
    e.drain()
    # The engine's recompute path asks again at once: still nothing, the failure is fresh.
    assert e.scheduler.get_num_new_matched_tokens("b", 0) == 0
    e.gate.fail_directions.clear()
    e.preempt("b")
    # Readmitted: every chunk the tier holds is offered again (SYSTEM and b's own block).
    assert e.admit(b) == len(b.hashes) * TOKENS_PER_BLOCK
    e.kv[b.blocks] = float("nan")  # the blocks freed at the preemption held b's KV already
    e.step()
    done = e.last_finished
    assert "b" in done.recving
    assert "b" not in done.failed_loads  # the earlier failure is not reported again
    assert e.loaded_blocks == len(b.hashes)  # every loaded block checked byte for byte
    assert e.load_mismatches == 0
    e.finish("b")
    assert_clean(e)


def test_a_load_that_always_fails_is_retried_once_per_preemption(engine: Engine) -> None:
    e = engine
    _store_prefix(e)
    e.gate.fail_directions.add("load")
    b = Request("b", block_hashes("b", 1, SYSTEM))
    assert e.add(b) == len(SYSTEM) * TOKENS_PER_BLOCK
    for preemptions in range(4):
        e.step()
        e.drain()
        assert e.scheduler.load_jobs_failed == preemptions + 1
        # An engine that asks after every failure, step after step, gets no offer: no loop.
        for _ in range(10):
            assert e.scheduler.get_num_new_matched_tokens("b", 0) == 0
            e.step()
            e.drain()
        assert _load_jobs(e) == preemptions + 1
        e.preempt("b")
        # One new attempt per preemption (b's own block is in the tier by now too).
        assert e.admit(b) == len(b.hashes) * TOKENS_PER_BLOCK
    e.gate.fail_directions.clear()
    e.finish("b")
    assert_clean(e)
    assert e.loaded_blocks == 0  # no failed load was ever served


TPB = TOKENS_PER_BLOCK


def _scheduler(groups: tuple[int, ...]) -> OffloadingScheduler:
    return OffloadingScheduler(CPUOffloadingManager(16), tokens_per_block=TPB, groups=groups)


def _report(s: OffloadingScheduler, meta: StepMetadata, ok: dict[int, bool]) -> None:
    """Report the step's jobs of the groups in `ok`, each with its outcome."""
    results = [
        TransferResult(j.job_id, ok[j.group]) for j in (*meta.loads, *meta.stores) if j.group in ok
    ]
    s.on_worker_results(results)


def test_retry_waits_for_the_failure_report_and_reports_only_its_own_outcome() -> None:
    """Two KV-cache groups: group 0's load fails, the request is preempted while group 1's is in
    flight. The failure is still reported; no offer is made until `take_finished` has taken it
    (the engine would read it as the new load's report); then the retry loads and succeeds."""
    s = _scheduler((0, 1))
    hashes = block_hashes("p", 3)
    blocks = [[0, 1, 2, 3], [4, 5, 6, 7]]
    s.add_request("a", hashes, 3 * TPB + 1)
    assert s.get_num_new_matched_tokens("a", 0) == 0
    meta = s.build_step_metadata([StepProgress("a", blocks, 3 * TPB + 1)])
    _report(s, meta, {0: True, 1: True})
    assert not s.request_finished("a")
    s.take_finished()

    s.add_request("b", hashes, 3 * TPB + 1)
    n = s.get_num_new_matched_tokens("b", 0)
    assert n == 3 * TPB
    s.update_state_after_alloc("b", blocks, n)
    meta = s.build_step_metadata()
    _report(s, meta, {0: False})
    s.request_preempted("b")
    assert s.build_step_metadata().wait_for == [j.job_id for j in meta.loads if j.group == 1]
    _report(s, meta, {1: True})
    # Group 1 succeeded after the preemption; the load as a whole failed.
    assert s.get_num_new_matched_tokens("b", 0) == 0  # its report is not taken yet
    done = s.take_finished()
    assert done.recving == {"b"}
    assert done.failed_loads == {"b"}
    assert done.failed_load_blocks == set()  # given back at the preemption

    n = s.get_num_new_matched_tokens("b", 0)
    assert n == 3 * TPB
    s.update_state_after_alloc("b", [[8, 9, 10, 11], [12, 13, 14, 15]], n)
    meta = s.build_step_metadata()
    assert [np.asarray(j.device_blocks).tolist() for j in meta.loads] == [[8, 9, 10], [12, 13, 14]]
    _report(s, meta, {0: True, 1: True})
    done = s.take_finished()
    assert done.recving == {"b"}
    assert done.failed_loads == set()
    assert not s.request_finished("b")
    assert s.num_jobs_in_flight() == 0
    assert s.manager.get_stats().pinned == 0


def test_a_load_failing_after_the_preemption_waits_for_the_next_one() -> None:
    """A failure that comes after the preemption (a job the engine waited for) stops the offers
    again: the retry needs a preemption later than every failure."""
    s = _scheduler((0,))
    hashes = block_hashes("p", 2)
    s.add_request("a", hashes, 2 * TPB + 1)
    assert s.get_num_new_matched_tokens("a", 0) == 0
    meta = s.build_step_metadata([StepProgress("a", [[0, 1, 2]], 2 * TPB + 1)])
    _report(s, meta, {0: True})
    assert not s.request_finished("a")

    s.add_request("b", hashes, 2 * TPB + 1)
    n = s.get_num_new_matched_tokens("b", 0)
    assert n == 2 * TPB
    s.update_state_after_alloc("b", [[3, 4, 5]], n)
    meta = s.build_step_metadata()
    s.request_preempted("b")
    _report(s, meta, {0: False})
    assert s.take_finished().failed_loads == {"b"}
    assert s.get_num_new_matched_tokens("b", 0) == 0  # readmitted: it computes its prompt
    s.request_preempted("b")
    assert s.get_num_new_matched_tokens("b", 0) == 2 * TPB
    s.update_state_after_alloc("b", [[6, 7, 8]], 2 * TPB)
    _report(s, s.build_step_metadata(), {0: True})
    done = s.take_finished()
    assert (done.recving, done.failed_loads) == ({"b"}, set())
    assert not s.request_finished("b")
    assert s.manager.get_stats().pinned == 0


def test_an_untaken_successful_load_report_holds_back_the_next_offer() -> None:
    """A load succeeds, its report is not taken, the request is preempted and asks again. An
    offer then would plan a second load while the first one's `recving` report is still due:
    the engine would take that report as the second load's and read blocks still being
    written. No offer until the report is taken; then the reload is planned as usual."""
    s = _scheduler((0,))
    hashes = block_hashes("p", 2)
    s.add_request("a", hashes, 2 * TPB + 1)
    assert s.get_num_new_matched_tokens("a", 0) == 0
    _report(s, s.build_step_metadata([StepProgress("a", [[0, 1, 2]], 2 * TPB + 1)]), {0: True})
    assert not s.request_finished("a")
    s.take_finished()

    s.add_request("b", hashes, 2 * TPB + 1)
    n = s.get_num_new_matched_tokens("b", 0)
    assert n == 2 * TPB
    s.update_state_after_alloc("b", [[3, 4, 5]], n)
    _report(s, s.build_step_metadata(), {0: True})  # the load succeeds; no take_finished
    s.request_preempted("b")
    assert s.get_num_new_matched_tokens("b", 0) == 0
    assert s.num_jobs_in_flight() == 0  # nothing planned behind the engine's back
    done = s.take_finished()
    assert (done.recving, done.failed_loads) == ({"b"}, set())

    n = s.get_num_new_matched_tokens("b", 0)
    assert n == 2 * TPB
    s.update_state_after_alloc("b", [[6, 7, 8]], n)
    meta = s.build_step_metadata()
    assert s.take_finished().recving == set()  # nothing reported while the reload runs
    _report(s, meta, {0: True})
    assert s.take_finished().recving == {"b"}
    assert not s.request_finished("b")
    assert s.manager.get_stats().pinned == 0
