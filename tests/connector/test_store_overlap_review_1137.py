"""Review of overlapping store jobs of one request (#1137): a request's chunks computed while
its stores of earlier steps are still in flight are now stored beside them, each step's in a
new job. Where that meets a cache reset, the store retry after no room, a release of the
request's blocks, a preemption, a failed or late job, and the KV events.

The scheduler is driven directly, with one block a chunk; a step's stores end when the test
reports them (`_done`)."""

from __future__ import annotations

from collections.abc import Sequence

from engine_sim import block_hashes
from kvtier.base import LookupResult, OffloadKey, ReqContext, TransferResult, make_offload_key
from kvtier.connector import OffloadingScheduler, StepProgress
from kvtier.connector.metadata import StepMetadata, TransferJob
from kvtier.cpu import CPUOffloadingManager

TPB = 4  # tokens per block (one block a chunk)
BLOCKS = list(range(10, 30))  # request a's device blocks
PROBE = ReqContext("probe")


def _scheduler(
    slots: int, groups: tuple[int, ...] = (0,), events: bool = False
) -> tuple[CPUOffloadingManager, OffloadingScheduler]:
    m = CPUOffloadingManager(slots, enable_events=events)
    return m, OffloadingScheduler(m, tokens_per_block=TPB, groups=groups)


def _add(s: OffloadingScheduler, req_id: str, hashes: list[bytes]) -> None:
    """Track `req_id` (its prompt: `hashes` and one token more) with no hit."""
    s.add_request(req_id, hashes, len(hashes) * TPB + 1)
    assert s.get_num_new_matched_tokens(req_id, 0) == 0
    s.update_state_after_alloc(req_id, [[] for _ in s.groups], 0)


def _step(s: OffloadingScheduler, req_id: str, computed_blocks: int) -> StepMetadata:
    """A step of `req_id` with `computed_blocks` blocks computed once it has run."""
    table = [BLOCKS for _ in s.groups]
    return s.build_step_metadata([StepProgress(req_id, table, computed_blocks * TPB)])


def _done(s: OffloadingScheduler, jobs: Sequence[TransferJob], ok: bool = True) -> None:
    s.on_worker_results([TransferResult(j.job_id, ok) for j in jobs])


def _keys(hashes: list[bytes], group: int = 0) -> list[OffloadKey]:
    return [make_offload_key(h, group) for h in hashes]


# -- findings -------------------------------------------------------------------------------


def test_a_store_planned_beside_its_own_store_from_before_a_reset_is_not_dropped() -> None:
    """A reset while a request's store is in flight quarantines that store's slots until it
    ends (`on_reset_flushed`). The request's next step now plans its chunks again beside that
    store (the reset sends its store offset back to 0), and the tier, short of the
    quarantined slots, has no room. The retry judged "can never fit" by the room
    `num_slots - pinned - pending_writes`, which counted quarantined slots as room: it found
    the whole tier free, so the offer was dropped for good and the request's store offset
    moved past chunks that were never stored; once the old store ended nothing offered them
    again. Room now leaves the quarantined slots out. Before stores overlapped, the request
    waited for its old store, then stored all four chunks."""
    m, s = _scheduler(4)
    a = block_hashes("a", 4)
    _add(s, "a", a)
    first = _step(s, "a", 2)  # chunks 0-1, in flight across the reset
    assert [j.device_blocks.tolist() for j in first.stores] == [BLOCKS[:2]]
    s.reset_cache()
    second = _step(s, "a", 4)  # chunks 0-3: 2 slots quarantined, 2 free, no room now
    _done(s, [*first.stores, *second.stores])  # the old store ends: its slots are free
    third = _step(s, "a", 4)
    _done(s, third.stores)
    assert not s.request_finished("a")
    assert m.get_stats().ready == 4, (
        "a's chunks were dropped as 'can never fit' while the tier was short only of the "
        f"slots a store from before the reset still used: {m.get_stats()}"
    )
    assert [m.lookup(k, PROBE) for k in _keys(a)] == [LookupResult.HIT] * 4


# -- guards: behaviour that holds, and that overlapping store sets could plausibly break ------


def _two_sets(s: OffloadingScheduler, hashes: list[bytes]) -> tuple[TransferJob, TransferJob]:
    """Request "a" stores chunks 0-1, then (beside them, still in flight) chunks 2-3."""
    _add(s, "a", hashes)
    (first,) = _step(s, "a", 2).stores
    (second,) = _step(s, "a", 4).stores
    assert first.device_blocks.tolist() == BLOCKS[:2]
    assert second.device_blocks.tolist() == BLOCKS[2:4]
    return first, second


def test_sets_ending_tail_first_leave_the_head_above_the_tail() -> None:
    """Guard (holds): the later set ends first. Its `prefix_extended` names the head while
    the head is still being written (the policy skips keys it does not hold); the head,
    inserted after, is then the newest. A later store into the full tier evicts a's tail,
    not its head, so a's first three chunks still load."""
    m, s = _scheduler(4)
    a = block_hashes("a", 4)
    first, second = _two_sets(s, a)
    _done(s, [second])
    _done(s, [first])
    assert not s.request_finished("a")
    _add(s, "b", block_hashes("b", 1))
    _done(s, _step(s, "b", 1).stores)
    assert not s.request_finished("b")
    found = [m.lookup(k, PROBE) for k in _keys(a)]
    assert found == [LookupResult.HIT] * 3 + [LookupResult.MISS]


def test_a_held_request_is_sent_once_after_its_last_set_ends() -> None:
    """Guard (holds): a request finished with two sets in flight (blocks held) is reported
    in `sending` only once both have ended, whichever ends first."""
    m, s = _scheduler(8)
    first, second = _two_sets(s, block_hashes("a", 4))
    assert s.request_finished("a")
    _done(s, [second])
    assert s.take_finished().sending == set()
    assert s.num_requests() == 1
    _done(s, [first])
    assert s.take_finished().sending == {"a"}
    assert s.num_requests() == 0 and m.get_stats().ready == 4


def test_a_released_request_fences_the_blocks_of_every_set() -> None:
    """Guard (holds): released with two sets in flight, every block either set reads is
    fenced by that set's job, and only until that job ends."""
    _, s = _scheduler(8)
    first, second = _two_sets(s, block_hashes("a", 4))
    assert not s.request_finished("a", release=True)
    s.blocks_allocated([BLOCKS[1], BLOCKS[3]])
    assert s.build_step_metadata().wait_for == [first.job_id, second.job_id]
    _done(s, [second])
    s.blocks_allocated(BLOCKS[:4])
    assert s.build_step_metadata().wait_for == [first.job_id]
    _done(s, [first])
    assert not s.has_fences() and s.num_requests() == 0


def test_a_preempted_request_waits_for_every_set_and_stores_beside_none() -> None:
    """Guard (holds): preempted with two sets in flight, both are waited for, nothing is
    stored (nor loaded) beside them, and once they end its chunks are offered again from
    the first (those stored are skipped)."""
    m, s = _scheduler(8)
    a = block_hashes("a", 6)
    first, second = _two_sets(s, a)
    s.request_preempted("a")
    assert s.get_num_new_matched_tokens("a", 0) is None
    meta = _step(s, "a", 6)
    assert meta.wait_for == [first.job_id, second.job_id] and meta.stores == []
    _done(s, [first, second])
    (job,) = _step(s, "a", 6).stores
    assert job.device_blocks.tolist() == BLOCKS[4:6]  # chunks 0-3 are held already
    _done(s, [job])
    assert not s.request_finished("a")
    assert m.get_stats().ready == 6


def test_a_store_finding_no_room_beside_its_own_set_is_retried_once_that_set_ends() -> None:
    """Guard (holds): a's second set finds no room while its first holds the tier's slots
    (being written); it is offered again once the first has ended, not dropped as 'can
    never fit', and not offered again while nothing changed."""
    m, s = _scheduler(3)
    a = block_hashes("a", 4)
    _add(s, "a", a)
    (first,) = _step(s, "a", 2).stores
    assert _step(s, "a", 4).stores == []  # 1 slot left for 2 chunks
    calls = m.get_stats().stores_no_room
    assert _step(s, "a", 4).stores == []  # nothing freed room: not offered again
    assert m.get_stats().stores_no_room == calls
    _done(s, [first])
    (retry,) = _step(s, "a", 4).stores
    assert retry.device_blocks.tolist() == BLOCKS[2:4]
    _done(s, [retry])
    assert not s.request_finished("a")


def test_each_set_describes_its_own_chunks_for_kv_events() -> None:
    """Guard (holds): `store_chunks` of overlapping sets names each set's own chunks, and
    the manager announces each chunk once, in the order the sets end."""
    m, s = _scheduler(8, groups=(0, 1), events=True)
    a = block_hashes("a", 4)
    _add(s, "a", a)
    first = _step(s, "a", 2).stores
    second = _step(s, "a", 4).stores
    assert len(first) == len(second) == 2  # one job per group
    for jobs, chunks in ((first, [0, 1]), (second, [2, 3])):
        for j in jobs:
            g = s.groups.index(j.group)
            want = [(k, c) for k, c in zip(_keys(a, j.group), range(4), strict=True)]
            assert s.store_chunks(j.job_id) == [want[c] for c in chunks]
            assert j.device_blocks.tolist() == BLOCKS[chunks[0] : chunks[-1] + 1], g
    _done(s, second)
    _done(s, first)
    assert not s.request_finished("a")
    stored = [k for e in m.take_events() if not e.removed for k in e.keys]
    assert sorted(stored) == sorted(_keys(a, 0) + _keys(a, 1))
    assert len(stored) == len(set(stored)) == 8


def test_a_reset_with_a_set_in_flight_stores_the_chunks_once_more_beside_it() -> None:
    """Guard (holds, with room): a reset while a's first set is in flight sends a's store
    offset back to 0; its next step stores chunks 0-3 beside the old set, in other slots.
    The old set's end touches nothing the tier holds now, and each chunk is announced once
    (the old set's were never announced)."""
    m, s = _scheduler(8, events=True)
    a = block_hashes("a", 4)
    _add(s, "a", a)
    (old,) = _step(s, "a", 2).stores
    s.reset_cache()
    (new,) = _step(s, "a", 4).stores
    assert new.device_blocks.tolist() == BLOCKS[:4]
    assert set(new.slots.tolist()).isdisjoint(old.slots.tolist())
    _done(s, [new])
    _done(s, [old], ok=False)  # the old one failing frees nothing the tier holds now
    assert not s.request_finished("a")
    assert [m.lookup(k, PROBE) for k in _keys(a)] == [LookupResult.HIT] * 4
    stored = [k for e in m.take_events() if not e.removed for k in e.keys]
    assert stored == _keys(a)
