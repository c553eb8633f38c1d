"""Replay speed of the trace simulator (`kvtier simulate`) on the Mooncake conversation trace.

Replays the whole trace at four capacities for each policy through the real CPU-tier manager,
once in this process (per-run blocks/s, median over the capacities) and once spread over
worker processes as `kvtier simulate` does by default (end-to-end wall time of the grid).

    python benchmarks/sim_speed.py [--trace FILE] [--jobs N] [--mode flat|engine] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from _cli import (
    positive_int,
    progress,
    require_distinct,
    require_file,
    require_known,
    require_writable,
    run_main,
    write_results,
)
from kvtier.policies import registered_policies
from kvtier.sim.readers import read_trace
from kvtier.sim.runner import BOUNDS, ReplayOptions, default_jobs, run_grid
from kvtier.sim.shapes import parse_capacity

DEFAULT_TRACE = (
    Path(__file__).parents[1] / "data/traces/mooncake_conversation/conversation_trace.jsonl"
)


def main() -> int:
    """Run the benchmark; print a table and optionally write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--policies", default="lru,arc,s3fifo,sieve,opt")
    p.add_argument("--capacities", default="1%,5%,10%,25%")
    p.add_argument("--mode", choices=("flat", "engine"), default="flat")
    p.add_argument("--jobs", type=positive_int, default=default_jobs())
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    policies = args.policies.split(",")
    require_known(p, "--policies", policies, [*registered_policies(), *BOUNDS])
    require_distinct(p, "--policies", policies)
    require_writable(p, args.json, inputs=[args.trace])
    require_file(p, "--trace", args.trace)

    t0 = time.perf_counter()
    try:
        trace = read_trace(args.trace)
    except ValueError as e:  # TraceFormatError: the file and line, and what is wrong there
        p.error(f"--trace: {e}")
    read_s = time.perf_counter() - t0
    unique = trace.num_unique_blocks
    try:
        caps = [parse_capacity(c, unique_blocks=unique)[0] for c in args.capacities.split(",")]
    except ValueError as e:
        p.error(f"--capacities: {e}")  # the message names the value, not the flag
    # As `kvtier simulate` does: a capacity given twice (1% and its block count too) would be
    # replayed twice, and weigh twice in the median.
    caps = list(dict.fromkeys(caps))
    opts = ReplayOptions(
        mode=args.mode, device_blocks=round(0.01 * unique) if args.mode == "engine" else 0
    )
    runs = [(pol, c) for pol in policies for c in caps]

    # CPU time as well as wall time: the machine is shared, and CPU seconds of a single-process
    # grid say what the replay costs when nothing else runs.
    progress(f"{len(runs)} replays in this process ...")
    t0, c0 = time.perf_counter(), time.process_time()
    serial = []
    for i, pol in enumerate(policies, 1):
        # A line per policy: the grid takes 25-70 s here, silent after its first line.
        serial += run_grid(trace, [(pol, c) for c in caps], opts, jobs=1)
        progress(f"  {pol}: done ({i} of {len(policies)})")
    serial_s, serial_cpu = time.perf_counter() - t0, time.process_time() - c0
    progress(f"... {serial_s:.1f} s; the same over {args.jobs} processes ...")
    t0 = time.perf_counter()
    run_grid(trace, runs, opts, jobs=args.jobs)
    parallel_s = time.perf_counter() - t0

    per_policy = []
    for pol in policies:
        mine = [r for r in serial if r.policy == pol]
        per_policy.append(
            {
                "policy": pol,
                "median_blocks_per_s": statistics.median(r.blocks_per_s for r in mine),
                "seconds": sum(r.seconds for r in mine),
                "block_hit_ratios": [r.block_hit_ratio for r in mine],
            }
        )
    result = {
        "trace": str(args.trace),
        "mode": args.mode,
        "requests": len(trace),
        "blocks": trace.num_blocks,
        "capacities_blocks": caps,
        "read_seconds": read_s,
        "grid_seconds_serial": serial_s,
        "grid_cpu_seconds_serial": serial_cpu,
        "grid_seconds_parallel": parallel_s,
        "jobs": args.jobs,
        "per_policy": per_policy,
    }
    print(f"{trace!r}, mode {args.mode}, capacities {caps}")
    print(f"{'policy':<8} {'median blocks/s':>16} {f'seconds ({len(caps)} runs)':>17}")
    for row in per_policy:
        print(f"{row['policy']:<8} {row['median_blocks_per_s']:>16,.0f} {row['seconds']:>17.2f}")
    print(f"read trace: {read_s:.2f} s")
    print(
        f"grid of {len(runs)} replays: {serial_s:.1f} s ({serial_cpu:.1f} CPU s) in 1 process, ",
        end="",
    )
    print(f"{parallel_s:.1f} s over {args.jobs} processes ({serial_s / parallel_s:.2f}x)")
    if args.json is not None:
        write_results(args.json, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    run_main(main)
