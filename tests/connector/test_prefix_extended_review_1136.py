"""Review of the connector's `prefix_extended` hook (a prompt stored over several steps keeps
its head above its tail): cases where the head is still evicted before the tail, where the
hook counts as a use, and where ARC now orders a prompt by how many steps stored it.

Each scenario stores request "a"'s prompt, then stores another request's new chunks into a
full tier, and asks how much of a's prompt a later request can still load: a lookup stops at
the first miss, so the tail must leave before the head."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest

from engine_sim import block_hashes
from kvtier.base import OffloadKey, ReqContext, TransferResult
from kvtier.connector import OffloadingScheduler, StepProgress
from kvtier.connector.metadata import StepMetadata
from kvtier.cpu import CPUOffloadingManager
from kvtier.policies import CachePolicy, LRUPolicy

TPB = 4  # tokens per block (one block a chunk)
A = block_hashes("a", 4)


def _done(s: OffloadingScheduler, meta: StepMetadata, ok: bool = True) -> None:
    s.on_worker_results([TransferResult(j.job_id, ok) for j in (*meta.loads, *meta.stores)])


def _scheduler(
    slots: int, policy: str | type[CachePolicy] = "lru", groups: tuple[int, ...] = (0,)
) -> OffloadingScheduler:
    return OffloadingScheduler(
        CPUOffloadingManager(slots, cache_policy=policy), tokens_per_block=TPB, groups=groups
    )


def _store_prompt(
    s: OffloadingScheduler, req_id: str, hashes: list[bytes], steps: Sequence[int]
) -> None:
    """`req_id`'s prompt (every block of `hashes`, plus one token) computed `steps[i]` tokens
    by step i, each step's stores done at once; then the request finishes."""
    s.add_request(req_id, hashes, len(hashes) * TPB + 1)
    assert s.get_num_new_matched_tokens(req_id, 0) == 0
    table = [list(range(len(hashes) + 1)) for _ in s.groups]
    for computed in steps:
        _done(s, s.build_step_metadata([StepProgress(req_id, table, computed)]))
    assert not s.request_finished(req_id)


def _push(s: OffloadingScheduler, num_chunks: int) -> None:
    """Another request stores `num_chunks` new chunks, evicting as many of the tier's."""
    _store_prompt(s, "push", block_hashes("push", num_chunks), [num_chunks * TPB])


def _hit_tokens(s: OffloadingScheduler, hashes: list[bytes]) -> int:
    """Tokens of the prompt `hashes` (plus one more block) a new request is offered."""
    s.add_request("probe", block_hashes("probe", 1, hashes), (len(hashes) + 1) * TPB + 1)
    n = s.get_num_new_matched_tokens("probe", 0)
    assert n is not None
    return n


# -- the last store of a request that finished before it completed ----------------------------


@pytest.mark.parametrize("release", [False, True], ids=["held", "released"])
def test_the_last_store_completing_after_the_request_finished_keeps_the_head(
    release: bool,
) -> None:
    """Fails on the current source (and the old one): `_extended_prefix` returns None for a
    finished request, so the store of the prompt's last chunks, whose completion an engine
    reports after the request finished (vLLM: a request with one output token, or any whose
    last store is reported a step late), enters the LRU above the head, and the head goes
    first. The request's end is applied after the job (`on_request_finished` comes last), so
    the hook could still be called there with the request's own ctx."""
    s = _scheduler(4)
    s.add_request("a", A, 4 * TPB + 1)
    assert s.get_num_new_matched_tokens("a", 0) == 0
    table = [[0, 1, 2, 3, 4]]
    _done(s, s.build_step_metadata([StepProgress("a", table, 2 * TPB)]))
    last = s.build_step_metadata([StepProgress("a", table, 4 * TPB)])
    assert s.request_finished("a", release=release) is not release
    _done(s, last)
    assert s.take_finished().sending == (set() if release else {"a"})
    _push(s, 2)
    # The tail (chunks 2-3) must be the victims: two chunks of a's prompt remain loadable.
    assert _hit_tokens(s, A) == 2 * TPB


# -- an LRU subclass: a use is not a re-rank ----------------------------------------------------


class _CountingLRU(LRUPolicy):
    """An LRU that counts uses (`touch`), as an LRU-K or a frequency-aware plugin would."""

    uses: list[OffloadKey]

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.uses = []

    def touch(self, keys: Iterable[OffloadKey], ctx: ReqContext | None) -> None:
        keys = list(keys)
        self.uses.extend(keys)
        super().touch(keys, ctx)


class _FifoLRU(LRUPolicy):
    """First in, first out: a use does not move a key (tests/sim/test_policy_spec_cli.py)."""

    def touch(self, keys: Iterable[OffloadKey], ctx: ReqContext | None) -> None:
        pass


def test_an_lru_subclass_that_counts_uses_sees_no_use_from_stores() -> None:
    """Fails on the current source only: `LRUPolicy.prefix_extended` calls `self.touch`, so
    a subclass that counts uses in `touch` counts a prompt stored in two steps as used,
    though the hook's contract (base.py, policies/base.py) says it is not a use."""
    m = CPUOffloadingManager(8, cache_policy=_CountingLRU)
    s = OffloadingScheduler(m, tokens_per_block=TPB)
    _store_prompt(s, "a", A, [2 * TPB, 4 * TPB])
    policy = m.policy
    assert isinstance(policy, _CountingLRU)
    assert policy.uses == []


def test_a_fifo_subclass_orders_a_prompt_stored_in_two_steps_as_one_stored_at_once() -> None:
    """Fails on the current source (and the old one): a FIFO made from LRU by a `touch` that
    does nothing keeps a prompt stored in one call head last (LRU's insert), but one stored
    in two steps head first, as the hook goes through `touch`: its head is evicted first."""
    hits = []
    for steps in ([4 * TPB], [2 * TPB, 4 * TPB]):
        s = _scheduler(4, _FifoLRU)
        _store_prompt(s, "a", A, steps)
        _push(s, 2)
        hits.append(_hit_tokens(s, A))
    assert hits == [2 * TPB, 2 * TPB]


# -- several KV-cache groups ------------------------------------------------------------------


def test_two_groups_lose_the_prompt_tail_first() -> None:
    """Fails on the current source (and the old one): the hook re-ranks one group's keys per
    job, so the second group's whole prefix ends above the first group's, and the LRU evicts
    group 0's head before group 1's tail. A chunk hits only if every group holds it: half
    the slots evicted leave nothing loadable, where the tail's chunks (both groups) should
    go first. (A prompt stored in one call is stacked by group the same way.)"""
    s = _scheduler(8, groups=(0, 1))
    _store_prompt(s, "a", A, [2 * TPB, 4 * TPB])
    _push(s, 2)  # two chunks in each group: four of a's eight keys go
    assert _hit_tokens(s, A) == 2 * TPB


# -- a store from the first chunk that skips held ones ------------------------------------------


def test_a_store_from_the_first_chunk_past_held_chunks_keeps_the_head() -> None:
    """Fails on the current source (and the old one): `_extended_prefix` skips every store
    whose first key is chunk 0 ("the store put the head above its tail itself"), but a store
    that skips held chunks puts only its own keys above them: here chunk 0's store had
    failed, a later request stores chunks 0, 4 and 5 past the held 1-3, and chunks 1-3 (older)
    are evicted before 4-5, which are then unreachable."""
    p = block_hashes("p", 6)
    s = _scheduler(6)
    s.add_request("a", p[:4], 4 * TPB + 1)
    assert s.get_num_new_matched_tokens("a", 0) == 0
    table = [list(range(5))]
    _done(s, s.build_step_metadata([StepProgress("a", table, TPB)]), ok=False)
    _done(s, s.build_step_metadata([StepProgress("a", table, 4 * TPB)]))
    assert not s.request_finished("a")
    _store_prompt(s, "b", p, [6 * TPB])  # chunk 0 missed: b computes it all
    _push(s, 2)
    assert _hit_tokens(s, p) == 4 * TPB


# -- ARC: the same prompt, stored in one step or two -------------------------------------------


def test_arc_orders_a_prompt_the_same_however_many_steps_stored_it() -> None:
    """Fails on the current source, passes on the old one. ARC applies a call's keys head
    first (docs/policies.md, "Order within a call"): a prompt stored in one call leaves
    head first. Its new `prefix_extended` moves the head to T1's MRU end, so a prompt stored
    in two steps now leaves tail first: the order depends on the engine's step budget, and
    the hook does not leave the keys "as when the whole prefix is stored in one call"."""
    hits = []
    for steps in ([4 * TPB], [2 * TPB, 4 * TPB]):
        s = _scheduler(4, "arc")
        _store_prompt(s, "a", A, steps)
        _push(s, 2)
        hits.append(_hit_tokens(s, A))
    assert hits[0] == hits[1]


# -- guard: a policy error in the hook ----------------------------------------------------------


class _HookFails(LRUPolicy):
    def prefix_extended(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        raise RuntimeError("prefix_extended failed")


def test_a_policy_error_in_the_hook_is_raised_after_the_whole_batch() -> None:
    """A guard (fails on the old source, where no hook is called): the error waits for the
    batch, as `on_request_finished`'s does, and every job of it is applied."""
    s = _scheduler(8, _HookFails)
    for rid in ("a", "b"):
        s.add_request(rid, block_hashes(rid, 4), 4 * TPB + 1)
        assert s.get_num_new_matched_tokens(rid, 0) == 0
    table = [[0, 1, 2, 3, 4]]
    _done(s, s.build_step_metadata([StepProgress("a", table, 2 * TPB)]))
    step = s.build_step_metadata(
        [StepProgress("a", table, 4 * TPB), StepProgress("b", table, 2 * TPB)]
    )
    assert [j.req_id for j in step.stores] == ["a", "b"]
    with pytest.raises(RuntimeError, match="prefix_extended failed"):
        _done(s, step)
    assert s.num_jobs_in_flight() == 0
    stats = s.manager.get_stats()
    assert (stats.pending_writes, stats.stores) == (0, 6)
