"""Randomized differential test of CPUOffloadingManager against a plain model of the tier.

Random sequences of lookups, stores (completed, failed, or left in flight), loads (pinned and
unpinned), touches, request ends, resets (with pins and writes outstanding), flushes and bad
calls drive the manager; after every step the model's contents, slot ids, counters, gauges and
the replay of the emitted events must agree with it. Seeded and fast, for every cache policy.
"""

from __future__ import annotations

import dataclasses
import random
from collections import OrderedDict
from dataclasses import dataclass, field

import pytest

from helpers import apply_events, key
from kvtier.base import LookupResult, OffloadingEvent, OffloadKey, ReqContext
from kvtier.cpu import CPUOffloadingManager

UNIVERSE = [key(i) for i in range(24)]


@dataclass
class Model:
    """What the tier must hold: a key is pending or ready, with pins and the slot it owns."""

    num_slots: int
    threshold: int
    state: dict[OffloadKey, str] = field(default_factory=dict)  # "pending" | "ready"
    slot: dict[OffloadKey, int] = field(default_factory=dict)
    pins: dict[OffloadKey, int] = field(default_factory=dict)
    quarantined: set[int] = field(default_factory=set)
    max_tracker: int = 10_000
    # Reuse admission: key -> ids of the distinct requests that offered it, oldest offer first.
    seen: OrderedDict[OffloadKey, set[str]] = field(default_factory=OrderedDict)
    hits: int = 0
    misses: int = 0
    loads: int = 0
    stores: int = 0
    failed: int = 0
    skipped: int = 0
    evictions: int = 0
    no_room: int = 0

    def candidates(self) -> set[OffloadKey]:
        return {k for k, s in self.state.items() if s == "ready" and not self.pins.get(k)}

    def admitted(self, new: list[OffloadKey], req: str) -> list[OffloadKey]:
        if self.threshold < 2:
            return list(new)
        return [k for k in new if len(self.seen.get(k, set()) | {req}) >= self.threshold]

    def record(self, new: list[OffloadKey], req: str) -> None:
        if self.threshold < 2:
            return
        seen = self.seen
        for k in new:
            if k in seen:
                seen[k].add(req)
                seen.move_to_end(k)
        for k in [k for k in new if k not in seen]:
            if len(seen) >= self.max_tracker:
                # Room comes only from entries of earlier offers, oldest first.
                older = next((o for o in seen if o not in new), None)
                if older is None:
                    break
                del seen[older]
            seen[k] = {req}


def fingerprint(m: CPUOffloadingManager) -> tuple[object, ...]:
    """What a call that raises must leave as it was."""
    return (
        dict(m._slot_of),
        list(m._ref),
        sorted(m._free),
        m._next_fresh,
        sorted(m._quarantined),
        dataclasses.replace(m.get_stats(), stores_no_room=0),  # a refused store counts its keys
        m.table_sizes(),
        list(getattr(m.admission, "_seen", {}).items()),
    )


def run(policy: str, seed: int, steps: int) -> None:
    rng = random.Random(seed)
    num_slots = rng.choice([1, 3, 6, 12])
    threshold = rng.choice([0, 0, 2, 3])
    max_events = rng.choice([1, 2, 5, 100_000])
    max_tracker = rng.choice([2, 5, 10_000])
    busy = rng.choice([0, 1, 4])  # jobs of each kind left in flight at most
    m = CPUOffloadingManager(
        num_slots,
        policy,
        store_threshold=threshold,
        max_tracker_size=max_tracker,
        enable_events=True,
        max_pending_events=max_events,
    )
    model = Model(num_slots, threshold, max_tracker=max_tracker)
    stores: list[tuple[list[OffloadKey], ReqContext]] = []  # in flight, this generation
    loads: list[tuple[list[OffloadKey], ReqContext]] = []
    view: set[OffloadKey] = set()  # a consumer's replay of the events
    req = 0
    ctx = ReqContext("r0")

    def take() -> None:
        events = list(m.take_events())
        assert all(isinstance(event, OffloadingEvent) for event in events)
        apply_events(view, events)

    for _ in range(steps):
        op = rng.random()
        if len(stores) > busy:
            op = 0.55  # complete a store
        elif len(loads) > busy:
            op = 0.75  # complete a load
        if op < 0.08:
            m.on_request_finished(ctx)
            req += 1
            ctx = ReqContext(f"r{req}" if rng.random() < 0.8 else f"r{rng.randrange(req + 1)}")
            m.on_new_request(ctx)
        elif op < 0.2:
            k = rng.choice(UNIVERSE)
            got = m.lookup(k, ctx)
            s = model.state.get(k)
            want = {
                None: LookupResult.MISS,
                "pending": LookupResult.HIT_PENDING,
                "ready": LookupResult.HIT,
            }[s]
            assert got is want
            model.hits += s == "ready"
            model.misses += s is None
        elif op < 0.5:
            offer = [rng.choice(UNIVERSE) for _ in range(rng.randint(0, 4))]
            new = list(dict.fromkeys(k for k in offer if k not in model.state))
            admitted = model.admitted(new, ctx.req_id)
            free = num_slots - len(model.state) - len(model.quarantined)
            need = len(admitted) - free
            evictable = model.candidates() - set(offer)
            before = fingerprint(m)
            out = m.prepare_store(offer, ctx)
            if not new:
                assert out is not None and out.keys_to_store == [] and out.evicted_keys == []
                continue
            if need > len(evictable):
                assert out is None, "found room the model does not have"
                assert fingerprint(m) == before, "a store that found no room changed state"
                model.no_room += len(new)  # every key offered absent, admitted or not
                continue
            assert out is not None, f"no room though {len(evictable)} keys could go for {need}"
            assert out.keys_to_store == admitted
            assert len(out.evicted_keys) == max(need, 0)
            assert set(out.evicted_keys) <= evictable
            slots = out.store_spec.block_ids.tolist()  # type: ignore[attr-defined]
            assert len(slots) == len(admitted) == len(set(slots))
            for victim in out.evicted_keys:
                del model.state[victim], model.slot[victim]
            live = set(model.slot.values()) | model.quarantined
            assert all(0 <= s < num_slots and s not in live for s in slots)
            model.record(new, ctx.req_id)
            model.evictions += len(out.evicted_keys)
            model.skipped += len(new) - len(admitted)
            for k, s in zip(admitted, slots, strict=True):
                model.state[k] = "pending"
                model.slot[k] = s
            if admitted:
                stores.append((list(admitted), ctx))
        elif op < 0.62 and stores:
            job, jctx = stores.pop(rng.randrange(len(stores)))
            ok = rng.random() < 0.75
            m.complete_store(job, jctx, success=ok)
            for k in job:
                if ok:
                    model.state[k] = "ready"
                else:
                    del model.state[k], model.slot[k]
            model.stores += len(job) if ok else 0
            model.failed += 0 if ok else len(job)
        elif op < 0.72:
            ready = sorted(k for k, s in model.state.items() if s == "ready")
            if not ready:
                continue
            job = [rng.choice(ready) for _ in range(rng.randint(1, 3))]  # repeats allowed
            spec = m.prepare_load(job, ctx)
            assert spec.block_ids.tolist() == [model.slot[k] for k in job]
            for k in job:
                model.pins[k] = model.pins.get(k, 0) + 1
            model.loads += len(job)
            loads.append((job, ctx))
        elif op < 0.8 and loads:
            job, jctx = loads.pop(rng.randrange(len(loads)))
            m.complete_load(job, jctx)
            for k in job:
                model.pins[k] -= 1
                if not model.pins[k]:
                    del model.pins[k]
        elif op < 0.85:
            m.touch([rng.choice(UNIVERSE) for _ in range(rng.randint(1, 3))], ctx)
        elif op < 0.9:
            # A bad call of some kind: it must raise and change nothing.
            before = fingerprint(m)
            kind = rng.randrange(3)
            k = rng.choice(UNIVERSE)
            with pytest.raises(ValueError):
                if kind == 0:
                    ready = [x for x, s in model.state.items() if s == "ready"]
                    bad = [x for x in UNIVERSE if model.state.get(x) != "ready"]
                    m.prepare_load([*ready[:2], rng.choice(bad)], ctx)
                elif kind == 1:
                    unpinned = [x for x in UNIVERSE if x not in model.pins]
                    pinned = list(model.pins)[:1]
                    m.complete_load([*pinned, rng.choice(unpinned)], ctx)
                else:
                    pending = [x for x, s in model.state.items() if s == "pending"][:1]
                    other = [x for x in UNIVERSE if model.state.get(x) != "pending"]
                    m.complete_store([*pending, rng.choice(other)], ctx, success=k[0] % 2 == 0)
            assert fingerprint(m) == before
        elif op < 0.93:
            for k, s in model.state.items():
                if s == "pending" or model.pins.get(k):
                    model.quarantined.add(model.slot[k])
            model.state.clear()
            model.slot.clear()
            model.pins.clear()
            model.seen.clear()
            stores.clear()  # the caller drops completions of jobs from before a reset
            loads.clear()
            m.reset_cache()
        elif op < 0.95:
            # The jobs dropped at the last reset have ended (current ones hold no quarantine).
            model.quarantined.clear()
            m.on_reset_flushed()
        if rng.random() < 0.3:
            take()
            assert view == set(model.candidates()) | set(model.pins)
        assert len(m._events or ()) <= max(max_events, 2)
        stats = m.get_stats()
        num_pending = sum(1 for s in model.state.values() if s == "pending")
        assert stats.num_slots == num_slots
        assert m.table_sizes().get("admission.tracker", 0) == len(model.seen) <= max_tracker
        assert stats.used_slots == len(model.state) + len(model.quarantined) <= num_slots
        assert stats.pending_writes == num_pending
        assert stats.pinned == len(model.pins)
        assert stats.ready == len(model.state) - num_pending - len(model.pins)
        assert stats.ready == len(model.candidates()) == len(m.policy)
        assert (stats.hits, stats.misses, stats.loads) == (model.hits, model.misses, model.loads)
        assert (stats.stores, stats.failed_stores) == (model.stores, model.failed)
        assert (stats.stores_skipped, stats.evictions) == (model.skipped, model.evictions)
        assert stats.stores_no_room == model.no_room
    take()
    assert view == set(model.candidates()) | set(model.pins)


@pytest.mark.parametrize("seed", range(6))
def test_manager_agrees_with_a_model_of_the_tier(policy_name: str, seed: int) -> None:
    run(policy_name, seed, 1500)
