"""The connector's lookup counters count each scheduling of a request once.

An engine asks `get_num_new_matched_tokens` every step while a request waits for device
blocks; the manager counts each of those lookups, so vLLM's `lookup_hits` metric (read from
the manager) grew with the wait, not with what was served. The scheduler now keeps its own
counts, taken only when the engine allocates for an offer.
"""

from __future__ import annotations

import pytest

from engine_sim import block_hashes, stored_manager
from kvtier.base import ReqContext, make_offload_key
from kvtier.connector import OffloadingScheduler


def test_a_request_asked_every_step_counts_once_when_scheduled() -> None:
    hashes = block_hashes("a", 3)
    m = stored_manager(16, hashes[:2])
    s = OffloadingScheduler(m, tokens_per_block=4)
    s.add_request("a", hashes, 13)
    for _ in range(5):  # waiting for device blocks: asked again each step
        assert s.get_num_new_matched_tokens("a", 0) == 8
    assert (m.get_stats().hits, m.get_stats().misses) == (10, 5)
    assert (s.lookup_hits, s.lookup_misses) == (0, 0)  # nothing scheduled yet
    s.update_state_after_alloc("a", [[0, 1, 2, 3]], 8)
    assert (s.lookup_hits, s.lookup_misses) == (2, 1)
    # Counted with the offer it belongs to, not again by a later call.
    s.update_state_after_alloc("a", [[0, 1, 2, 3]], 0)
    assert (s.lookup_hits, s.lookup_misses) == (2, 1)


def test_scheduled_with_no_load_counts_the_lookup_that_found_nothing() -> None:
    hashes = block_hashes("b", 2)
    m = stored_manager(16, [])
    s = OffloadingScheduler(m, tokens_per_block=4, groups=(0, 1))
    s.add_request("b", hashes, 9)
    assert s.get_num_new_matched_tokens("b", 0) == 0
    assert s.get_num_new_matched_tokens("b", 0) == 0
    s.update_state_after_alloc("b", (), 0)
    assert (s.lookup_hits, s.lookup_misses) == (0, 1)


def test_every_group_counts_and_a_refused_alloc_counts_nothing() -> None:
    hashes = block_hashes("c", 3)
    m = stored_manager(16, hashes, groups=(0, 1))
    s = OffloadingScheduler(m, tokens_per_block=4, groups=(0, 1))
    s.add_request("c", hashes, 13)
    assert s.get_num_new_matched_tokens("c", 0) == 12
    with pytest.raises(ValueError, match="num_external_tokens=4 does not match the 12"):
        s.update_state_after_alloc("c", [[0, 1, 2, 3], [4, 5, 6, 7]], 4)
    assert (s.lookup_hits, s.lookup_misses) == (0, 0)  # the offer still stands
    s.update_state_after_alloc("c", [[0, 1, 2, 3], [4, 5, 6, 7]], 12)
    assert (s.lookup_hits, s.lookup_misses) == (6, 0)  # 3 chunks x 2 groups, no miss


def test_a_request_that_was_never_scheduled_counts_nothing() -> None:
    hashes = block_hashes("d", 2)
    m = stored_manager(16, hashes)
    s = OffloadingScheduler(m, tokens_per_block=4)
    s.add_request("d", hashes, 9)
    assert s.get_num_new_matched_tokens("d", 0) == 8
    assert s.request_finished("d") is False
    assert (s.lookup_hits, s.lookup_misses) == (0, 0)
    # A pending chunk answers "ask again": no offer, so no counts held for a later alloc.
    e_hashes = block_hashes("e", 2)
    pending = [make_offload_key(e_hashes[0], 0)]
    assert m.prepare_store(pending, ReqContext("w")) is not None
    s.add_request("e", e_hashes, 9)
    assert s.get_num_new_matched_tokens("e", 0) is None
    s.update_state_after_alloc("e", (), 0)
    assert (s.lookup_hits, s.lookup_misses) == (0, 0)
