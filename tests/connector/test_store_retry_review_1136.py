"""Review of the store retry (a store that finds no room is offered again at the request's
next step): where the retry's "can never fit" test drops an offer that fits, and what a
request stuck retrying costs while nothing can have freed room."""

from __future__ import annotations

from collections.abc import Collection

from engine_sim import block_hashes
from kvtier.base import OffloadKey, PrepareStoreOutput, ReqContext, TransferResult
from kvtier.connector import OffloadingScheduler, StepProgress
from kvtier.connector.metadata import StepMetadata
from kvtier.cpu import CPUOffloadingManager


class _CountingManager(CPUOffloadingManager):
    """A CPU manager that counts its `prepare_store` calls and the keys they were given."""

    calls = 0
    keys_offered = 0

    def prepare_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        self.calls += 1
        self.keys_offered += len(keys)
        return super().prepare_store(keys, ctx)


def _done(s: OffloadingScheduler, meta: StepMetadata) -> None:
    s.on_worker_results([TransferResult(j.job_id, True) for j in (*meta.loads, *meta.stores)])


def _store(s: OffloadingScheduler, req_id: str, hashes: list[bytes], first_block: int) -> None:
    """`req_id` computes its whole prompt (`hashes`) in one step; its store ends at once."""
    n = len(hashes)
    s.add_request(req_id, hashes, 4 * n + 1)
    assert s.get_num_new_matched_tokens(req_id, 0) == 0
    _done(
        s,
        s.build_step_metadata([StepProgress(req_id, [range(first_block, first_block + n)], 4 * n)]),
    )
    assert not s.request_finished(req_id)


def test_an_offer_over_the_tier_whose_admitted_chunks_fit_is_offered_again() -> None:
    """With reuse admission (store_threshold=2) `b` offers five chunks to a tier of four slots:
    the two of its shared prefix `P` are admitted (`a` offered them before), its own three are
    not. Every slot is pinned by `y`'s load, so there is no room now; once that load ends the
    two admitted chunks fit, and they are what later requests with the prefix need. The retry
    judges "can never fit" by the five keys offered, not the two that need a slot, and drops
    the offer for good: `P` is never stored."""
    m = CPUOffloadingManager(4, store_threshold=2)
    s = OffloadingScheduler(m, tokens_per_block=4)
    x = block_hashes("x", 4)
    _store(s, "x1", x, 0)  # first sighting: not admitted
    _store(s, "x2", x, 0)  # second: x's four chunks fill the tier
    assert m.get_stats().used_slots == 4
    p = block_hashes("p", 2)
    _store(s, "a", p, 4)  # P's first sighting
    s.add_request("y", block_hashes("y", 1, x), 21)
    assert s.get_num_new_matched_tokens("y", 0) == 16
    s.update_state_after_alloc("y", [[6, 7, 8, 9, 10]], 16)  # pins every slot
    s.add_request("b", block_hashes("b", 3, p), 21)
    assert s.get_num_new_matched_tokens("b", 0) == 0

    def b_step() -> StepMetadata:
        return s.build_step_metadata([StepProgress("b", [[11, 12, 13, 14, 15]], 20)])

    meta = b_step()
    assert meta.stores == [] and m.get_stats().stores_no_room == 5  # no room now
    _done(s, meta)  # y's load ends: x's chunks may be evicted
    assert not s.request_finished("y")
    meta = b_step()
    assert [j.device_blocks.tolist() for j in meta.stores] == [[11, 12]], (
        "b's admitted prefix, which fits the tier, was not offered again"
    )
    _done(s, meta)
    assert not s.request_finished("b")
    s.add_request("d", block_hashes("d", 1, p), 13)
    assert s.get_num_new_matched_tokens("d", 0) == 8


def test_a_stuck_store_is_not_planned_again_until_a_transfer_ends() -> None:
    """`c`'s 2,000-chunk prompt finds no room: `w`'s stores, still being written, hold every
    slot but 100. Until one of the transfers in flight ends nothing can free a slot, yet each
    decode step of `c` plans its whole prompt again: 2,000 keys, a block table of 2,000
    blocks and a manager call per step (with offload_prompt_only the offer never changes),
    where the code before the retry made one call. Once `w`'s stores end, the retry stores
    `c`'s prompt."""
    slots, held, chunks = 2_100, 2_000, 2_000
    m = _CountingManager(slots)
    s = OffloadingScheduler(m, tokens_per_block=4, offload_prompt_only=True)
    s.add_request("w", block_hashes("w", held), 4 * held + 1)
    assert s.get_num_new_matched_tokens("w", 0) == 0
    w_stores = s.build_step_metadata([StepProgress("w", [range(held)], 4 * held)])
    assert len(w_stores.stores) == 1  # in flight, not yet reported
    s.add_request("c", block_hashes("c", chunks), 4 * chunks + 1)
    assert s.get_num_new_matched_tokens("c", 0) == 0
    table = [range(held, held + chunks + 1)]
    m.calls = m.keys_offered = 0
    computed = 4 * chunks
    for _ in range(20):  # a prefill step, then decode steps; no transfer ends
        computed += 1
        assert s.build_step_metadata([StepProgress("c", table, computed)]).stores == []
    assert m.get_stats().pending_writes == held
    assert (m.calls, m.keys_offered) == (1, chunks), (
        f"a store with no room was planned again {m.calls - 1} times ({m.keys_offered} keys "
        "offered in all) though no transfer ended since it found none"
    )
    _done(s, w_stores)
    meta = s.build_step_metadata([StepProgress("c", table, computed + 1)])
    assert len(meta.stores) == 1 and meta.stores[0].device_blocks.size == chunks
