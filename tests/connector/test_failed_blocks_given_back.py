"""A load reported failed names its device blocks in `failed_load_blocks` only while the
request still has them: preempted, or finished holding nothing, before `take_finished`, the
engine has given them back (and may have given them to other requests, whose KV they hold). A
load failed at allocation was already handled so; one reported failed by the workers was not."""

from __future__ import annotations

import pytest

from engine_sim import block_hashes
from kvtier.base import TransferResult
from kvtier.connector import OffloadingScheduler, StepProgress
from kvtier.cpu import CPUOffloadingManager

TPB = 4


def _stored_prefix() -> OffloadingScheduler:
    s = OffloadingScheduler(CPUOffloadingManager(8), tokens_per_block=TPB)
    s.add_request("a", block_hashes("a", 2), 2 * TPB + 1)
    assert s.get_num_new_matched_tokens("a", 0) == 0
    s.update_state_after_alloc("a", [[0, 1, 2]], 0)
    (store,) = s.build_step_metadata([StepProgress("a", [[0, 1, 2]], 2 * TPB)]).stores
    s.on_worker_results([TransferResult(store.job_id, True)])
    assert not s.request_finished("a")
    s.take_finished()
    return s


def _failed_load(s: OffloadingScheduler, req_id: str, blocks: list[int]) -> None:
    s.add_request(req_id, block_hashes("a", 3), 2 * TPB + 1)
    assert s.get_num_new_matched_tokens(req_id, 0) == 2 * TPB
    s.update_state_after_alloc(req_id, [blocks], 2 * TPB)
    (load,) = s.build_step_metadata().loads
    s.on_worker_results([TransferResult(load.job_id, False)])


@pytest.mark.parametrize("gives_back", ["request_preempted", "request_finished"])
def test_a_failed_load_names_no_blocks_given_back_before_it_is_taken(gives_back: str) -> None:
    s = _stored_prefix()
    _failed_load(s, "b", [5, 6, 7])
    _failed_load(s, "c", [8, 9, 10])
    if gives_back == "request_preempted":
        s.request_preempted("b")
    else:
        assert not s.request_finished("b")  # nothing held: the engine frees 5, 6, 7 now
    done = s.take_finished()
    assert (done.recving, done.failed_loads) == ({"b", "c"}, {"b", "c"})
    assert done.failed_load_blocks == {8, 9}


def test_a_failed_load_of_a_request_that_holds_its_blocks_still_names_them() -> None:
    """Finished with a store in flight, the request holds its blocks until `sending`."""
    s = _stored_prefix()
    _failed_load(s, "b", [5, 6, 7])
    (store,) = s.build_step_metadata([StepProgress("b", [[5, 6, 7]], 3 * TPB)]).stores
    assert s.request_finished("b")
    done = s.take_finished()
    assert done.failed_load_blocks == {5, 6}
    s.on_worker_results([TransferResult(store.job_id, True)])
    assert s.take_finished().sending == {"b"}
