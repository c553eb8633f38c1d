"""The manager's KV events and counters under random operation sequences.

A consumer replays every event it takes into a set; at any time that set plus the replay of the
events still pending must be exactly the keys the manager has announced (stored and completed,
not removed since), however often pending events were merged past `max_pending_events`. The
counters are recomputed from what each call returned.
"""

from __future__ import annotations

import random

import pytest

from helpers import apply_events, key
from kvtier.base import LookupResult, OffloadKey, ReqContext
from kvtier.cpu import CPUOffloadingManager


def _announced(mgr: CPUOffloadingManager) -> set[OffloadKey]:
    # Readable keys: stored and completed (pinned or not); pending writes are not public.
    return {k for k in mgr._slot_of if mgr._ref[mgr._slot_of[k]] != -1}


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo", "sieve"])
@pytest.mark.parametrize("max_pending", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("threshold", [0, 2])
def test_events_replay_to_the_managers_contents(
    policy: str, max_pending: int, threshold: int
) -> None:
    for seed in range(4):
        rng = random.Random(seed)
        slots = 6
        mgr = CPUOffloadingManager(
            slots,
            policy,
            enable_events=True,
            max_pending_events=max_pending,
            store_threshold=threshold,
        )
        universe = [key(i) for i in range(16)]
        consumer: set[OffloadKey] = set()
        pending: list[list[OffloadKey]] = []  # stores prepared, not completed
        loads: list[list[OffloadKey]] = []  # loads prepared, not completed
        exp = dict(hits=0, misses=0, loads=0, stores=0, failed=0, skipped=0, evictions=0)
        for step in range(500):
            ctx = ReqContext(req_id=rng.choice("abcd"))
            op = rng.random()
            if op < 0.2:
                k = rng.choice(universe)
                r = mgr.lookup(k, ctx)
                if r is LookupResult.HIT:
                    exp["hits"] += 1
                elif r is LookupResult.MISS:
                    exp["misses"] += 1
            elif op < 0.45:
                batch = rng.sample(universe, rng.randint(1, 3))
                new = [k for k in batch if k not in mgr._slot_of]
                out = mgr.prepare_store(batch, ctx)
                if out is not None:
                    exp["skipped"] += len(new) - len(out.keys_to_store)
                    exp["evictions"] += len(out.evicted_keys)
                    assert not set(out.evicted_keys) & set(batch)
                    if out.keys_to_store:
                        pending.append(list(out.keys_to_store))
            elif op < 0.65 and pending:
                ks = pending.pop(rng.randrange(len(pending)))
                ok = rng.random() < 0.8
                mgr.complete_store(ks, ctx, success=ok)
                exp["stores" if ok else "failed"] += len(ks)
            elif op < 0.75:
                ready = sorted(_announced(mgr))
                if ready:
                    ks = rng.sample(ready, min(len(ready), rng.randint(1, 2)))
                    mgr.prepare_load(ks, ctx)
                    exp["loads"] += len(ks)
                    loads.append(ks)
            elif op < 0.85 and loads:
                mgr.complete_load(loads.pop(rng.randrange(len(loads))), ctx)
            elif op < 0.9:
                mgr.touch(rng.sample(universe, 2), ctx)
            elif op < 0.93:
                mgr.reset_cache()
                pending.clear()  # their transfers finish into quarantined slots
                loads.clear()
                mgr.on_reset_flushed()
            else:
                apply_events(consumer, list(mgr.take_events()))
            # Pending events stay bounded by merging.
            queued = list(mgr._events or [])
            assert len(queued) <= max(max_pending, 2)
            view = set(consumer)
            apply_events(view, queued)
            assert view == _announced(mgr), (seed, step)
            stats = mgr.get_stats()
            assert (
                stats.hits,
                stats.misses,
                stats.loads,
                stats.stores,
                stats.failed_stores,
                stats.stores_skipped,
                stats.evictions,
            ) == (
                exp["hits"],
                exp["misses"],
                exp["loads"],
                exp["stores"],
                exp["failed"],
                exp["skipped"],
                exp["evictions"],
            ), (seed, step)
            assert stats.used_slots <= slots


def test_stored_event_only_after_successful_complete_store() -> None:
    mgr = CPUOffloadingManager(2, enable_events=True)
    ctx = ReqContext(req_id="r")
    out = mgr.prepare_store([key(1), key(2)], ctx)
    assert out is not None
    assert list(mgr.take_events()) == []
    mgr.complete_store([key(1)], ctx, success=False)
    assert list(mgr.take_events()) == []
    mgr.complete_store([key(2)], ctx)
    assert [(e.keys, e.removed) for e in mgr.take_events()] == [([key(2)], False)]
