"""Review of the connector halves: device-hit touches in every KV-cache group, a bad
`num_computed_tokens` in a step refused before anything is planned, proof chunks looked up only
when a chunk could be loaded, and a job that a raising submit queued all the same reported
once."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import pytest

from engine_sim import block_hashes
from helpers import FakeTransfer
from kvtier.base import OffloadKey, ReqContext, TransferResult, get_offload_group_idx
from kvtier.connector import OffloadingScheduler, OffloadingWorker, StepProgress
from kvtier.cpu import CPUOffloadingManager

TPB = 4


class TouchRecorder(CPUOffloadingManager):
    """The real manager, recording the keys the scheduler touches."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.touched: list[OffloadKey] = []

    def touch(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        self.touched += list(keys)
        super().touch(keys, ctx)


def test_a_device_hit_touches_its_chunks_in_every_group() -> None:
    m = TouchRecorder(64)
    s = OffloadingScheduler(m, tokens_per_block=TPB, groups=(3, 1))
    s.add_request("a", block_hashes("a", 4), 4 * TPB + 1)
    assert s.get_num_new_matched_tokens("a", 2 * TPB) == 0
    # Two device-hit chunks in each of the two groups: a policy told only of group 3's would
    # evict group 1's copies first, and a chunk hits only while every group holds it.
    assert sorted(get_offload_group_idx(k) for k in m.touched) == [1, 1, 3, 3]


@pytest.mark.parametrize("bad", [8.0, -1, None, "8", True])
def test_a_bad_num_computed_tokens_in_a_step_is_refused_before_any_store(bad: object) -> None:
    m = CPUOffloadingManager(64)
    s = OffloadingScheduler(m, tokens_per_block=TPB)
    blocks = list(range(5))
    for rid in ("a", "b"):
        s.add_request(rid, block_hashes(rid, 4), 4 * TPB + 1)
        assert s.get_num_new_matched_tokens(rid, 0) == 0
        s.update_state_after_alloc(rid, [blocks], 0)
    progress = [StepProgress("a", [blocks], 2 * TPB), StepProgress("b", [blocks], bad)]  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"request 'b': num_computed_tokens=.* is invalid"):
        s.build_step_metadata(progress)
    # Nothing planned for "a" either: no slot reserved, no job waiting to be sent.
    assert s.num_jobs_in_flight() == 0 and m.get_stats().pending_writes == 0
    meta = s.build_step_metadata([StepProgress("a", [blocks], 2 * TPB)])
    assert [len(j.device_blocks) for j in meta.stores] == [2]


def test_a_pending_proof_chunk_does_not_hold_a_request_with_nothing_to_load() -> None:
    m = CPUOffloadingManager(64)
    s = OffloadingScheduler(m, tokens_per_block=TPB, proof_chunks=1)
    hashes = block_hashes("a", 4)
    blocks = list(range(5))
    s.add_request("w", hashes, 4 * TPB + 1)
    assert s.get_num_new_matched_tokens("w", 0) == 0
    s.update_state_after_alloc("w", [blocks], 0)
    (store,) = s.build_step_metadata([StepProgress("w", [blocks], 4 * TPB)]).stores
    assert len(store.device_blocks) == 4  # all four chunks are being written
    # The device holds both chunks "b" could load: the pending third chunk could only prove
    # a chunk already there, so "b" is answered now, not told to ask again.
    s.add_request("b", hashes[:3], 2 * TPB + 1)
    assert s.get_num_new_matched_tokens("b", 2 * TPB) == 0
    # Where a chunk could be loaded, its pending proof chunk still means "ask again".
    s.add_request("c", hashes[:3], 2 * TPB + 1)
    assert s.get_num_new_matched_tokens("c", TPB) is None


class RaisesAfterQueueing(FakeTransfer):
    """A transfer backend whose submit raises after it queued the job (an exception from a
    logging handler, say), as the `TransferBackend.holds` protocol allows."""

    def __init__(self, raise_after_queueing: bool) -> None:
        super().__init__()
        self.raise_after_queueing = raise_after_queueing
        self.queued: list[int] = []

    def _submit(self, job_id: int) -> None:
        if self.raise_after_queueing:
            self.queued.append(job_id)
        raise RuntimeError(f"submit of job {job_id} went wrong")

    def get_finished(self) -> list[TransferResult]:
        self.done += [TransferResult(j, True) for j in self.queued]
        self.queued = []
        return super().get_finished()

    def holds(self, job_id: int) -> bool:
        return job_id in self.queued


@pytest.mark.parametrize("queued", [True, False])
def test_a_job_queued_by_a_submit_that_raised_is_reported_once(queued: bool) -> None:
    m = CPUOffloadingManager(8)
    s = OffloadingScheduler(m, tokens_per_block=TPB)
    w = OffloadingWorker(RaisesAfterQueueing(queued))
    s.add_request("a", block_hashes("a", 2), 2 * TPB + 1)
    assert s.get_num_new_matched_tokens("a", 0) == 0
    s.update_state_after_alloc("a", [[0, 1, 2]], 0)
    meta = s.build_step_metadata([StepProgress("a", [[0, 1, 2]], 2 * TPB)])
    w.start_step(meta)
    w.finish_step(meta)
    (store,) = meta.stores
    results = w.get_finished()
    # Queued: the backend's own report, a success; else the worker half's refusal, a failure.
    assert results == [TransferResult(store.job_id, queued)]
    s.on_worker_results(results)
    assert s.num_jobs_in_flight() == 0 and m.get_stats().pending_writes == 0
    assert (s.store_jobs_failed, m.get_stats().ready) == ((0, 2) if queued else (1, 0))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"groups": ("a",)}, r"groups=\('a',\) is invalid; expected .*group ids .*type str"),
        ({"groups": (-1,)}, r"groups=\(-1,\) is invalid; expected .*out of range"),
        ({"groups": (True,)}, r"groups=\(True,\) is invalid; expected .*type bool"),
        ({"groups": (0.0,)}, r"groups=\(0.0,\) is invalid"),
        ({"groups": 0}, r"groups=0 is invalid; expected a non-empty sequence"),
        ({"groups": (1, 1)}, r"groups=\(1, 1\) is invalid; expected .*distinct"),
        ({"groups": ()}, r"groups=\(\) is invalid; expected a non-empty sequence"),
        ({"offload_prompt_only": "no"}, r"offload_prompt_only='no' is invalid; expected a bool"),
        ({"offload_prompt_only": None}, r"offload_prompt_only=None is invalid; expected a bool"),
    ],
)
def test_a_bad_group_id_or_flag_is_refused_at_construction(
    kwargs: dict[str, object], message: str
) -> None:
    # Before, a bad group id was accepted here and raised only at the first lookup (after that
    # call had changed the request's state), and offload_prompt_only="no" meant True.
    with pytest.raises(ValueError, match=message):
        OffloadingScheduler(CPUOffloadingManager(4), tokens_per_block=TPB, **kwargs)  # type: ignore[arg-type]


def test_numpy_group_ids_become_ints() -> None:
    groups = np.array([2, 0])  # as an engine may keep them
    s = OffloadingScheduler(CPUOffloadingManager(4), tokens_per_block=TPB, groups=groups)  # type: ignore[arg-type]
    assert s.groups == (2, 0) and all(type(g) is int for g in s.groups)
