"""Belady's optimum (OPT) for a trace's CPU-tier lookup stream, offline and exact.

OPT here is an offline bound, not a `CachePolicy`: it reads the future, so it cannot run inside
the manager. On a miss it may store the block or not (bypass); when the tier is full it keeps
the blocks whose next use is soonest, counting the missed block among the candidates. For
unit-size blocks where every miss may be stored at once, that rule maximises hits (Belady
1966; Mattson et al. 1970). Cost: O(n log n) with next-use indices and a lazily pruned heap.

It applies where every miss can be stored when it happens: `flat` mode and `engine` mode with
eager stores. With stores only on device eviction a block can be stored only at certain times,
the greedy rule is no longer provably optimal, and `opt_result` refuses.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Hashable, Sequence

from kvtier.base import OffloadKey, checked_int
from kvtier.sim.replay import STORE_ON, DevicePrefixCache, check_device_options
from kvtier.sim.result import RunResult
from kvtier.sim.trace import Trace, check_replayable


def belady(stream: Sequence[Hashable], capacity: int) -> tuple[bytearray, int, int]:
    """Hits of the optimal cache of `capacity` blocks over `stream`.

    Returns `(hit flags per access, stores, evictions)`. Every miss may be stored or bypassed.
    """
    # A float (2.5) replayed as the next whole block count (3) and was reported as given; a
    # bool as 1 block. The manager refuses both for every other policy.
    capacity = checked_int("capacity", capacity)
    n = len(stream)
    # next_use[t]: position of the next access to stream[t]; n + t when there is none, which
    # ranks never-again blocks farthest and keeps every heap entry unique and decodable.
    next_use = [0] * n
    last: dict[Hashable, int] = {}
    for t in range(n - 1, -1, -1):
        key = stream[t]
        next_use[t] = last.get(key, n + t)
        last[key] = t
    hits = bytearray(n)
    resident: dict[Hashable, int] = {}  # key -> its next use; heap entries not matching are stale
    heap: list[int] = []  # -next_use, so the farthest next use is on top
    push, pop = heapq.heappush, heapq.heappop
    stores = evictions = 0
    for t, key in enumerate(stream):
        nu = next_use[t]
        if key in resident:
            hits[t] = 1
            resident[key] = nu
            push(heap, -nu)
            continue
        if nu >= n:
            continue  # never used again: storing it cannot pay
        if len(resident) < capacity:
            resident[key] = nu
            push(heap, -nu)
            stores += 1
            continue
        while True:
            far = -heap[0]
            far_key = stream[far - n] if far >= n else stream[far]
            if resident.get(far_key) == far:
                break
            pop(heap)
        if far > nu:
            pop(heap)
            del resident[far_key]
            evictions += 1
            resident[key] = nu
            push(heap, -nu)
            stores += 1
    return hits, stores, evictions


def device_prefix_hits(trace: Trace, device_blocks: int) -> list[int]:
    """Per request, the leading blocks an engine's device prefix cache holds (engine mode)."""
    device = DevicePrefixCache(device_blocks)
    out = []
    for req in trace.requests:
        out.append(device.prefix_hits(req.keys))
        for key in req.keys:
            device.add(key)
    return out


def check_opt_exact(mode: str, store_on: str) -> None:
    """Refuse a replay where OPT is not exact: behind a device storing only what it evicts, a
    miss may not be stored when it happens, which Belady's choice assumes."""
    if mode == "engine" and store_on != "eager":
        raise ValueError(
            "policy 'opt' is exact only where every miss may be stored at once (flat, or "
            f"engine with eager stores); store_on={store_on!r} is not supported"
        )


def opt_result(
    trace: Trace,
    capacity: int,
    *,
    mode: str = "flat",
    device_blocks: int = 0,
    store_on: str = "eager",
) -> RunResult:
    """Replay `trace` against Belady's optimum of `capacity` blocks, as a `RunResult`."""
    if mode not in ("flat", "engine"):
        raise ValueError(f"mode={mode!r} is invalid; expected 'flat' or 'engine'")
    if store_on not in STORE_ON:
        # Before the check below, which would call a misspelling a valid, unsupported choice.
        raise ValueError(f"store_on={store_on!r} is invalid; expected one of: {STORE_ON}")
    check_device_options(mode, device_blocks, store_on)
    check_opt_exact(mode, store_on)
    capacity = checked_int("capacity", capacity)  # before the row reports it
    check_replayable(trace)
    start = time.perf_counter()
    reqs = trace.requests
    dev = device_prefix_hits(trace, device_blocks) if mode == "engine" else [0] * len(reqs)
    stream: list[OffloadKey] = []
    for req, d in zip(reqs, dev, strict=True):
        stream.extend(req.keys[d:])
    flags, stores, evictions = belady(stream, capacity)
    hits = device_hits = prefix_tokens = saved = 0
    pos = 0
    for req, d in zip(reqs, dev, strict=True):
        m = len(req.keys) - d
        seg = flags[pos : pos + m]
        pos += m
        hits += sum(seg)
        device_hits += d
        first_miss = seg.find(0)
        served = req.prefix_tokens(d + (m if first_miss < 0 else first_miss))
        prefix_tokens += served
        saved += served - req.prefix_tokens(d)
    cpu_hits = hits
    result = RunResult(
        policy="opt",
        mode=mode,
        capacity_blocks=capacity,
        capacity_frac=capacity / trace.num_unique_blocks if trace.num_unique_blocks else 0.0,
        store_threshold=0,
        requests=len(reqs),
        blocks=trace.num_blocks,
        tokens=trace.num_tokens,
        block_tokens=trace.block_tokens,
        hits=hits + device_hits,
        prefix_tokens=prefix_tokens,
        prefill_tokens_saved=saved,
        cpu_lookups=len(stream),
        cpu_hits=cpu_hits,
        loads=cpu_hits,
        stores=stores,
        evictions=evictions,
        stores_skipped=len(stream) - cpu_hits - stores,
        seconds=time.perf_counter() - start,
    )
    if mode == "engine":
        result.device_blocks = device_blocks
        result.device_hits = device_hits
        result.store_on = store_on
    return result
