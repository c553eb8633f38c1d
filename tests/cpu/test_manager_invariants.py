"""Property tests of the manager contract (DESIGN §2) for every registered cache policy."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from helpers import key
from kvtier.base import LookupResult, OffloadKey, ReqContext
from kvtier.cpu import CPUOffloadingManager
from kvtier.policies import registered_policies

NUM_SLOTS = 6
UNIVERSE = [key(i) for i in range(16)]


class ManagerMachine(RuleBasedStateMachine):
    """Drives the manager with random calls and checks it against a simple model."""

    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.m = CPUOffloadingManager(NUM_SLOTS, self.policy, enable_events=True, store_threshold=0)
        self.pending: list[list[OffloadKey]] = []  # store jobs in flight
        self.loads: list[list[OffloadKey]] = []  # load jobs in flight
        self.ready: set[OffloadKey] = set()
        self.pins: dict[OffloadKey, int] = {}
        self.announced: set[OffloadKey] = set()  # replay of the public events
        self.quarantined = 0
        self.req = 0

    def ctx(self) -> ReqContext:
        return ReqContext(f"r{self.req}")

    @initialize()
    def start(self) -> None:
        self.req = 0

    @rule(data=st.data())
    def store(self, data: st.DataObject) -> None:
        offer = data.draw(st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=4, unique=True))
        pending = {k for job in self.pending for k in job}
        out = self.m.prepare_store(offer, self.ctx())
        if out is None:
            return
        for victim in out.evicted_keys:
            assert victim in self.ready, "evicted a key that was not ready"
            assert self.pins.get(victim, 0) == 0, "evicted a pinned key"
            assert victim not in offer, "evicted a key of the call itself"
            self.ready.discard(victim)
        assert not set(out.keys_to_store) & (self.ready | pending)
        if out.keys_to_store:
            self.pending.append(out.keys_to_store)

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), success=st.booleans())
    def finish_store(self, data: st.DataObject, success: bool) -> None:
        job = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
        self.m.complete_store(job, self.ctx(), success=success)
        if success:
            self.ready.update(job)
        for k in job:
            expected = LookupResult.HIT if success else LookupResult.MISS
            assert self.m.lookup(k, self.ctx()) is expected

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        job = data.draw(
            st.lists(st.sampled_from(sorted(self.ready)), min_size=1, max_size=3, unique=True)
        )
        self.m.prepare_load(job, self.ctx())
        for k in job:
            self.pins[k] = self.pins.get(k, 0) + 1
        self.loads.append(job)

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def finish_load(self, data: st.DataObject) -> None:
        job = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        self.m.complete_load(job, self.ctx())
        for k in job:
            self.pins[k] -= 1

    @rule(k=st.sampled_from(UNIVERSE))
    def touch(self, k: OffloadKey) -> None:
        self.m.touch([k], self.ctx())

    @rule()
    def next_request(self) -> None:
        self.m.on_request_finished(self.ctx())
        self.req += 1
        self.m.on_new_request(self.ctx())

    @rule()
    def reset(self) -> None:
        pinned = {k for job in self.loads for k in job}
        self.quarantined += len(pinned) + sum(len(j) for j in self.pending)
        self.m.reset_cache()
        # Jobs in flight at a reset are flushed by the connector, never completed here.
        self.pending.clear()
        self.loads.clear()
        self.ready.clear()
        self.pins.clear()

    @rule()
    def flush(self) -> None:
        self.m.on_reset_flushed()
        self.quarantined = 0

    @invariant()
    def events_replay_to_ready_set(self) -> None:
        for event in self.m.take_events():
            if event.removed:
                assert set(event.keys) <= self.announced
                self.announced.difference_update(event.keys)
            else:
                assert not set(event.keys) & self.announced
                self.announced.update(event.keys)
        assert self.announced == self.ready

    @invariant()
    def counts_match_model(self) -> None:
        stats = self.m.get_stats()
        num_pending = sum(len(j) for j in self.pending)
        assert stats.pending_writes == num_pending
        assert stats.pinned == sum(1 for n in self.pins.values() if n > 0)
        assert stats.ready == len(self.ready) - stats.pinned
        assert stats.used_slots == len(self.ready) + num_pending + self.quarantined
        assert stats.used_slots <= NUM_SLOTS
        assert len(self.m.policy) == stats.ready
        live_slots = list(self.m._slot_of.values())
        assert len(set(live_slots)) == len(live_slots)


@pytest.mark.parametrize("policy", sorted(registered_policies()))
def test_manager_contract(policy: str) -> None:
    machine = type(f"ManagerMachine_{policy}", (ManagerMachine,), {"policy": policy})
    # What machine.TestCase().runTest() does, with these settings in place of its own.
    run_state_machine_as_test(
        machine, settings=settings(max_examples=60, stateful_step_count=40, deadline=None)
    )


@pytest.mark.parametrize("policy", sorted(registered_policies()))
def test_tables_stay_bounded_over_100k_operations(policy: str) -> None:
    rng = random.Random(1234)
    num_slots, max_tracker = 64, 256
    m = CPUOffloadingManager(
        num_slots,
        policy,
        store_threshold=2,
        max_tracker_size=max_tracker,
        enable_events=True,
        max_pending_events=1000,
    )
    universe = [key(i) for i in range(4000)]
    loads: list[list[OffloadKey]] = []
    fixed: dict[str, int] = {}
    ops = 0
    req = 0
    while ops < 100_000:
        req += 1
        ctx = ReqContext(f"r{req}")
        m.on_new_request(ctx)
        start = int(rng.paretovariate(1.2)) % 3000
        chain = universe[start : start + rng.randint(1, 12)]
        ctx.key_positions.update({k: 16 * (i + 1) for i, k in enumerate(chain)})
        hits = []
        for k in chain:
            ops += 1
            if m.lookup(k, ctx) is not LookupResult.HIT:
                break
            hits.append(k)
        if hits:
            m.touch(hits, ctx)
            m.prepare_load(hits, ctx)
            loads.append(hits)
        out = m.prepare_store(chain[len(hits) :], ctx)
        if out is not None and out.keys_to_store:
            m.complete_store(out.keys_to_store, ctx, success=rng.random() > 0.1)
        while len(loads) > 3:
            m.complete_load(loads.pop(0), ctx)
        if rng.random() < 0.001:
            for job in loads:
                m.complete_load(job, ctx)
            loads.clear()
            m.reset_cache()
            m.on_reset_flushed()
        m.on_request_finished(ctx)
        ops += 6
        sizes = m.table_sizes()
        assert sizes["slot_of"] <= num_slots
        assert sizes["admission.tracker"] <= max_tracker
        assert sizes["events"] <= 1000
        for name, size in sizes.items():
            if "sketch" in name:
                # A frequency sketch is allocated once at a fixed size; it must never grow.
                assert size == fixed.setdefault(name, size), f"{policy}: {name} grew to {size}"
            elif name.startswith("policy."):
                assert size <= 2 * num_slots, f"{policy}: {name}={size} exceeds 2x capacity"
    for job in loads:
        m.complete_load(job, ReqContext("end"))
    assert m.get_stats().pinned == 0
