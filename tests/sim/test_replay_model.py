"""The replays against an independent model of what they should count.

The model below is written from docs/simulate.md, not from `kvtier.sim.replay`: a CPU tier of
LRU recency stamps (no `OrderedDict`, no manager), a device prefix cache of the same, reuse
admission as a set of request ids per key, and OPT as an exhaustive search. Random traces
(chained prefixes, and unchained ones that give hits after a miss) are replayed through the
real manager in flat and engine mode and every counter is compared.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from helpers import brute_force_hits
from kvtier.base import OffloadKey
from kvtier.policies import registered_policies
from kvtier.sim.bounds import opt_result
from kvtier.sim.replay import make_manager, replay_engine, replay_flat
from kvtier.sim.result import RunResult
from kvtier.sim.runner import ReplayOptions, run_one
from kvtier.sim.shapes import MODEL_PRESETS, parse_capacity
from kvtier.sim.trace import Request, Trace

from .conftest import key, random_trace

INF = 10**9


class _Lru:
    """Recency stamps; the smallest stamp is the least recently used."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.stamp: dict[OffloadKey, int] = {}
        self.clock = 0

    def __contains__(self, k: OffloadKey) -> bool:
        return k in self.stamp

    def use(self, k: OffloadKey) -> None:
        self.clock += 1
        self.stamp[k] = self.clock

    def oldest(self) -> OffloadKey:
        return min(self.stamp, key=self.stamp.__getitem__)


@dataclass
class Expected:
    hits: int = 0
    device_hits: int = 0
    cpu_lookups: int = 0
    cpu_hits: int = 0
    stores: int = 0
    evictions: int = 0
    stores_skipped: int = 0
    prefix_tokens: int = 0
    saved: int = 0
    offered_by: dict[OffloadKey, set[str]] = field(default_factory=dict)


def model(
    trace: Trace,
    capacity: int,
    *,
    device: int | None,
    store_on: str = "eager",
    threshold: int = 0,
) -> Expected:
    """What a replay of `trace` with an LRU CPU tier must count (`device=None`: flat mode)."""
    e = Expected()
    cpu = _Lru(capacity)
    dev = _Lru(device or 0)

    def offer(k: OffloadKey, rid: str) -> None:
        if k in cpu:
            return  # present: not offered to admission, nothing stored
        if threshold >= 2:
            ids = e.offered_by.setdefault(k, set())
            admitted = len(ids | {rid}) >= threshold
            ids.add(rid)
            if not admitted:
                e.stores_skipped += 1
                return
        if len(cpu.stamp) >= cpu.capacity:
            del cpu.stamp[cpu.oldest()]
            e.evictions += 1
        cpu.use(k)
        e.stores += 1

    def device_add(k: OffloadKey) -> OffloadKey | None:
        if k in dev:
            dev.use(k)
            return None
        if dev.capacity == 0:
            return k
        dev.use(k)
        if len(dev.stamp) > dev.capacity:
            old = dev.oldest()
            del dev.stamp[old]
            return old
        return None

    for req in trace.requests:
        keys, rid = req.keys, req.req_id
        d = 0
        if device is not None:
            while d < len(keys) and keys[d] in dev:
                d += 1
            # Device hits are one touch call: applied tail first, so the head is most recent.
            for k in reversed(keys[:d]):
                if k in cpu:
                    cpu.use(k)
        first_miss = None
        for i, k in enumerate(keys):
            if i >= d:
                e.cpu_lookups += 1
                if k in cpu:
                    cpu.use(k)
                    e.cpu_hits += 1
                else:
                    if first_miss is None:
                        first_miss = i
                    if device is None or store_on == "eager":
                        offer(k, rid)
            if device is not None:
                # As documented, "LRU over blocks" in request order: a request's head is its
                # least recent block (vLLM frees a request's tail first, which this is not).
                # An evicted block is offered on behalf of the request that evicted it, and
                # that request is the one reuse admission counts.
                evicted = device_add(k)
                if evicted is not None and store_on == "on-evict":
                    offer(evicted, rid)
        served_blocks = len(keys) if first_miss is None else first_miss
        served = min(served_blocks * req.block_tokens, req.input_length)
        e.device_hits += d
        e.prefix_tokens += served
        e.saved += served - min(d * req.block_tokens, req.input_length)
    e.hits = e.cpu_hits + e.device_hits
    return e


def unchained_trace(seed: int, num_requests: int = 40) -> Trace:
    """Requests of random ids from a small pool: hits after misses, partial last blocks."""
    rng = random.Random(seed)
    pool = rng.randint(3, 12)
    block_tokens = rng.choice([1, 4, 16])
    reqs = []
    for n in range(num_requests):
        ids = rng.sample(range(pool), rng.randint(0, min(pool, 6)))
        length = 0 if not ids else (len(ids) - 1) * block_tokens + rng.randint(1, block_tokens)
        reqs.append(Request(f"r{n}", [key(i) for i in ids], length, block_tokens))
    return Trace(reqs, name=f"unchained-{seed}")


def any_trace(seed: int) -> Trace:
    if seed % 2:
        return unchained_trace(seed)
    return random_trace(seed, num_requests=50, max_blocks=random.Random(seed).randint(2, 10))


def _check(r: RunResult, e: Expected, *, engine: bool) -> None:
    got = (
        r.hits,
        r.cpu_lookups,
        r.cpu_hits,
        r.loads,
        r.stores,
        r.evictions,
        r.stores_skipped,
        r.prefix_tokens,
        r.prefill_tokens_saved,
        r.device_hits,
    )
    want = (
        e.hits,
        e.cpu_lookups,
        e.cpu_hits,
        e.cpu_hits,  # every CPU hit is a load (touched or pinned)
        e.stores,
        e.evictions,
        e.stores_skipped,
        e.prefix_tokens,
        e.saved,
        e.device_hits if engine else 0,
    )
    assert got == want


@pytest.mark.parametrize("seed", range(24))
def test_flat_replay_matches_the_model(seed: int) -> None:
    trace = any_trace(seed)
    rng = random.Random(seed)
    for _ in range(4):
        capacity = rng.randint(1, max(1, trace.num_unique_blocks + 1))
        threshold = rng.choice([0, 2, 3])
        hits_as = rng.choice(["touch", "load"])
        mgr = make_manager("lru", capacity, store_threshold=threshold)
        r = replay_flat(trace, mgr, hits_as=hits_as)
        _check(r, model(trace, capacity, device=None, threshold=threshold), engine=False)


@pytest.mark.parametrize("seed", range(40))
def test_engine_replay_matches_the_model(seed: int) -> None:
    trace = any_trace(seed)
    rng = random.Random(1000 + seed)
    for _ in range(6):
        capacity = rng.randint(1, max(1, trace.num_unique_blocks + 1))
        device = rng.choice([0, 1, 2, rng.randint(0, trace.num_unique_blocks + 2)])
        store_on = rng.choice(["eager", "on-evict"])
        threshold = rng.choice([0, 0, 2, 3])
        hits_as = rng.choice(["touch", "load"])
        mgr = make_manager("lru", capacity, store_threshold=threshold)
        r = replay_engine(trace, mgr, device_blocks=device, store_on=store_on, hits_as=hits_as)
        e = model(trace, capacity, device=device, store_on=store_on, threshold=threshold)
        _check(r, e, engine=True)
        assert (r.device_blocks, r.store_on, r.hits_as) == (device, store_on, hits_as)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("store_on", ["eager", "on-evict"])
def test_infinite_matches_the_model(seed: int, store_on: str) -> None:
    trace = any_trace(seed)
    for mode, device in (("flat", 0), ("engine", 0), ("engine", 3)):
        # Flat mode has no device, so it takes no store setting (ReplayOptions refuses one).
        on = store_on if mode == "engine" else "eager"
        opts = ReplayOptions(mode=mode, device_blocks=device, store_on=on, store_threshold=2)
        r = run_one(trace, "infinite", 1, opts)
        e = model(trace, INF, device=device if mode == "engine" else None, store_on=store_on)
        _check(r, e, engine=mode == "engine")
        assert r.evictions == 0 and r.store_threshold == 0


# -- OPT ---------------------------------------------------------------------------------------


def cpu_stream(trace: Trace, device: int | None) -> tuple[list[OffloadKey], int]:
    """The CPU-tier lookups of a replay (after each request's device prefix) and device hits."""
    dev = _Lru(device or 0)
    stream: list[OffloadKey] = []
    device_hits = 0
    for req in trace.requests:
        d = 0
        if device is not None:
            while d < len(req.keys) and req.keys[d] in dev:
                d += 1
            for k in req.keys:
                if dev.capacity:
                    dev.use(k)
                    if len(dev.stamp) > dev.capacity:
                        del dev.stamp[dev.oldest()]
        device_hits += d
        stream.extend(req.keys[d:])
    return stream, device_hits


def small_trace(seed: int) -> Trace:
    rng = random.Random(seed)
    pool = rng.randint(2, 5)
    reqs = []
    for n in range(rng.randint(2, 6)):
        ids = rng.sample(range(pool), rng.randint(1, min(pool, 3)))
        reqs.append(Request(f"r{n}", [key(i) for i in ids], len(ids) * 4, 4))
    return Trace(reqs)


@pytest.mark.parametrize("seed", range(60))
def test_opt_is_the_exhaustive_optimum_in_both_modes(seed: int) -> None:
    trace = small_trace(seed)
    rng = random.Random(seed)
    capacity = rng.randint(1, 3)
    device = rng.randint(0, 3)
    stream, _ = cpu_stream(trace, None)
    flat = opt_result(trace, capacity)
    assert flat.hits == flat.cpu_hits == brute_force_hits(stream, capacity)
    stream, device_hits = cpu_stream(trace, device)
    eng = opt_result(trace, capacity, mode="engine", device_blocks=device)
    assert eng.device_hits == device_hits
    assert eng.cpu_hits == brute_force_hits(stream, capacity)
    assert eng.hits == device_hits + eng.cpu_hits
    assert eng.cpu_lookups == len(stream)
    assert eng.stores + eng.stores_skipped + eng.cpu_hits == len(stream)
    if device == 0:
        assert (eng.hits, eng.stores) == (flat.hits, flat.stores)
        assert eng.prefix_tokens == flat.prefix_tokens


@pytest.mark.parametrize("seed", range(8))
def test_opt_bounds_every_policy_in_engine_mode(seed: int) -> None:
    """OPT is the optimum of the CPU-tier stream; the device part is the same for all."""
    trace = any_trace(seed)
    for capacity in (1, 2, 5, 11):
        for device in (0, 2, 6):
            opt = opt_result(trace, capacity, mode="engine", device_blocks=device)
            infinite = run_one(trace, "infinite", 1, ReplayOptions("engine", device_blocks=device))
            assert opt.hits <= infinite.hits
            for policy in registered_policies():
                for hits_as in ("touch", "load"):
                    for threshold in (0, 2):
                        mgr = make_manager(policy, capacity, store_threshold=threshold)
                        r = replay_engine(trace, mgr, device_blocks=device, hits_as=hits_as)
                        assert r.device_hits == opt.device_hits
                        assert r.hits <= opt.hits, (policy, capacity, device, hits_as)
            # Eager stores put every block seen into the infinite tier: no replay does better.
            for policy in registered_policies():
                mgr = make_manager(policy, capacity)
                r = replay_engine(trace, mgr, device_blocks=device, store_on="on-evict")
                assert r.hits <= infinite.hits, (policy, capacity, device)


# -- model shapes and capacities ----------------------------------------------------------------


def test_bytes_and_tokens_by_hand_for_llama_3_8b() -> None:
    """32 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes (bf16) = 128 KiB per token;
    a 512-token block is 64 MiB."""
    block = 512
    trace = Trace(
        [
            Request("a", [key(0), key(1), key(2)], 2 * block + 100, block),
            Request("b", [key(0), key(1), key(3)], 2 * block + 7, block),
            Request("c", [key(0), key(1), key(2)], 2 * block + 100, block),
        ]
    )
    r = replay_flat(trace, make_manager("lru", 8))
    # a: 3 misses. b: 0, 1 hit, 3 misses. c: 0, 1, 2 hit (the partial block 2 counts its 100).
    assert (r.hits, r.loads, r.stores, r.evictions) == (5, 5, 4, 0)
    assert r.prefix_tokens == r.prefill_tokens_saved == 2 * block + (2 * block + 100)
    assert r.tokens == 3 * 2 * block + 207
    row = r.to_row(MODEL_PRESETS["llama-3-8b"])
    mib64 = 64 * 2**20
    assert row["bytes_loaded"] == 5 * mib64 == 335_544_320
    assert row["bytes_stored"] == 4 * mib64
    assert row["capacity_bytes"] == 8 * mib64
    # A 64 GiB tier holds 1024 such blocks; 100 GB holds floor(1e11 / 2**26) = 1490.
    assert parse_capacity("64GiB", unique_blocks=4, block_bytes=mib64) == (1024, 256.0)
    assert parse_capacity("100GB", unique_blocks=4, block_bytes=mib64)[0] == 1490


def test_engine_saved_tokens_by_hand() -> None:
    """Device 2 blocks, eager, CPU 8: the CPU tier serves what the device dropped."""
    bt = 4
    trace = Trace(
        [
            Request("a", [key(0), key(1), key(2)], 11, bt),
            Request("b", [key(5)], 4, bt),  # device now 2, 5: evicted 0 then 1
            Request("c", [key(0), key(1), key(2)], 11, bt),  # all from the CPU tier
            Request("d", [key(0), key(1), key(2), key(3)], 13, bt),  # device 1, 2; 0 missing
        ]
    )
    r = replay_engine(trace, make_manager("lru", 8), device_blocks=2)
    # c: device holds 2 and 5 (0 is not there): 3 CPU hits, 11 tokens saved.
    # d: device holds 1 and 2 but not 0: no device prefix; 0, 1, 2 from CPU, 3 computed.
    assert r.device_hits == 0
    assert r.cpu_hits == 6 and r.hits == 6
    assert r.prefill_tokens_saved == r.prefix_tokens == 11 + 12
    assert r.cpu_lookups == trace.num_blocks


@pytest.mark.parametrize(
    ("spec", "unique", "blocks"),
    [
        ("50%", 3, 2),  # 1.5: ties to even
        ("50%", 5, 2),  # 2.5: ties to even
        ("12.5%", 100, 12),  # 12.5
        ("4.40%", 375, 16),  # 16.5, which float arithmetic made 17
        ("8.20%", 750, 62),  # 61.5, which float arithmetic made 61
        ("8.05%", 1000, 80),  # 80.5, which float arithmetic made 81
        ("33.3%", 10, 3),
        ("0.01%", 100, 1),  # a share above 0 is at least one block
        ("100%", 7, 7),
        ("250%", 4, 10),
    ],
)
def test_a_share_rounds_the_exact_value(spec: str, unique: int, blocks: int) -> None:
    """A share is rounded to the nearest block, a tie always to the even one."""
    assert parse_capacity(spec, unique_blocks=unique)[0] == blocks


def test_the_published_shares_keep_their_block_counts() -> None:
    unique = 182_790  # the Mooncake conversation trace; 5% and 25% are ties (9139.5, 45697.5)
    shares = ("1%", "5%", "10%", "25%")
    got = [parse_capacity(s, unique_blocks=unique)[0] for s in shares]
    assert got == [1828, 9140, 18279, 45698]
