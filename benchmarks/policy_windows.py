"""Policies against LRU on short windows of a trace: each window replayed alone, flat mode, at
shares of its own unique blocks.

A short trace is where an adaptive policy is weakest: its evidence is thin and each change of
mode costs the cache more of the run (docs/kvaware-evaluation.md, "Short traces"). Windows of
500, 1,000 and 3,000 requests at four evenly spaced starts give 48 cells per policy and trace,
each printed as policy − LRU in points.

    python benchmarks/policy_windows.py TRACE [TRACE ...] [--policies kvaware,arc]
        [--sizes 500,1000,3000] [--starts 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _cli import (
    int_list,
    positive_int,
    require_distinct,
    require_file,
    require_writable,
    run_main,
    write_results,
)
from kvtier.cpu import CPUOffloadingManager
from kvtier.policies import registered_policies
from kvtier.policies.base import CachePolicy
from kvtier.sim import read_trace
from kvtier.sim.replay import replay_flat
from kvtier.sim.trace import Request, Trace
from policy_phases import held

SHARES = (0.01, 0.05, 0.10, 0.25)

# kvaware fixed in one mode, beside the registered policies: what the adaptive policy would
# get if it never changed mode.
HELD: dict[str, type[CachePolicy]] = {
    "kvaware-open": held("open"),
    "kvaware-filter": held("filter"),
}


def windows(requests: list[Request], size: int, starts: int) -> list[int]:
    """Up to `starts` evenly spaced first indices of `size`-request windows (none when the
    trace is shorter than one window)."""
    if size > len(requests):
        return []
    last = len(requests) - size
    if starts == 1:
        return [0]
    step = max(1, last // (starts - 1))
    return sorted({min(last, i * step) for i in range(starts)})


def hit_pct(trace: Trace, policy: str, share: float) -> float:
    capacity = max(1, round(share * trace.num_unique_blocks))
    mgr = CPUOffloadingManager(capacity, HELD.get(policy, policy))
    return 100 * replay_flat(trace, mgr).block_hit_ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", type=Path, nargs="+", help="Mooncake-format JSONL traces")
    ap.add_argument(
        "--policies",
        default="kvaware,arc,s3fifo",
        help="registered policies, or kvaware-open / kvaware-filter (kvaware held in one mode)",
    )
    # Typed so that a refusal names the one flag at fault and what it takes.
    ap.add_argument(
        "--sizes", type=int_list(1), default=[500, 1000, 3000], help="requests a window"
    )
    ap.add_argument("--starts", type=positive_int, default=4, help="windows per size and trace")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    policies = args.policies.split(",")
    known = sorted(registered_policies()) + sorted(HELD)
    unknown = sorted(set(policies) - set(known))
    if unknown:
        ap.error(f"unknown policies {unknown}; expected some of {known}")
    require_distinct(ap, "--policies", policies)
    # Else each of its windows is replayed and counted twice in the summary.
    require_distinct(ap, "--sizes", args.sizes, "size")
    require_writable(ap, args.json, inputs=args.traces)
    for path in args.traces:
        require_file(ap, "trace", path)
    # Read before the table starts: a bad trace is one error line, not a half-printed table.
    traces: dict[Path, list[Request]] = {}
    for path in args.traces:
        try:
            traces[path] = read_trace(path).requests
        except ValueError as e:  # TraceFormatError: the file and line, and what is wrong there
            ap.error(f"trace: {e}")
    rows: list[dict[str, object]] = []
    # Per trace and policy, as docs/kvaware-evaluation.md reports them: pooled over the traces,
    # the summary of `conversation synthetic` said "of 96 cells" and mixed the two.
    diffs: dict[tuple[Path, str], list[float]] = {(t, p): [] for t in traces for p in policies}
    print(f"{'window':34} {'policy':14} − LRU at " + " / ".join(f"{s:.0%}" for s in SHARES))
    for path, requests in traces.items():
        for size in args.sizes:
            for start in windows(requests, size, args.starts):
                trace = Trace(requests[start : start + size], name=path.name)
                lru = [hit_pct(trace, "lru", s) for s in SHARES]
                for policy in policies:
                    pct = [hit_pct(trace, policy, s) for s in SHARES]
                    diff = [p - q for p, q in zip(pct, lru, strict=True)]
                    diffs[path, policy] += diff
                    rows.append(
                        {"trace": path.name, "start": start, "requests": size, "policy": policy}
                        | {"lru_pct": lru, "pct": pct, "minus_lru": diff}
                    )
                    label = f"{path.name}[{start}:{start + size}]"
                    # Flushed: the rows are the progress of a run of minutes, also when piped.
                    cells = " ".join(f"{d:+6.2f}" for d in diff)
                    print(f"{label:34} {policy:14} {cells}", flush=True)
    print()
    for (path, policy), gaps in diffs.items():
        # Below zero, as policy_fuzz.py and policy_stress.py count: a loss that rounds to
        # -0.00 is still a loss.
        below = [d for d in gaps if d < 0]
        print(
            f"{path.name}, {policy}: {len(below)} of {len(gaps)} cells below LRU, losses "
            f"summing to {sum(below):.2f} (worst {min(below, default=0.0):+.2f}); mean − LRU "
            f"{sum(gaps) / max(1, len(gaps)):+.2f}"
        )
    if args.json:
        write_results(args.json, json.dumps(rows, indent=2))


if __name__ == "__main__":
    run_main(main)
