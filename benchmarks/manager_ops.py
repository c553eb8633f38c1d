"""Manager throughput: calls/s and blocks/s with the call sequence an engine makes per request.

Per request: on_new_request; lookup until the first miss; touch, prepare_load and complete_load
for the hits; prepare_store and complete_store for the rest; on_request_finished; take_events.
The calls counted in calls/s are those after on_new_request (which is made, and timed, but not
counted). The policies take turns, a replay each per round; medians over `--repeats` rounds.

    python benchmarks/manager_ops.py                       # Zipf workload + Mooncake trace
    python benchmarks/manager_ops.py --json out/manager_ops.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

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
from kvtier.base import LookupResult, OffloadKey, ReqContext, make_offload_key
from kvtier.cpu import CPUOffloadingManager
from kvtier.policies import registered_policies

ROOT = Path(__file__).resolve().parent.parent
MOONCAKE = ROOT / "data/traces/mooncake_conversation/conversation_trace.jsonl"

Workload = list[list[OffloadKey]]


def _key(i: int) -> OffloadKey:
    return make_offload_key(int(i).to_bytes(8, "big"), 0)


def zipf_workload(num_requests: int, seed: int = 0) -> Workload:
    """Requests that share Zipf-popular prefixes (system prompts, documents) plus own tails."""
    rng = np.random.default_rng(seed)
    num_prefixes, prefix_blocks = 2000, 16
    ranks = rng.zipf(1.1, size=num_requests) % num_prefixes
    next_id = num_prefixes * prefix_blocks
    requests: Workload = []
    for r in ranks:
        head = [
            _key(int(r) * prefix_blocks + b) for b in range(int(rng.integers(1, prefix_blocks)))
        ]
        tail_len = int(rng.integers(1, 16))
        tail = [_key(next_id + t) for t in range(tail_len)]
        next_id += tail_len
        requests.append(head + tail)
    return requests


def mooncake_workload(path: Path = MOONCAKE) -> Workload:
    """The Mooncake conversation trace: one key per 512-token prefix block. A line that is not
    a Mooncake request raises ValueError naming the file and line."""
    workload: Workload = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            try:
                workload.append([_key(h) for h in json.loads(line)["hash_ids"]])
            except (ValueError, KeyError, TypeError) as e:
                what = f"no {e} field" if isinstance(e, KeyError) else str(e)
                raise ValueError(f"{path}:{n}: not a Mooncake trace line ({what})") from None
    if not any(workload):
        # Every figure is a ratio of counts: an empty replay divided by zero at the end.
        raise ValueError(f"{path}: the trace holds no blocks; expected at least one request")
    return workload


def replay(
    workload: Workload, manager: Any, make_ctx: Callable[[str], Any], hit: object
) -> tuple[int, int, float, float]:
    """Run the engine call sequence on any manager with vLLM's method names; return
    (calls, blocks, seconds, prefix hit ratio). `hit` is the manager's HIT lookup result."""
    calls = blocks = hits = 0
    start = time.perf_counter()
    for i, chain in enumerate(workload):
        ctx = make_ctx(str(i))
        manager.on_new_request(ctx)
        n_hit = 0
        for k in chain:
            calls += 1
            if manager.lookup(k, ctx) is not hit:
                break
            n_hit += 1
        if n_hit:
            head = chain[:n_hit]
            manager.touch(head, ctx)
            manager.prepare_load(head, ctx)
            manager.complete_load(head, ctx)
            calls += 3
        rest = chain[n_hit:]
        if rest:
            out = manager.prepare_store(rest, ctx)
            calls += 1
            if out is not None:
                manager.complete_store(out.keys_to_store, ctx)
                calls += 1
        manager.on_request_finished(ctx)
        for _ in manager.take_events():
            pass
        calls += 2
        blocks += len(chain)
        hits += n_hit
    seconds = time.perf_counter() - start
    return calls, blocks, seconds, hits / max(blocks, 1)


def replay_kvtier(workload: Workload, policy: str, num_slots: int) -> tuple[int, int, float, float]:
    """`replay` through a fresh kvtier manager with events on."""
    manager = CPUOffloadingManager(num_slots, policy, enable_events=True)
    return replay(workload, manager, ReqContext, LookupResult.HIT)


def run(
    workloads: dict[str, Workload],
    policies: Sequence[str],
    repeats: int,
    log: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    rows = []
    for name, workload in workloads.items():
        unique = len({k for chain in workload for k in chain})
        num_slots = max(1, unique // 10)
        # The policies take turns, one replay each a round (the order rotating), so that the
        # machine's drift during the run reaches every policy alike.
        runs: dict[str, list[tuple[int, int, float, float]]] = {p: [] for p in policies}
        for r in range(repeats):
            k = r % len(policies)
            for policy in [*policies[k:], *policies[:k]]:
                runs[policy].append(replay_kvtier(workload, policy, num_slots))
                # A line per replay, as it ends: a workload's replays take 20 s and more (one
                # kvaware replay of Mooncake, 2-4 s), too long to wait for one line at the end.
                if log is not None:
                    last = r == repeats - 1
                    log(f"{name} {policy}: " + ("done" if last else f"{r + 1} of {repeats}"))
        for policy in policies:
            samples = runs[policy]
            seconds = statistics.median(s[2] for s in samples)
            calls, blocks, _, hit_ratio = samples[0]
            rows.append(
                {
                    "workload": name,
                    "policy": policy,
                    "num_slots": num_slots,
                    "requests": len(workload),
                    "calls": calls,
                    "blocks": blocks,
                    "seconds_median": seconds,
                    "calls_per_s": calls / seconds,
                    "blocks_per_s": blocks / seconds,
                    "prefix_hit_ratio": hit_ratio,
                }
            )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--policies", default=",".join(registered_policies()))
    parser.add_argument("--zipf-requests", type=positive_int, default=20_000)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--trace", type=Path, default=MOONCAKE)
    parser.add_argument("--json", type=Path, help="write the rows as JSON to this file")
    args = parser.parse_args(argv)
    policies = args.policies.split(",")
    require_known(parser, "--policies", policies, registered_policies())
    require_distinct(parser, "--policies", policies)
    require_file(parser, "--trace", args.trace)
    try:
        mooncake = mooncake_workload(args.trace)
    except ValueError as e:
        parser.error(f"--trace: {e}")
    # After the trace's checks: this makes --json's folders, which a refused trace left behind.
    require_writable(parser, args.json, make_parents=True, inputs=[args.trace])
    # Another trace is named after its file: its rows must not pass for Mooncake's.
    same = args.trace.resolve() == MOONCAKE.resolve()
    label = "mooncake" if same else args.trace.stem
    if label == "zipf":  # the synthetic workload's name: its rows would be overwritten
        label = "trace:zipf"
    workloads = {"zipf": zipf_workload(args.zipf_requests), label: mooncake}
    rows = run(workloads, policies, args.repeats, progress)
    w = max(9, *map(len, workloads))
    print(
        f"{'workload':<{w}} {'policy':<8} {'slots':>7} {'calls/s':>11} {'blocks/s':>11}"
        f" {'hit %':>6}"
    )
    for r in rows:
        print(
            f"{r['workload']:<{w}} {r['policy']:<8} {r['num_slots']:>7} {r['calls_per_s']:>11,.0f}"
            f" {r['blocks_per_s']:>11,.0f} {100 * r['prefix_hit_ratio']:>6.1f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_results(args.json, json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    run_main(main)
