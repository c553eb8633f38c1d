"""Replays on random small traces (hypothesis) against a reference model written here.

The model is a few dicts from docs/simulate.md: an LRU CPU tier, an LRU device prefix cache,
reuse admission as a set of request ids per key, and OPT as an exhaustive search. It shares no
code with `kvtier.sim`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.base import OffloadKey, make_offload_key
from kvtier.policies import registered_policies
from kvtier.sim.bounds import opt_result
from kvtier.sim.runner import ReplayOptions, run_one
from kvtier.sim.shapes import parse_model_shape
from kvtier.sim.trace import Request, Trace

SHAPE = parse_model_shape("llama-3-8b")


def _key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


@st.composite
def traces(draw: st.DrawFn, max_requests: int = 12, pool: int = 7) -> Trace:
    """Requests of distinct ids from a small pool (hits after misses happen), partial blocks."""
    bt = draw(st.sampled_from([1, 3, 16]))
    n = draw(st.integers(1, max_requests))
    reqs = []
    for r in range(n):
        ids = draw(st.lists(st.integers(0, pool - 1), max_size=5, unique=True))
        length = len(ids) * bt - draw(st.integers(0, bt - 1)) if ids else 0
        reqs.append(Request(f"q{r}", [_key(i) for i in ids], length, bt))
    return Trace(reqs)


@dataclass
class Want:
    hits: int = 0
    device_hits: int = 0
    cpu_lookups: int = 0
    cpu_hits: int = 0
    stores: int = 0
    evictions: int = 0
    skipped: int = 0
    prefix: int = 0
    saved: int = 0


def reference(trace: Trace, cap: int, device: int | None, store_on: str, threshold: int) -> Want:
    """What an LRU CPU tier must count; `device=None` is flat mode."""
    w = Want()
    cpu: dict[OffloadKey, int] = {}  # key -> last-use time
    dev: dict[OffloadKey, int] = {}
    seen: dict[OffloadKey, set[str]] = {}
    clock = 0

    def tick() -> int:
        nonlocal clock
        clock += 1
        return clock

    def offer(k: OffloadKey, rid: str) -> None:
        if k in cpu:
            return
        if threshold >= 2:
            seen.setdefault(k, set()).add(rid)
            if len(seen[k]) < threshold:
                w.skipped += 1
                return
        if len(cpu) >= cap:
            del cpu[min(cpu, key=cpu.__getitem__)]
            w.evictions += 1
        cpu[k] = tick()
        w.stores += 1

    for req in trace.requests:
        keys = req.keys
        d = 0
        if device is not None:
            while d < len(keys) and keys[d] in dev:
                d += 1
            for k in reversed(keys[:d]):  # one touch call: its first key ends most recent
                if k in cpu:
                    cpu[k] = tick()
        miss = None
        for i, k in enumerate(keys):
            if i >= d:
                w.cpu_lookups += 1
                if k in cpu:
                    cpu[k] = tick()
                    w.cpu_hits += 1
                else:
                    miss = i if miss is None else miss
                    if device is None or store_on == "eager":
                        offer(k, req.req_id)
            if device is not None:
                gone = None
                if k in dev or device > 0:
                    dev[k] = tick()
                    if len(dev) > device:
                        gone = min(dev, key=dev.__getitem__)
                        del dev[gone]
                else:
                    gone = k
                if gone is not None and store_on == "on-evict":
                    offer(gone, req.req_id)
        served = min((len(keys) if miss is None else miss) * req.block_tokens, req.input_length)
        w.device_hits += d
        w.prefix += served
        w.saved += served - min(d * req.block_tokens, req.input_length)
    w.hits = w.cpu_hits + w.device_hits
    return w


@settings(max_examples=150, deadline=None)
@given(
    trace=traces(),
    cap=st.integers(1, 6),
    engine=st.booleans(),
    device=st.integers(0, 5),
    store_on=st.sampled_from(["eager", "on-evict"]),
    threshold=st.sampled_from([0, 2, 3]),
    hits_as=st.sampled_from(["touch", "load"]),
)
def test_lru_replay_counts_match_the_reference(
    trace: Trace,
    cap: int,
    engine: bool,
    device: int,
    store_on: str,
    threshold: int,
    hits_as: str,
) -> None:
    opts = ReplayOptions(
        mode="engine" if engine else "flat",
        store_threshold=threshold,
        max_tracker_size=10_000,
        device_blocks=device if engine else 0,
        store_on=store_on if engine else "eager",
        hits_as=hits_as,
    )
    r = run_one(trace, "lru", cap, opts)
    w = reference(trace, cap, device if engine else None, store_on, threshold)
    row = r.to_row(SHAPE)
    bb = SHAPE.block_bytes(trace.block_tokens)
    assert (
        r.hits,
        r.device_hits,
        r.cpu_lookups,
        r.cpu_hits,
        r.loads,
        r.stores,
        r.evictions,
        r.stores_skipped,
        r.prefix_tokens,
        r.prefill_tokens_saved,
    ) == (
        w.hits,
        w.device_hits if engine else 0,
        w.cpu_lookups,
        w.cpu_hits,
        w.cpu_hits,
        w.stores,
        w.evictions,
        w.skipped,
        w.prefix,
        w.saved,
    )
    assert row["bytes_loaded"] == w.cpu_hits * bb
    assert row["bytes_stored"] == w.stores * bb
    assert row["capacity_bytes"] == cap * bb
    blocks = sum(len(q.keys) for q in trace.requests)
    tokens = sum(q.input_length for q in trace.requests)
    assert row["block_hit_ratio"] == (w.hits / blocks if blocks else 0.0)
    assert row["prefix_hit_ratio"] == (w.prefix / tokens if tokens else 0.0)


def exhaustive_hits(stream: list[OffloadKey], cap: int) -> int:
    """Most hits any cache of `cap` blocks gets: every store, bypass and victim tried."""

    @cache
    def best(t: int, held: frozenset[OffloadKey]) -> int:
        if t == len(stream):
            return 0
        k = stream[t]
        if k in held:
            return 1 + best(t + 1, held)
        options = [best(t + 1, held)]
        if len(held) < cap:
            options.append(best(t + 1, held | {k}))
        else:
            options += [best(t + 1, (held - {v}) | {k}) for v in held]
        return max(options)

    return best(0, frozenset())


@settings(max_examples=80, deadline=None)
@given(
    trace=traces(max_requests=6, pool=5),
    cap=st.integers(1, 4),
    engine=st.booleans(),
    device=st.integers(0, 4),
)
def test_opt_is_the_exhaustive_optimum_and_bounds_every_policy(
    trace: Trace, cap: int, engine: bool, device: int
) -> None:
    mode = "engine" if engine else "flat"
    dev = device if engine else 0
    opt = opt_result(trace, cap, mode=mode, device_blocks=dev)
    opts = ReplayOptions(mode=mode, device_blocks=dev)
    # The CPU-tier lookup stream: every block after the device's prefix (LRU over blocks).
    stream: list[OffloadKey] = []
    on_dev: dict[OffloadKey, None] = {}
    dev_hits = 0
    for q in trace.requests:
        d = 0
        while engine and d < len(q.keys) and q.keys[d] in on_dev:
            d += 1
        dev_hits += d
        stream.extend(q.keys[d:])
        for k in q.keys:
            on_dev.pop(k, None)
            on_dev[k] = None
            while len(on_dev) > dev:
                del on_dev[next(iter(on_dev))]
    assert opt.cpu_lookups == len(stream)
    assert opt.hits == dev_hits + exhaustive_hits(stream, cap)
    infinite = run_one(trace, "infinite", cap, opts)
    assert opt.hits <= infinite.hits
    for policy in registered_policies():
        r = run_one(trace, policy, cap, opts)
        assert r.cpu_lookups == opt.cpu_lookups
        assert r.hits <= opt.hits <= infinite.hits, policy
    assert opt.stores + opt.stores_skipped + opt.cpu_hits == opt.cpu_lookups


@settings(max_examples=60, deadline=None)
@given(
    trace=traces(),
    cap=st.integers(1, 6),
    store_on=st.sampled_from(["eager", "on-evict"]),
    threshold=st.sampled_from([0, 2]),
    hits_as=st.sampled_from(["touch", "load"]),
)
def test_an_empty_device_is_flat_mode_for_every_policy(
    trace: Trace, cap: int, store_on: str, threshold: int, hits_as: str
) -> None:
    flat = ReplayOptions(store_threshold=threshold, hits_as=hits_as)
    engine = ReplayOptions(
        mode="engine", store_threshold=threshold, store_on=store_on, hits_as=hits_as
    )
    for policy in [*registered_policies(), "opt", "infinite"]:
        if policy == "opt" and store_on != "eager":
            continue
        a, b = (
            run_one(trace, policy, cap, flat).to_row(),
            run_one(trace, policy, cap, engine).to_row(),
        )
        for name in ("seconds", "blocks_per_s", "mode", "device_blocks", "store_on", "device_hits"):
            a.pop(name), b.pop(name)
        assert a == b, policy


@settings(max_examples=60, deadline=None)
@given(
    trace=traces(),
    cap=st.integers(1, 5),
    engine=st.booleans(),
    device=st.integers(0, 4),
    store_on=st.sampled_from(["eager", "on-evict"]),
    threshold=st.sampled_from([0, 2]),
    hits_as=st.sampled_from(["touch", "load"]),
)
def test_infinite_and_opt_bound_every_policy_under_any_options(
    trace: Trace,
    cap: int,
    engine: bool,
    device: int,
    store_on: str,
    threshold: int,
    hits_as: str,
) -> None:
    opts = ReplayOptions(
        mode="engine" if engine else "flat",
        store_threshold=threshold,
        max_tracker_size=10_000,
        device_blocks=device if engine else 0,
        store_on=store_on if engine else "eager",
        hits_as=hits_as,
    )
    inf = run_one(trace, "infinite", cap, opts)
    opt = None
    if opts.mode == "flat" or opts.store_on == "eager":
        opt = opt_result(trace, cap, mode=opts.mode, device_blocks=opts.device_blocks)
    for policy in registered_policies():
        r = run_one(trace, policy, cap, opts)
        assert r.hits <= inf.hits and r.prefix_tokens <= inf.prefix_tokens, policy
        assert r.prefill_tokens_saved <= inf.prefill_tokens_saved, policy
        assert r.cpu_lookups == inf.cpu_lookups and r.device_hits == inf.device_hits
        if opt is not None:
            assert r.hits <= opt.hits, policy
