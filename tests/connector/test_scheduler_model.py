"""Model-based fault fuzz of the connector's scheduler half over the real CPU manager.

Seeded random engines drive `OffloadingScheduler` as an engine's step loop does: requests that
share prefixes arrive, hit the device prefix cache and the host tier, load asynchronously,
prefill in chunks, decode, get preempted and resumed, finish or abort, and the cache is reset,
while 1-4 simulated workers run each step's jobs, fail some on some workers only, and report
them late, out of order, twice (refused), or never. A host tier of a few slots keeps evicting.

An independent model follows what every device block and every host slot of every worker
really holds (a copy happens when a worker runs the job, which it does as late as allowed), and
which jobs each worker has fenced (waited for, or reported). After every call it checks that:

- a planned load reads host slots that hold, on every worker, the KV of the blocks it claims;
  a chunk the manager calls ready holds its KV on every worker; the forward pass only ever
  reads blocks with the right KV;
- no job touches a device block that another job or the forward pass writes, and no job
  touches a host slot that another unfinished job writes, unless a fence (the step's
  `wait_for`, or every report) ordered them;
- a job completes only once every worker reported it, and succeeds only if all succeeded;
  a duplicate report, or one of a job no worker was sent yet, is refused and changes nothing;
- offers, pins, pending writes, events (`stored` only after success on every worker), store
  and failure counters, bytes and the finished-request sets are exactly what the model
  implies, and after the last request ends nothing is left (or exactly what lost reports hold).
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvtier.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    TransferResult,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from kvtier.connector import (
    FinishedRequests,
    JobKind,
    OffloadingScheduler,
    StepMetadata,
    StepProgress,
    TransferJob,
)
from kvtier.cpu import CPUOffloadingManager
from kvtier.policies import registered_policies

TPB = 2  # tokens per block: blocks fill, and chunks complete, within a few steps
GARBAGE = "garbage"  # what a failed copy leaves behind
STEPS = 40
SEEDS_PER_BATCH = 80
BATCHES = 4
POLICIES = sorted(registered_policies())


def chain(name: str, n: int, head: list[bytes]) -> list[bytes]:
    """Chained block hashes: `head` followed by `n` blocks named `name`."""
    out = list(head)
    for i in range(n):
        parent = out[-1] if out else b"root"
        out.append(hashlib.sha256(parent + f"{name}.{i}".encode()).digest())
    return out


@dataclass(eq=False)
class Job:
    """The model's record of one job: what it copies, and where each worker stands with it."""

    spec: TransferJob  # before it is sent: what the model expects it to be, without slots
    gi: int  # KV-cache group index
    keys: list[OffloadKey]
    generation: int  # cache resets before it was created
    batch: int  # the call that created it: a load's set is its request's only one
    first_block: int  # index in its request's block table of device_blocks[0]
    sent: bool = False
    released: bool = False  # its request was preempted after it was sent: blocks given back
    submitted: set[int] = field(default_factory=set)
    executed: set[int] = field(default_factory=set)
    fenced: set[int] = field(default_factory=set)  # waited for, or reported, by the worker
    reported: set[int] = field(default_factory=set)
    ok: dict[int, bool] = field(default_factory=dict)
    queued: dict[int, TransferResult] = field(default_factory=dict)  # not yet delivered
    lost: set[int] = field(default_factory=set)  # reports never delivered
    bytes: int = 0  # reported by workers that succeeded
    seconds: float = 0.0  # their copy time

    @property
    def load(self) -> bool:
        return self.spec.kind is JobKind.LOAD

    @property
    def blocks(self) -> list[int]:
        return [int(b) for b in self.spec.device_blocks]

    @property
    def slots(self) -> list[int]:
        return [int(s) for s in self.spec.slots]


@dataclass(eq=False)
class Req:
    """One engine request. `hashes` is the list the scheduler reads; decode extends it."""

    rid: str
    hashes: list[bytes]
    num_prompt: int
    max_new: int
    num_tokens: int
    state: str = "waiting"  # waiting | allocated | loading | running | finished
    blocks: list[list[int]] = field(default_factory=list)  # per group
    num_computed: int = 0
    step_tokens: int = 0
    load: tuple[int, int] | None = None  # (first token, tokens) of the load awaited
    offer: tuple[int, int, int] | None = None  # (device hit, offered, generation), unallocated
    load_failed: bool = False  # its last load failed (reported in `failed_loads`)
    offers_stopped: bool = False  # a load failed, no preemption since: offered nothing
    held: bool = False  # finished with jobs in flight: blocks held until `sending`
    tracked: bool = True  # the scheduler still keeps state for it

    @property
    def generated_all(self) -> bool:
        """Sampled its last token (at least one: the prefill must run)."""
        return self.num_tokens - self.num_prompt >= max(1, self.max_new)


class Fuzz:
    """One seeded engine, its simulated workers, and the model that checks the scheduler."""

    def __init__(self, seed: int, stats: Counter[str], proof: int = 0) -> None:
        rng = self.rng = random.Random(seed)
        self.stats = stats
        self.groups = rng.choice([(0,), (0,), (0, 1), (3, 1)])
        self.G = len(self.groups)
        self.W = rng.randint(1, 4)
        self.named = self.W == 1 or rng.random() < 0.8  # without names: fewer refusals
        self.bpc = rng.choice([1, 2, 2, 3])
        self.tpc = TPB * self.bpc
        self.m = CPUOffloadingManager(
            rng.randint(2, 12),
            rng.choice(POLICIES),
            store_threshold=rng.choice([0, 0, 0, 2]),
            enable_events=True,
        )
        self.prompt_only = rng.random() < 0.3
        self.proof = proof
        self.s = OffloadingScheduler(
            self.m,
            tokens_per_block=TPB,
            blocks_per_chunk=self.bpc,
            groups=self.groups,
            num_workers=self.W,
            offload_prompt_only=self.prompt_only,
            proof_chunks=self.proof,
        )
        self.p_fail = rng.choice([0.0, 0.05, 0.2])
        self.p_lost = rng.choice([0.0, 0.0, 0.0, 0.0, 0.03])
        self.p_dup = rng.choice([0.0, 0.15])
        self.p_reset = rng.choice([0.0, 0.03])
        self.p_preempt = rng.choice([0.0, 0.1])
        self.p_defer = rng.choice([0.0, 0.3])
        self.device_cache = rng.random() < 0.5
        nblocks = rng.randint(8, 24)
        self.free = [list(range(nblocks)) for _ in self.groups]  # reuse the oldest first
        self.ref = [[0] * nblocks for _ in self.groups]
        self.cached: list[dict[bytes, int]] = [{} for _ in self.groups]
        self.cached_as: list[dict[int, bytes]] = [{} for _ in self.groups]
        self.dev: list[list[list[object]]] = [
            [[None] * nblocks for _ in self.groups] for _ in range(self.W)
        ]
        self.host: list[dict[int, object]] = [{} for _ in range(self.W)]
        self.reqs: dict[str, Req] = {}
        self.jobs: dict[int, Job] = {}  # created, neither cancelled nor reported by all
        self.gone: list[int] = []  # some ids of jobs cancelled or completed
        self.last_id = 0
        self.generation = 0
        self.batches = 0
        self.announced: set[OffloadKey] = set()  # stored and not removed, per the events
        self.chunk_of: dict[bytes, tuple[bytes, ...]] = {}  # a chunk's last hash -> its hashes
        self.expect_wait: set[int] = set()
        self.expect_done = FinishedRequests()
        # Blocks of loads failed at allocation, reported by the next take_finished unless the
        # request gives them back first (preempted or finished).
        self.alloc_failed: dict[str, list[int]] = {}
        # The same for loads whose jobs failed, once reported by the workers.
        self.job_failed: dict[str, list[int]] = {}
        self.bytes = {JobKind.LOAD: 0, JobKind.STORE: 0}
        self.seconds = {JobKind.LOAD: 0.0, JobKind.STORE: 0.0}
        self.failed = {JobKind.LOAD: 0, JobKind.STORE: 0}  # jobs; a load gone at alloc: G
        self.next_rid = 0
        self.prefixes = [chain(f"p{i}", rng.randint(2, 8), []) for i in range(3)]
        # Some engines take reports only every few steps: their own stream, so the draws
        # above and every seed without late takes stay as they were.
        self.late = random.Random(seed ^ 0x5EED)
        self.p_late_take = self.late.choice([0.0, 0.5, 0.8])
        if proof:
            self.p_late_take = 0.0  # held-back offers would starve its rarer situations

    # -- the model's view of the scheduler -------------------------------------------------

    def done(self, j: Job) -> bool:
        return len(j.reported) == self.W

    def incomplete(self, rid: str | None = None) -> list[Job]:
        if rid is None:
            return list(self.jobs.values())
        return [j for j in self.jobs.values() if j.spec.req_id == rid]

    def forget(self, j: Job) -> None:
        del self.jobs[j.spec.job_id]
        self.gone = [*self.gone[-15:], j.spec.job_id]

    def pending_keys(self) -> set[OffloadKey]:
        return {
            k
            for j in self.incomplete()
            if not j.load and j.generation == self.generation
            for k in j.keys
        }

    def pinned_keys(self) -> set[OffloadKey]:
        return {
            k
            for j in self.incomplete()
            if j.load and j.generation == self.generation
            for k in j.keys
        }

    def key(self, r: Req, chunk: int, gi: int) -> OffloadKey:
        return make_offload_key(r.hashes[(chunk + 1) * self.bpc - 1], self.groups[gi])

    def chunk_content(self, key: OffloadKey) -> tuple[object, ...]:
        """The bytes a slot holding `key` must hold: each block's (group index, hash)."""
        gi = self.groups.index(get_offload_group_idx(key))
        return tuple((gi, h) for h in self.chunk_of[get_offload_block_hash(key)])

    def note_chunks(self, r: Req) -> None:
        for c in range(len(r.hashes) // self.bpc):
            chunk = r.hashes[c * self.bpc : (c + 1) * self.bpc]
            self.chunk_of.setdefault(chunk[-1], tuple(chunk))

    def expected_offer(self, r: Req, hit: int) -> int | None:
        """What get_num_new_matched_tokens must answer (docs/connector.md, the lookup rules)."""
        if self.incomplete(r.rid):
            return None
        if r.offers_stopped or r.rid in self.expect_done.recving:
            # An untaken report of a load (failed or not) holds back any new offer: the
            # engine would read it as the report of the load planned now.
            if not r.offers_stopped and not r.load_failed:
                self.stats["held back for an untaken report"] += 1
            return 0
        first = hit // self.tpc
        num_chunks = len(r.hashes) // self.bpc
        last = min(num_chunks, (r.num_prompt - 1) // self.tpc)
        pending = self.pending_keys()
        # With proof chunks, a chunk is offered only if the next `proof` chunks hit too; they
        # are looked up (and may answer "ask again") only if some chunk could be loaded.
        stop = min(last + self.proof, num_chunks) if first < last else 0
        end = first
        for c in range(first, stop):
            keys = [self.key(r, c, gi) for gi in range(self.G)]
            missing = next((k for k in keys if k not in self.announced), None)
            if missing is not None:
                if missing in pending:
                    return None  # the first group that does not hit is still being written
                break
            end = c + 1
        if self.proof:
            proven = max(first, min(end - self.proof, last))
            if proven < min(end, last):
                self.stats["offer cut by proof"] += 1
            end = proven
        if r.load_failed and end * self.tpc > hit:
            self.stats["offered again after a failed load"] += 1
        return max(0, end * self.tpc - hit)

    def sync_events(
        self, stored: set[OffloadKey] | None = None, reset: bool = False, step: bool = False
    ) -> int:
        """Replay the manager's new events on `announced`; returns how many keys it evicted."""
        before = set(self.announced)
        got_stored: set[OffloadKey] = set()
        removed: list[OffloadKey] = []
        for ev in self.m.take_events():
            for k in ev.keys:
                if ev.removed:
                    assert k in self.announced, f"removed {k.hex()} that was never stored"
                    self.announced.discard(k)
                    removed.append(k)
                else:
                    assert k not in self.announced, f"stored {k.hex()} twice without removal"
                    self.announced.add(k)
                    got_stored.add(k)
        assert got_stored == (stored or set()), "stored events differ from stores done"
        if reset:
            assert set(removed) == before and not self.announced
        elif removed:
            assert step, "keys removed outside of store planning or a reset"
            pinned = self.pinned_keys() & set(removed)
            assert not pinned, f"evicted pinned keys {[k.hex() for k in pinned]}"
        return len(removed)

    def check_state(self) -> None:
        """Jobs, requests, pins, pending writes, slot contents and bytes agree with the model."""
        s, m = self.s, self.m
        assert set(s.job_ids_in_flight()) == {j.spec.job_id for j in self.incomplete()}
        assert s.num_requests() == sum(r.tracked for r in self.reqs.values())
        st = m.get_stats()
        pinned, pending = self.pinned_keys(), self.pending_keys()
        assert (st.pinned, st.pending_writes) == (len(pinned), len(pending))
        assert pinned <= self.announced
        assert st.ready == len(self.announced) - len(pinned)
        # Slot accounting: every slot is fresh, free, quarantined or holds a key, exactly once.
        sizes = m.table_sizes()
        assert len(self.announced) + len(pending) == sizes["slot_of"]
        unused = m.num_slots - m._next_fresh
        assert sizes["free"] + sizes["quarantined"] + sizes["slot_of"] + unused == m.num_slots
        if not any(j.generation != self.generation for j in self.incomplete()):
            assert st.used_slots == len(self.announced) + len(pending), "slots left quarantined"
        ctx = ReqContext("probe")
        for k in self.announced:
            assert m.lookup(k, ctx) is LookupResult.HIT
            slot = m._slot_of[k]  # the manager's own record: the slot must really hold k
            for w in range(self.W):
                assert self.host[w].get(slot) == self.chunk_content(k), (
                    f"ready key {k.hex()} in slot {slot}: worker {w} holds {self.host[w].get(slot)}"
                )
        assert (s.bytes_loaded, s.bytes_stored) == (
            self.bytes[JobKind.LOAD],
            self.bytes[JobKind.STORE],
        )
        assert (s.load_seconds, s.store_seconds) == (
            self.seconds[JobKind.LOAD],
            self.seconds[JobKind.STORE],
        )
        assert (s.load_jobs_failed, s.store_jobs_failed) == (
            self.failed[JobKind.LOAD],
            self.failed[JobKind.STORE],
        )

    # -- hazards: what runs concurrently on a worker -----------------------------------------

    def check_device(
        self, w: int, gi: int, blocks: list[int], writes: bool, what: str, me: Job | None = None
    ) -> None:
        """`what` reads (or writes) `blocks` on worker `w`: no unfenced job may write them (or
        touch them at all)."""
        mine = set(blocks)
        for j in self.jobs.values():
            if j is me or j.gi != gi or w not in j.submitted or w in j.fenced:
                continue
            if (writes or j.load) and mine & set(j.blocks):
                raise AssertionError(
                    f"{what} uses device blocks {sorted(mine & set(j.blocks))} (group {gi}) on "
                    f"worker {w} while {j.spec.kind.value} job {j.spec.job_id} of "
                    f"{j.spec.req_id} may still copy them"
                )

    def check_slots(self, job: Job) -> None:
        """A sent job's host slots: no unfinished job writes them, and a store writes slots
        that no unfinished job reads."""
        mine = set(job.slots)
        for j in self.jobs.values():
            if j is job or not j.sent:
                continue
            if (not job.load or not j.load) and mine & set(j.slots):
                raise AssertionError(
                    f"{job.spec.kind.value} job {job.spec.job_id} uses slots "
                    f"{sorted(mine & set(j.slots))} of unfinished {j.spec.kind.value} job "
                    f"{j.spec.job_id}"
                )

    # -- simulated workers ---------------------------------------------------------------------

    def execute(self, w: int, j: Job) -> None:
        """Worker `w` copies `j` now; a failure leaves garbage where it wrote."""
        rng, dev, host, bpc = self.rng, self.dev[w][j.gi], self.host[w], self.bpc
        ok = rng.random() >= self.p_fail
        j.executed.add(w)
        j.ok[w] = ok
        blocks, slots = j.blocks, j.slots
        if j.load:
            for i, b in enumerate(blocks):
                idx = j.spec.skip_blocks + i
                src = host.get(slots[idx // bpc])
                dev[b] = src[idx % bpc] if ok and isinstance(src, tuple) else GARBAGE
        else:
            for i, slot in enumerate(slots):
                chunk = blocks[i * bpc : (i + 1) * bpc]
                host[slot] = tuple(dev[b] for b in chunk) if ok else GARBAGE
        if rng.random() < self.p_lost:
            j.lost.add(w)
            self.stats["lost report"] += 1
        else:
            nbytes = 10 * len(blocks) + w if ok else rng.choice([0, 3])
            # Exact binary fractions, so that the sums do not depend on the order of additions;
            # a failed copy's time counts nowhere.
            seconds = nbytes / 4 if ok else 0.5
            j.queued[w] = TransferResult(j.spec.job_id, ok, nbytes, seconds)

    def run_workers(self, p_exec: float) -> None:
        for j in list(self.jobs.values()):
            for w in j.submitted - j.executed:
                if self.rng.random() < p_exec:
                    self.execute(w, j)

    def deliver(self, p_deliver: float) -> None:
        """Each worker reports some of its finished jobs, in batches, in random order."""
        rng = self.rng
        batches: list[tuple[int, list[TransferResult]]] = []
        for w in range(self.W):
            ready = [j.queued[w] for j in self.jobs.values() if w in j.queued]
            ready = [r for r in ready if rng.random() < p_deliver]
            rng.shuffle(ready)
            cut = rng.randint(0, len(ready))
            batches += [(w, ready[:cut]), (w, ready[cut:])]
        rng.shuffle(batches)
        for w, results in batches:
            if results or rng.random() < 0.2:
                self.report(w, results)

    def report(self, w: int, results: list[TransferResult]) -> None:
        s, rng = self.s, self.rng
        who = w if self.named else None
        if rng.random() < self.p_dup:
            bad = self.bad_report(w, results)
            if bad is not None:
                before = (
                    sorted(s.job_ids_in_flight()),
                    self.m.get_stats(),
                    s.num_requests(),
                    s.bytes_loaded,
                    s.bytes_stored,
                    s.load_seconds,
                    s.store_seconds,
                    s.load_jobs_failed,
                    s.store_jobs_failed,
                )
                batch = [*results, *bad]
                rng.shuffle(batch)
                with pytest.raises(ValueError, match=r"not in flight|already reported|times"):
                    s.on_worker_results(batch, worker=who)
                after = (
                    sorted(s.job_ids_in_flight()),
                    self.m.get_stats(),
                    s.num_requests(),
                    s.bytes_loaded,
                    s.bytes_stored,
                    s.load_seconds,
                    s.store_seconds,
                    s.load_jobs_failed,
                    s.store_jobs_failed,
                )
                assert after == before, "a refused batch changed the scheduler"
                self.sync_events()
                self.stats["duplicate refused"] += 1
        st = self.m.get_stats()
        s.on_worker_results(results, worker=who)
        stored: set[OffloadKey] = set()
        n_stored = n_failed = 0
        for r in results:  # the scheduler applies them in this order
            j = self.jobs[r.job_id]
            del j.queued[w]
            j.reported.add(w)
            j.fenced.add(w)
            if r.success:
                j.bytes += r.bytes
                j.seconds += r.seconds
            if not self.done(j):
                continue
            self.forget(j)
            self.on_complete(j)
            success = all(j.ok.values())
            if j.generation == self.generation and not j.load:
                if success:
                    stored.update(j.keys)
                    n_stored += len(j.keys)
                else:
                    n_failed += len(j.keys)
        self.sync_events(stored)
        st2 = self.m.get_stats()
        assert st2.stores - st.stores == n_stored
        assert st2.failed_stores - st.failed_stores == n_failed
        assert st2.evictions == st.evictions
        self.check_state()

    def bad_report(self, w: int, results: list[TransferResult]) -> list[TransferResult] | None:
        """A report the scheduler must refuse: a job not in flight, one reported by this worker
        already or twice in the batch, or more reports than workers."""
        rng = self.rng
        options: list[list[TransferResult]] = []
        if self.gone:
            options.append([TransferResult(rng.choice(self.gone), True)])
        live = [j for j in self.incomplete() if j.sent]
        unsent = [j for j in self.incomplete() if not j.sent]
        if unsent:  # planned, and no worker was sent it: it cannot have finished
            options.append([TransferResult(rng.choice(unsent).spec.job_id, True)])
        if self.named:
            again = [j for j in live if w in j.reported]
            if again:
                options.append([TransferResult(rng.choice(again).spec.job_id, True)])
            if results:
                options.append([rng.choice(results)])
        elif live:
            j = rng.choice(live)
            mine = sum(r.job_id == j.spec.job_id for r in results)
            left = self.W - len(j.reported) - mine
            options.append([TransferResult(j.spec.job_id, True)] * (left + 1))
        return rng.choice(options) if options else None

    def on_complete(self, j: Job) -> None:
        """Every worker reported `j`: what the scheduler must do about it."""
        kind = "load" if j.load else "store"
        success = all(j.ok.values())
        self.stats[f"{kind} {'ok' if success else 'failed'}"] += 1
        if success:
            self.bytes[j.spec.kind] += j.bytes
            self.seconds[j.spec.kind] += j.seconds
        else:
            self.failed[j.spec.kind] += 1
        if j.generation != self.generation:
            self.stats["job done after reset"] += 1
        r = self.reqs[j.spec.req_id]
        assert r.tracked
        done = self.expect_done
        if j.load and not success:
            r.load_failed = r.offers_stopped = True
            if not j.released:
                self.job_failed.setdefault(r.rid, []).extend(j.blocks)
            else:  # the blocks may be other requests' by now
                self.stats["preempted request's load failed"] += 1
        if self.incomplete(r.rid):
            return
        if j.load:
            done.recving.add(r.rid)
            if r.load_failed:
                done.failed_loads.add(r.rid)
        if r.state == "finished":
            assert r.held
            done.sending.add(r.rid)
            r.tracked = False

    def fail_unreported(self, who: int | None) -> None:
        """The workers that lost reports are declared gone: each report they owe is a failure."""
        st = self.m.get_stats()
        expect: list[int] = []
        n_failed = 0
        for j in self.incomplete():
            owed = j.lost - j.reported if who is None else j.lost & {who} - j.reported
            if not owed:
                continue
            for w in owed:
                j.reported.add(w)
                j.fenced.add(w)
                j.ok[w] = False
            if self.done(j):
                expect.append(j.spec.job_id)
                self.forget(j)
                self.on_complete(j)
                if j.generation == self.generation and not j.load:
                    n_failed += len(j.keys)
        assert sorted(self.s.fail_unreported(who)) == sorted(expect)
        self.sync_events()
        st2 = self.m.get_stats()
        assert (st2.stores, st2.failed_stores - st.failed_stores) == (st.stores, n_failed)
        self.check_state()

    # -- the engine's device blocks ----------------------------------------------------------

    def device_hit(self, r: Req) -> int:
        if not self.device_cache:
            return 0
        n, limit = 0, min(len(r.hashes), (r.num_tokens - 1) // TPB)
        while n < limit and all(r.hashes[n] in c for c in self.cached):
            n += 1
        return n * TPB

    def allocate(self, r: Req, hit: int, need: int) -> bool:
        """Give `r` its device-hit blocks and `need` blocks in all, or nothing."""
        hits = hit // TPB
        for gi in range(self.G):
            taken = sum(self.ref[gi][self.cached[gi][h]] == 0 for h in r.hashes[:hits])
            if len(self.free[gi]) - taken < need - hits:
                return False
        r.blocks = []
        for gi in range(self.G):
            blocks = [self.cached[gi][h] for h in r.hashes[:hits]]
            for i, b in enumerate(blocks):
                for w in range(self.W):
                    assert self.dev[w][gi][b] == (gi, r.hashes[i]), "device cache is stale"
                if self.ref[gi][b] == 0:
                    self.free[gi].remove(b)
                self.ref[gi][b] += 1
            r.blocks.append(blocks)
            while len(blocks) < need:
                blocks.append(self.new_block(gi))
        if hits:
            self.stats["device hit"] += 1
        return True

    def new_block(self, gi: int) -> int:
        b = self.free[gi].pop(0)
        h = self.cached_as[gi].pop(b, None)
        if h is not None:
            del self.cached[gi][h]
        self.ref[gi][b] = 1
        return b

    def release(self, r: Req) -> None:
        for gi, blocks in enumerate(r.blocks):
            for b in blocks:
                self.ref[gi][b] -= 1
                assert self.ref[gi][b] >= 0
                if self.ref[gi][b] == 0:
                    self.free[gi].append(b)
        r.blocks = []

    def cache_blocks(self, r: Req, end_block: int) -> None:
        for gi, blocks in enumerate(r.blocks):
            for i in range(end_block):
                h, b = r.hashes[i], blocks[i]
                if h not in self.cached[gi] and b not in self.cached_as[gi]:
                    self.cached[gi][h] = b
                    self.cached_as[gi][b] = h

    # -- engine operations -------------------------------------------------------------------

    def add_request(self) -> None:
        rng = self.rng
        prefix = rng.choice(self.prefixes)
        prefix = prefix[: rng.randint(0, len(prefix))]
        hashes = chain(f"s{rng.randint(0, 3)}", rng.randint(0, 3), prefix)
        extra = rng.randint(0 if hashes else 1, TPB - 1)
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        n = len(hashes) * TPB + extra
        r = Req(rid, hashes, n, rng.randint(0, 6), n)
        self.reqs[rid] = r
        self.note_chunks(r)
        self.s.add_request(rid, hashes, n)

    def admit(self, r: Req) -> None:
        hit = self.device_hit(r)
        expected = self.expected_offer(r, hit)
        n = self.s.get_num_new_matched_tokens(r.rid, hit)
        assert n == expected, f"offered {n} tokens to {r.rid}; the model expects {expected}"
        if n is None:
            return
        if not self.allocate(r, hit, -(-r.num_tokens // TPB)):
            return  # no room on the device: asked again next step
        r.offer, r.state = (hit, n, self.generation), "allocated"
        if n and self.rng.random() < 3 * self.p_reset:
            self.reset()  # between the offer and the allocation
        if n and self.rng.random() < self.p_defer:
            return  # update_state_after_alloc comes next step, after other requests' stores
        self.tell_alloc(r)

    def tell_alloc(self, r: Req) -> None:
        assert r.offer is not None
        hit, n, generation = r.offer
        before = set(self.s.job_ids_in_flight())
        self.s.update_state_after_alloc(r.rid, r.blocks, n)
        new = sorted(set(self.s.job_ids_in_flight()) - before)
        r.offer, r.num_computed = None, hit
        if n == 0:
            assert not new
            r.state = "running"
            return
        r.state, r.load = "loading", (hit, n)
        r.load_failed = False
        first_block, end_block = hit // TPB, (hit + n) // TPB
        first_chunk, end_chunk = hit // self.tpc, (hit + n) // self.tpc
        keys = [[self.key(r, c, gi) for c in range(first_chunk, end_chunk)] for gi in range(self.G)]
        if generation != self.generation or not all(
            k in self.announced for g_keys in keys for k in g_keys
        ):
            # Reset or evicted since offered: failed at once, nothing pinned.
            assert not new, "a load of chunks gone since the offer was planned"
            r.load_failed = r.offers_stopped = True
            self.expect_done.recving.add(r.rid)
            self.expect_done.failed_loads.add(r.rid)
            self.alloc_failed[r.rid] = [b for bs in r.blocks for b in bs[first_block:end_block]]
            self.stats["offer gone at alloc"] += 1
            self.failed[JobKind.LOAD] += self.G  # one per group, as the counter's doc says
            return
        assert len(new) == self.G
        self.batches += 1
        if self.G > 1:
            self.stats["load of several groups"] += 1
        if first_block % self.bpc:
            self.stats["load from mid chunk"] += 1
        assert new[0] > self.last_id
        self.last_id = new[-1]
        for gi, job_id in enumerate(new):
            spec = TransferJob(
                job_id,
                JobKind.LOAD,
                r.rid,
                self.groups[gi],
                np.zeros(0, np.int64),
                np.asarray(r.blocks[gi][first_block:end_block], np.int64),
                first_block - first_chunk * self.bpc,
            )
            self.jobs[job_id] = Job(spec, gi, keys[gi], self.generation, self.batches, first_block)

    def cancel_unsent(self, r: Req) -> None:
        for j in self.incomplete(r.rid):
            if not j.sent:
                self.forget(j)

    def finish(self, r: Req) -> None:
        self.cancel_unsent(r)
        expect_held = bool(self.incomplete(r.rid))
        # Held, the blocks stay the request's until `sending`: a failure is still reported.
        if not expect_held and self.alloc_failed.pop(r.rid, None) is not None:
            self.stats["gave back the blocks of a load failed at alloc"] += 1
        if not expect_held and self.job_failed.pop(r.rid, None) is not None:
            self.stats["gave back the blocks of an untaken failed load"] += 1
        held = self.s.request_finished(r.rid)
        assert held == expect_held, f"request_finished({r.rid}) returned {held}"
        self.sync_events()
        if held:
            r.held = True
            self.stats["finished with jobs in flight"] += 1
        else:
            self.release(r)
            r.tracked = False
        r.state = "finished"

    def preempt(self, r: Req) -> None:
        unsent = [j for j in self.incomplete(r.rid) if not j.sent]
        self.cancel_unsent(r)
        self.s.request_preempted(r.rid)
        r.offers_stopped = False
        if r.load_failed:
            self.stats["preempted after a failed load"] += 1
        if self.alloc_failed.pop(r.rid, None) is not None:
            self.stats["gave back the blocks of a load failed at alloc"] += 1
        if self.job_failed.pop(r.rid, None) is not None:
            self.stats["gave back the blocks of an untaken failed load"] += 1
        in_flight = self.incomplete(r.rid)
        for j in in_flight:
            j.released = True
        self.expect_wait |= {j.spec.job_id for j in in_flight}
        if in_flight:
            kind = "load" if in_flight[0].load else "store"
            self.stats[f"preempted with a {kind} in flight"] += 1
        if unsent:
            self.stats["preempted before its load was sent"] += 1
        self.release(r)
        r.state, r.num_computed, r.load, r.step_tokens = "waiting", 0, None, 0

    def reset(self) -> None:
        if self.incomplete():
            self.stats["reset with jobs in flight"] += 1
        self.s.reset_cache()
        self.generation += 1
        self.sync_events(reset=True)

    def schedule(self) -> None:
        """The engine's scheduling pass: everything that happens before build_step_metadata."""
        rng = self.rng
        if rng.random() < self.p_reset:
            self.reset()
        for r in list(self.reqs.values()):
            if r.state == "finished":
                continue
            if (r.state == "running" and r.generated_all) or rng.random() < 0.04:
                self.finish(r)
            elif r.state in ("running", "loading") and rng.random() < self.p_preempt:
                self.preempt(r)
        for r in self.reqs.values():
            if r.state == "allocated":
                self.tell_alloc(r)
        if rng.random() < 0.5:
            self.add_request()
        for r in list(self.reqs.values()):
            if r.state == "waiting":
                self.admit(r)
        if rng.random() < 0.3:
            # Reports of earlier steps processed after this pass planned its loads (vLLM's
            # asynchronous scheduling): they may name anything but a job not sent yet.
            self.run_workers(0.5)
            self.deliver(0.6)
            self.take_finished()
        running = [r for r in self.reqs.values() if r.state == "running"]
        rng.shuffle(running)
        for r in running:
            if r.state != "running":
                continue  # preempted for another request's block
            left = r.num_tokens - r.num_computed
            k = rng.randint(1, left) if rng.random() < 0.5 else left
            need = -(-(r.num_computed + k) // TPB)
            while r.state == "running" and len(r.blocks[0]) < need:
                if all(self.free):
                    for gi in range(self.G):
                        r.blocks[gi].append(self.new_block(gi))
                else:  # out of device blocks: preempt someone, maybe r itself
                    victims = [q for q in self.reqs.values() if q.state in ("running", "loading")]
                    self.preempt(rng.choice(victims))
            r.step_tokens = k if r.state == "running" else 0
        # Late in the pass, after admissions: cancels loads planned but not yet sent, or gives
        # back the blocks of a load failed at allocation before take_finished reports them.
        busy = [r for r in self.reqs.values() if r.state in ("running", "loading", "allocated")]
        preferred = [
            r
            for r in busy
            if r.rid in self.alloc_failed or any(not j.sent for j in self.incomplete(r.rid))
        ]
        # More often while a load failed at allocation awaits its report: rare, and the
        # give-back before take_finished is the case to reach.
        odds = 0.5 if any(r.rid in self.alloc_failed for r in busy) else 0.15
        if busy and rng.random() < odds:
            r = rng.choice(preferred if preferred and rng.random() < 0.7 else busy)
            if r.state != "allocated" and rng.random() < 0.5:
                self.preempt(r)
            else:
                self.finish(r)

    def build(self) -> StepMetadata:
        s, m = self.s, self.m
        running = [r for r in self.reqs.values() if r.state == "running"]
        progress = []
        for r in running:
            progress.append(StepProgress(r.rid, r.blocks, r.num_computed + r.step_tokens))
        # A request may store beside its stores in flight, not beside a load, nor beside jobs
        # sent before a preemption (they may read blocks given to others since).
        busy = {r.rid for r in running if any(j.load or j.released for j in self.incomplete(r.rid))}
        storing = {r.rid for r in running if self.incomplete(r.rid)} - busy
        pending_before = self.pending_keys()
        evictions = m.get_stats().evictions
        meta = s.build_step_metadata(progress)
        evicted = self.sync_events(step=True)
        assert m.get_stats().evictions - evictions == evicted
        if evicted:
            self.stats["eviction"] += 1
        assert set(meta.wait_for) == self.expect_wait, "wait_for misses a preempted job"
        self.expect_wait = set()
        unsent = {j.spec.job_id: j for j in self.incomplete() if not j.sent}
        assert {t.job_id for t in meta.loads} == set(unsent), "loads sent differ from planned"
        for t in meta.loads:
            j = unsent[t.job_id]
            e = j.spec
            assert (t.kind, t.req_id, t.group, t.skip_blocks) == (
                e.kind,
                e.req_id,
                e.group,
                e.skip_blocks,
            )
            assert t.device_blocks.tolist() == e.device_blocks.tolist()
            assert len(t.slots) == len(j.keys)
            j.spec, j.sent = t, True
        progress_of = {p.req_id: p.num_computed_tokens for p in progress}
        batch_of: dict[str, int] = {}
        pending = set(pending_before)
        for t in meta.stores:
            assert t.kind is JobKind.STORE and t.job_id > self.last_id
            self.last_id = t.job_id
            r = self.reqs[t.req_id]
            assert r.state == "running" and r.rid not in busy, "stores of a busy request"
            if r.rid in storing:
                self.stats["stores beside stores in flight"] += 1
            gi = self.groups.index(t.group)
            cap = progress_of[r.rid]
            if self.prompt_only:
                cap = min(cap, r.num_prompt)
            if self.proof and cap > r.num_prompt:
                # Decoding: a drafter's last `proof` computed chunks are not final yet.
                cap -= self.proof * self.tpc
                self.stats["decoding store with proof chunks"] += 1
            blocks = t.device_blocks.tolist()
            assert len(blocks) == len(t.slots) * self.bpc
            keys = []
            first = r.blocks[gi].index(blocks[0])
            for i in range(len(t.slots)):
                chunk = blocks[i * self.bpc : (i + 1) * self.bpc]
                idx = r.blocks[gi].index(chunk[0])
                assert idx % self.bpc == 0 and r.blocks[gi][idx : idx + self.bpc] == chunk
                c = idx // self.bpc
                assert (c + 1) * self.tpc <= cap, f"store of chunk {c} not computed yet"
                k = self.key(r, c, gi)
                assert k not in self.announced and k not in pending, f"{k.hex()} stored twice"
                pending.add(k)
                keys.append(k)
            if r.rid not in batch_of:
                self.batches += 1
                batch_of[r.rid] = self.batches
            j = Job(t, gi, keys, self.generation, batch_of[r.rid], first, sent=True)
            self.jobs[t.job_id] = j
        for j in self.incomplete():
            mine = self.incomplete(j.spec.req_id)
            if j.load:
                assert {k.batch for k in mine} == {j.batch}, "jobs beside a load"
            if j.released:
                assert all(k.released for k in mine), "jobs beside a preemption's"
        for t in [*meta.loads, *meta.stores]:
            self.check_slots(self.jobs[t.job_id])
        for t in meta.loads:
            self.check_load_source(self.jobs[t.job_id])
        self.check_state()
        return meta

    def check_load_source(self, j: Job) -> None:
        """The slots a load reads hold, on every worker, the KV of the blocks it fills."""
        r = self.reqs[j.spec.req_id]
        slots = j.slots
        for i in range(len(j.blocks)):
            idx = j.spec.skip_blocks + i
            want = (j.gi, r.hashes[j.first_block + i])
            for w in range(self.W):
                src = self.host[w].get(slots[idx // self.bpc])
                got = src[idx % self.bpc] if isinstance(src, tuple) else src
                assert got == want, (
                    f"load job {j.spec.job_id} of {r.rid} reads slot {slots[idx // self.bpc]} "
                    f"for block {j.first_block + i}: worker {w} holds {got}, not {want}"
                )

    def run_step(self, meta: StepMetadata) -> None:
        """The workers' and the model's side of one step, after its metadata was built."""
        for w in range(self.W):
            for job_id in meta.wait_for:
                j = self.jobs.get(job_id)
                if j is None:
                    continue  # every worker reported it since the preemption
                if w not in j.executed:
                    self.execute(w, j)
                j.fenced.add(w)
            for t in meta.loads:
                j = self.jobs[t.job_id]
                self.check_device(w, j.gi, j.blocks, True, f"load job {t.job_id}", j)
                j.submitted.add(w)
        self.forward()
        for w in range(self.W):
            for t in meta.stores:
                j = self.jobs[t.job_id]
                self.check_device(w, j.gi, j.blocks, False, f"store job {t.job_id}", j)
                j.submitted.add(w)
        self.run_workers(0.5)
        self.deliver(0.6)
        if not self.p_late_take or self.late.random() >= self.p_late_take:
            self.take_finished()

    def forward(self) -> None:
        """Compute each running request's scheduled tokens: read its prefix, write its blocks."""
        for r in self.reqs.values():
            if r.state != "running" or not r.step_tokens:
                continue
            start, end = r.num_computed, r.num_computed + r.step_tokens
            for gi, blocks in enumerate(r.blocks):
                used, written = blocks[: -(-end // TPB)], blocks[start // TPB : -(-end // TPB)]
                for w in range(self.W):
                    self.check_device(w, gi, used, False, f"forward pass of {r.rid}")
                    self.check_device(w, gi, written, True, f"forward pass of {r.rid}")
                    dev = self.dev[w][gi]
                    for i in range(start // TPB):
                        assert dev[blocks[i]] == (gi, r.hashes[i]), (
                            f"{r.rid} reads block {i} (device block {blocks[i]}, group {gi}) on "
                            f"worker {w}: {dev[blocks[i]]}"
                        )
                    for i in range(start // TPB, -(-end // TPB)):
                        full = (i + 1) * TPB <= end
                        dev[blocks[i]] = (gi, r.hashes[i]) if full else (gi, r.rid, i)
            r.num_computed, r.step_tokens = end, 0
            self.cache_blocks(r, end // TPB)
            if end == r.num_tokens:  # sample the next token
                r.num_tokens += 1
                while len(r.hashes) < r.num_tokens // TPB:
                    salt = f"{r.rid}.{len(r.hashes)}".encode()
                    parent = r.hashes[-1] if r.hashes else b"root"
                    r.hashes.append(hashlib.sha256(parent + salt).digest())
                self.note_chunks(r)

    def take_finished(self) -> None:
        done = self.s.take_finished()
        want, self.expect_done = self.expect_done, FinishedRequests()
        for blocks in (*self.alloc_failed.values(), *self.job_failed.values()):
            want.failed_load_blocks.update(blocks)
        self.alloc_failed, self.job_failed = {}, {}
        assert done.sending == want.sending
        assert done.recving == want.recving
        assert done.failed_loads == want.failed_loads
        assert done.failed_load_blocks == want.failed_load_blocks
        for rid in done.sending:
            self.release(self.reqs[rid])
        for rid in done.recving:
            r = self.reqs[rid]
            if r.state != "loading":
                continue  # preempted or finished since: the engine no longer waits
            assert r.load is not None
            start, n = r.load
            r.state, r.load = "running", None
            if rid in done.failed_loads:
                r.num_computed = start  # recompute what the load should have brought
                continue
            for gi, blocks in enumerate(r.blocks):
                for i in range(start // TPB, (start + n) // TPB):
                    for w in range(self.W):
                        assert self.dev[w][gi][blocks[i]] == (gi, r.hashes[i]), (
                            f"{rid} received block {i} with {self.dev[w][gi][blocks[i]]}"
                        )
            r.num_computed = start + n
            self.cache_blocks(r, r.num_computed // TPB)

    # -- one run ------------------------------------------------------------------------------

    def run(self) -> None:
        for _ in range(STEPS):
            self.schedule()
            self.run_step(self.build())
        for r in list(self.reqs.values()):
            if r.state != "finished":
                self.finish(r)
        self.check_state()
        for _ in range(2):
            self.run_workers(1.0)
            self.deliver(1.0)
            self.take_finished()
        self.check_end()

    def check_end(self) -> None:
        """Every request ended and every report that was not lost arrived: nothing is left but
        what the lost reports hold, and once those are failed (`fail_unreported`), nothing."""
        lost = [j for j in self.incomplete()]
        assert all(j.lost for j in lost), "a report was never delivered"
        assert not any(j.queued for j in lost)
        self.check_state()
        assert {r.rid for r in self.reqs.values() if r.tracked} == {j.spec.req_id for j in lost}
        if lost:
            self.stats["lost reports failed"] += 1
            for who in range(self.W) if self.named else [None]:
                self.fail_unreported(who)
            self.take_finished()
        st = self.m.get_stats()
        assert (st.pinned, st.pending_writes, st.used_slots) == (0, 0, st.ready)
        assert st.ready == len(self.announced)
        assert self.s.num_requests() == 0 and self.s.num_jobs_in_flight() == 0
        assert all(sum(refs) == 0 for refs in self.ref), "device blocks still held"
        assert all(len(f) == len(refs) for f, refs in zip(self.free, self.ref, strict=True))


def test_a_report_of_a_job_not_yet_sent_is_refused() -> None:
    """Found by the fuzz (seed 75): reports handled between the allocation that planned a load
    and the step that sends it (asynchronous scheduling) were accepted for that load, so a stale
    or misdirected report released its pins and announced the request received before any byte
    was copied; the job was then still sent, to read slots other stores could now reuse."""
    m = CPUOffloadingManager(4, enable_events=True)
    s = OffloadingScheduler(m, tokens_per_block=TPB, num_workers=2)
    hashes = chain("a", 2, [])
    s.add_request("a", hashes, 2 * TPB + 1)
    assert s.get_num_new_matched_tokens("a", 0) == 0
    s.update_state_after_alloc("a", [[0, 1, 2]], 0)
    (store,) = s.build_step_metadata([StepProgress("a", [[0, 1, 2]], 2 * TPB)]).stores
    for w in range(2):
        s.on_worker_results([TransferResult(store.job_id, True)], worker=w)
    assert not s.request_finished("a")
    s.add_request("b", hashes, 2 * TPB + 1)
    assert s.get_num_new_matched_tokens("b", 0) == 2 * TPB
    s.update_state_after_alloc("b", [[5, 6, 7]], 2 * TPB)
    (load_id,) = s.job_ids_in_flight()
    for worker in (0, None):
        with pytest.raises(ValueError, match=f"job {load_id}, which is not in flight .no Step"):
            s.on_worker_results([TransferResult(load_id, True)], worker=worker)
    assert m.get_stats().pinned == 2  # nothing applied: b's chunks stay pinned, b waits
    assert s.take_finished().recving == set()
    (load,) = s.build_step_metadata().loads
    assert load.job_id == load_id
    for w in range(2):
        s.on_worker_results([TransferResult(load_id, True)], worker=w)
    assert s.take_finished().recving == {"b"}
    assert m.get_stats().pinned == 0


def run_seed(seed: int, stats: Counter[str], proof: int = 0) -> None:
    try:
        Fuzz(seed, stats, proof).run()
    except BaseException as e:  # pytest.raises fails with a BaseException
        e.add_note(f"seed={seed} proof={proof}")
        raise


@pytest.mark.parametrize("batch", range(BATCHES))
def test_random_engines_never_serve_bad_kv_nor_leak(batch: int) -> None:
    stats: Counter[str] = Counter()
    for seed in range(batch * SEEDS_PER_BATCH, (batch + 1) * SEEDS_PER_BATCH):
        run_seed(seed, stats)
    # The fuzz reaches every situation it is meant to check, in every batch.
    for situation in (
        "load ok",
        "load failed",
        "store ok",
        "store failed",
        "eviction",
        "device hit",
        "preempted with a load in flight",
        "preempted with a store in flight",
        "preempted request's load failed",
        "gave back the blocks of a load failed at alloc",
        "finished with jobs in flight",
        "stores beside stores in flight",
        "reset with jobs in flight",
        "job done after reset",
        "offer gone at alloc",
        "duplicate refused",
        "lost report",
        "lost reports failed",
        "load from mid chunk",
        "load of several groups",
        "preempted before its load was sent",
        "preempted after a failed load",
        "offered again after a failed load",
        "held back for an untaken report",
    ):
        assert stats[situation] > 0, f"no {situation!r} in seeds of batch {batch}: {stats}"


def test_random_engines_with_proof_chunks() -> None:
    """The same engines with EAGLE/MTP proof chunks (`proof_chunks` 1 or 2): offers stop that
    many chunks before the end of the hit run, a pending proof chunk answers "ask again" only
    where a chunk could be loaded, and a decoding request's last computed chunks wait."""
    stats: Counter[str] = Counter()
    for seed in range(2 * SEEDS_PER_BATCH):
        run_seed(seed, stats, 1 + seed % 2)
    for situation in (
        "load ok",
        "load failed",
        "store ok",
        "device hit",
        "preempted with a load in flight",
        "offer gone at alloc",
        "load from mid chunk",
        "load of several groups",
        "lost reports failed",
        "offer cut by proof",
        "decoding store with proof chunks",
    ):
        assert stats[situation] > 0, f"no {situation!r} with proof chunks: {stats}"
