"""kvtier side by side with vLLM 0.33's own offloading, in one run and one environment.

(a)/(b): the Mooncake conversation trace replayed through vLLM's `CPUOffloadingManager` and
kvtier's, with the same engine call sequence (benchmarks/manager_ops.py), policy and capacity.

    python benchmarks/vs_vllm.py --json out/vs_vllm.json

Needs vLLM 0.33.0 installed next to kvtier (see docs/vllm.md for the CPU-only recipe).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from manager_ops import MOONCAKE, Workload, mooncake_workload  # noqa: E402

from kvtier.base import ReqContext  # noqa: E402
from kvtier.cpu import CPUOffloadingManager  # noqa: E402


def _replay(
    workload: Workload, manager: Any, make_ctx: Callable[[str], Any], hit: object
) -> tuple[int, float, float]:
    """The engine call sequence of manager_ops.replay, for any manager with vLLM's API."""
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
    return calls, time.perf_counter() - start, hits / blocks


def compare_managers(
    workload: Workload, policies: Sequence[str], num_slots: int, repeats: int
) -> dict[str, dict[str, float]]:
    """Calls/s and prefix hit ratio of both managers, alternating runs so noise hits both."""
    from vllm.v1.kv_offload.base import LookupResult as VLookup
    from vllm.v1.kv_offload.base import ReqContext as VReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VManager

    from kvtier.base import LookupResult

    out: dict[str, dict[str, float]] = {}
    for policy in policies:
        v_rates, k_rates = [], []
        v_hit = k_hit = 0.0
        for _ in range(repeats):
            vm = VManager(num_slots, cache_policy=policy, enable_events=True)
            calls, secs, v_hit = _replay(workload, vm, VReqContext, VLookup.HIT)
            v_rates.append(calls / secs)
            km = CPUOffloadingManager(num_slots, policy, enable_events=True)
            calls, secs, k_hit = _replay(workload, km, ReqContext, LookupResult.HIT)
            k_rates.append(calls / secs)
        v, k = statistics.median(v_rates), statistics.median(k_rates)
        out[policy] = {
            "vllm_calls_per_s": v,
            "kvtier_calls_per_s": k,
            "speedup": k / v,
            "vllm_hit_ratio": v_hit,
            "kvtier_hit_ratio": k_hit,
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--policies", default="lru,arc")
    parser.add_argument("--capacity", type=float, default=0.10, help="share of unique blocks")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trace", type=Path, default=MOONCAKE)
    parser.add_argument("--json", type=Path, help="write the results as JSON to this file")
    args = parser.parse_args(argv)

    workload = mooncake_workload(args.trace)
    unique = len({k for chain in workload for k in chain})
    num_slots = max(1, int(args.capacity * unique))
    manager = compare_managers(workload, args.policies.split(","), num_slots, args.repeats)
    print(f"manager, Mooncake trace, {num_slots} slots ({args.capacity:.0%} of unique blocks)")
    print(f"{'policy':<7} {'vLLM calls/s':>13} {'kvtier calls/s':>15} {'ratio':>6} "
          f"{'vLLM hit %':>10} {'kvtier hit %':>12}")
    for policy, r in manager.items():
        print(
            f"{policy:<7} {r['vllm_calls_per_s']:>13,.0f} {r['kvtier_calls_per_s']:>15,.0f}"
            f" {r['speedup']:>5.2f}x {100 * r['vllm_hit_ratio']:>10.2f}"
            f" {100 * r['kvtier_hit_ratio']:>12.2f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"manager": manager}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
