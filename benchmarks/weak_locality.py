"""Policies built for reuse distances longer than the cache, against kvaware, Mooncake flat mode.

Mooncake's blocks come back a median ~9,300 accesses after their last use, five times what a 1%
cache holds. LIRS (Jiang & Zhang, SIGMETRICS'02) and LRU-2 (O'Neil et al., SIGMOD'93) were
designed for that regime and look past the last use: LIRS ranks blocks by the gap between their
last two uses, LRU-2 by the time of the use before the last. Both are simulated here offline
over the trace's block ids, in their most favourable form (the history of every block ever
seen, unbounded), next to LRU and kvaware replayed through the real manager in the same run.
Evidence for docs/kvaware-evaluation.md ("What was tried"), not shipped policies.

    python benchmarks/weak_locality.py [--capacities 0.01,0.05,0.10,0.25] [--hir-share 0.01]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import heapq
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from _cli import progress, require_file, require_writable, run_main, write_results
from kvtier.sim import read_trace
from policy_hit_ratios import TRACE, load_trace, replay


def lirs(stream: Sequence[int], capacity: int, hir_share: float = 0.01) -> float:
    """LIRS hit ratio (%). `hir_share` of the slots hold resident HIR blocks (the paper's 1%)."""
    hir_slots = max(2, int(capacity * hir_share))
    lir_slots = capacity - hir_slots
    stack: OrderedDict[int, None] = OrderedDict()  # recency stack S; last = most recent
    queue: OrderedDict[int, None] = OrderedDict()  # resident HIR blocks; first leaves first
    lir: set[int] = set()
    resident: set[int] = set()
    hits = 0

    def prune() -> None:
        # The stack's bottom is always a LIR block: HIR entries below it carry no IRR bound.
        while stack:
            bottom = next(iter(stack))
            if bottom in lir:
                return
            del stack[bottom]

    def demote_bottom() -> None:
        bottom = next(iter(stack))
        del stack[bottom]
        lir.discard(bottom)
        queue[bottom] = None
        prune()

    for x in stream:
        if x in lir:
            hits += 1
            was_bottom = next(iter(stack)) == x
            stack.move_to_end(x)
            if was_bottom:
                prune()
        elif x in resident:  # resident HIR
            hits += 1
            if x in stack:  # its IRR beats the bottom LIR block's recency: promote
                stack.move_to_end(x)
                del queue[x]
                lir.add(x)
                demote_bottom()
            else:
                stack[x] = None
                queue.move_to_end(x)
        elif len(lir) < lir_slots:  # warm-up: the first blocks fill the LIR set
            lir.add(x)
            resident.add(x)
            stack[x] = None
            stack.move_to_end(x)
        else:
            if len(resident) >= capacity:
                victim, _ = queue.popitem(last=False)
                resident.discard(victim)
            resident.add(x)
            if x in stack:  # a non-resident HIR block still in S: reused soon enough
                stack.move_to_end(x)
                lir.add(x)
                demote_bottom()
            else:
                stack[x] = None
                queue[x] = None
    return 100.0 * hits / len(stream)


def lru2(stream: Sequence[int], capacity: int) -> float:
    """LRU-2 hit ratio (%): evict the block whose second-to-last use is oldest; blocks used
    once go first, least recent first. The history of every block is kept."""
    last: dict[int, int] = {}
    penultimate: dict[int, int] = {}
    resident: set[int] = set()
    once: OrderedDict[int, None] = OrderedDict()
    heap: list[tuple[int, int, int]] = []  # (penultimate use, last use, block); lazy
    hits = 0
    for t, x in enumerate(stream):
        if x in last:
            penultimate[x] = last[x]
        last[x] = t
        if x in resident:
            hits += 1
            once.pop(x, None)
            heapq.heappush(heap, (penultimate[x], t, x))
            continue
        if len(resident) >= capacity:
            if once:
                victim, _ = once.popitem(last=False)
            else:
                while True:
                    _, used, victim = heapq.heappop(heap)
                    if victim in resident and last[victim] == used:
                        break
            resident.discard(victim)
        resident.add(x)
        if x in penultimate:
            heapq.heappush(heap, (penultimate[x], t, x))
        else:
            once[x] = None
    return 100.0 * hits / len(stream)


def main() -> None:
    """Print one row per policy and optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--capacities",
        default="0.01,0.05,0.10,0.25",
        help="shares of the trace's unique blocks, comma separated",
    )
    parser.add_argument(
        "--hir-share", type=float, default=0.01, help="LIRS: share of slots for HIR blocks"
    )
    parser.add_argument("--json", type=Path, help="write results to this file")
    args = parser.parse_args()
    if not 0 < args.hir_share < 1:
        parser.error(f"--hir-share={args.hir_share}: expected a share in (0, 1)")
    try:
        fractions = [float(f) for f in args.capacities.split(",")]
    except ValueError:
        parser.error(f"--capacities={args.capacities!r}: expected shares such as 0.01,0.05")
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        parser.error(f"--capacities={args.capacities!r}: every share must be in (0, 1]")
    require_writable(parser, args.json, inputs=[TRACE])
    require_file(parser, "the Mooncake trace", TRACE)
    stream = [k for req in load_trace(TRACE) for k in req]
    caps = [max(2, int(f * len(set(stream)))) for f in fractions]
    trace = read_trace(TRACE)
    runs: dict[str, Callable[[int], float]] = {
        "lru": lambda c: replay("lru", trace, c),
        "lirs": lambda c: lirs(stream, c, args.hir_share),
        "lru2": lambda c: lru2(stream, c),
        "kvaware": lambda c: replay("kvaware", trace, c),
    }
    rows = {}
    for name, run in runs.items():
        rows[name] = [run(c) for c in caps]
        progress(f"{name}: done")
    print("Mooncake conversation, flat mode, block hit ratio %")
    print(f"{'policy':<10}" + "".join(f"{f:>10.0%}" for f in fractions))
    for name, values in rows.items():
        print(f"{name:<10}" + "".join(f"{v:>10.2f}" for v in values))
    if args.json:
        write_results(args.json, json.dumps({"capacities": caps, "hit_ratio": rows}, indent=2))


if __name__ == "__main__":
    run_main(main)
