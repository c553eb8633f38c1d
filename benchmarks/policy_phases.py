"""kvaware held in one mode, over a trace's head and its tail, against LRU and the adaptive
policy: where following the shadows loses to LRU because the best mode changes mid-trace.

On Mooncake's synthetic trace behind a device cache that stores on eviction, the filter mode
leads the first half and collapses in the second, and the shadows, which see one key in 16 or 32
there, notice late (docs/kvaware-evaluation.md, "Other device sizes, and a phase change"). A
head is the trace's first requests up to `--split` of its block accesses; the tail's hits are
the whole run's minus the head's, since a replay of the head is the start of the whole replay.

    python benchmarks/policy_phases.py synthetic_trace.jsonl [--mode engine] [--store on-evict]
        [--device 1%] [--capacity 10%] [--split 0.5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _cli import require_file, require_writable, run_main, write_results
from kvtier.cpu import CPUOffloadingManager
from kvtier.policies.base import CachePolicy
from kvtier.policies.kvaware import KVAwarePolicy
from kvtier.sim import read_trace
from kvtier.sim.replay import STORE_ON, replay_engine, replay_flat
from kvtier.sim.shapes import parse_capacity
from kvtier.sim.trace import Request


def held(mode: str, sketch_width: int = 32) -> type[CachePolicy]:
    """kvaware fixed in `mode` ("open": admit every block; "filter": admit by count)."""

    class Held(KVAwarePolicy):
        def __init__(self, capacity: int) -> None:
            super().__init__(capacity, mode=mode, sketch_width=sketch_width)

    return Held


POLICIES: dict[str, str | type[CachePolicy]] = {
    "lru": "lru",
    "kvaware (adaptive)": "kvaware",
    "kvaware held open": held("open"),
    "kvaware held in the filter": held("filter"),
    "the filter, counts fading over 8 capacities": held("filter", sketch_width=8),
}


def head(requests: list[Request], share: float) -> list[Request]:
    """The first requests holding at least `share` of the block accesses."""
    total = sum(len(r.keys) for r in requests)
    seen = 0
    for i, req in enumerate(requests):
        seen += len(req.keys)
        if seen >= share * total:
            return requests[: i + 1]
    return requests


def hits(
    requests: list[Request],
    policy: str | type[CachePolicy],
    capacity: int,
    device_blocks: int | None,
    store_on: str,
) -> int:
    """Hits of one replay: flat without a device cache, else engine mode behind one."""
    mgr = CPUOffloadingManager(capacity, policy)
    if device_blocks is None:
        return replay_flat(requests, mgr).hits
    return replay_engine(requests, mgr, device_blocks=device_blocks, store_on=store_on).hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path, help="a Mooncake-format JSONL trace")
    ap.add_argument("--mode", choices=("flat", "engine"), default="engine")
    # No defaults here: given with --mode flat, they would be ignored (resolved below).
    ap.add_argument("--store", choices=STORE_ON, help="engine mode: when stores happen (on-evict)")
    ap.add_argument("--device", help="engine mode: device cache size (1%%)")
    ap.add_argument("--capacity", default="10%", help="CPU tier size")
    ap.add_argument("--split", type=float, default=0.5, help="the head's share of accesses")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not 0.0 < args.split < 1.0:
        ap.error(f"--split {args.split} is invalid; expected a share between 0 and 1")
    engine_only = [f"{flag} {value}" for flag, value in (("--device", args.device),
                   ("--store", args.store)) if value is not None]  # fmt: skip
    if engine_only and args.mode != "engine":
        ap.error(f"{', '.join(engine_only)}: only with --mode engine; the mode here is flat")
    store = args.store or "on-evict"
    require_writable(ap, args.json, inputs=[args.trace])
    require_file(ap, "trace", args.trace)
    try:
        trace = read_trace(args.trace)
    except ValueError as e:  # TraceFormatError: the file and line, and what is wrong there
        ap.error(f"trace: {e}")
    unique = trace.num_unique_blocks
    device_blocks = None
    # parse_capacity's message says "capacity '0'" for either flag: name the one at fault.
    try:
        capacity, _ = parse_capacity(args.capacity, unique_blocks=unique)
    except ValueError as e:
        ap.error(f"--capacity: {e}")
    if args.mode == "engine":
        try:
            device_blocks, _ = parse_capacity(args.device or "1%", unique_blocks=unique)
        except ValueError as e:
            ap.error(f"--device: {e}")
    whole = trace.requests
    first = head(whole, args.split)
    n_first = sum(len(r.keys) for r in first)
    n_rest = trace.num_blocks - n_first
    if n_rest == 0:
        ap.error(f"--split {args.split}: the head of {args.trace.name} is the whole trace "
                 f"({len(first):,} requests); no tail is left to compare")  # fmt: skip
    where = args.mode
    if device_blocks is not None:
        where += f", device {device_blocks:,} blocks, store {store}"
    print(
        f"{args.trace.name}: {where}, CPU tier {capacity:,} blocks; head = first {len(first):,} "
        f"requests ({n_first:,} accesses), tail = the other {n_rest:,}"
    )
    print(f"{'policy':46} {'head %':>8} {'tail %':>8} {'whole %':>8}")
    rows: list[dict[str, float | str]] = []
    for name, policy in POLICIES.items():
        h_first = hits(first, policy, capacity, device_blocks, store)
        h_all = hits(whole, policy, capacity, device_blocks, store)
        ratios = (h_first / n_first, (h_all - h_first) / n_rest, h_all / trace.num_blocks)
        keys = ("head_hit_ratio", "tail_hit_ratio", "whole_hit_ratio")
        rows.append({"policy": name, **dict(zip(keys, ratios, strict=True))})
        print(f"{name:46} " + " ".join(f"{100 * x:8.2f}" for x in ratios), flush=True)
    if args.json:
        write_results(args.json, json.dumps(rows, indent=2))


if __name__ == "__main__":
    run_main(main)
