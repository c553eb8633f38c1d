"""Registration speed: `KVCacheRegistration` of one tensor whose block dimension comes after a
large one, so that it splits into PARTS segments, one per index of that dimension. The parts
lie one after the other ("contiguous", a `(parts, blocks, width)` buffer) or interleave with
one stride ("interleaved", a block-major `(blocks, parts, width)` buffer viewed so). The
overlap check compared every part with every earlier one, O(n²); it is O(n log n) now.

    python benchmarks/registration_speed.py [--parts 4096,65536] [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from _cli import (
    int_list,
    positive_int,
    progress,
    require_distinct,
    require_memory,
    require_writable,
    run_main,
    write_results,
)
from kvtier.transfer import KVCacheRegistration, KVTensor

ARRANGEMENTS = ("contiguous", "interleaved")
NUM_BLOCKS, WIDTH = 4, 16  # a part's rows: 4 blocks of 16 bytes


def kv_tensor(parts: int, arrangement: str) -> KVTensor:
    """The tensor of `parts` parts as `arrangement` lays them out, blocks on dimension 1."""
    if arrangement == "contiguous":
        t = torch.zeros(parts, NUM_BLOCKS, WIDTH, dtype=torch.uint8)
    else:
        t = torch.zeros(NUM_BLOCKS, parts, WIDTH, dtype=torch.uint8).transpose(0, 1)
    return KVTensor(t, 1)


def seconds(kv: KVTensor) -> float:
    """Wall time of one registration of `kv`, checked to count every byte."""
    t0 = time.perf_counter()
    reg = KVCacheRegistration([kv])
    elapsed = time.perf_counter() - t0
    assert reg.page_bytes() == kv.tensor.shape[0] * WIDTH, "a part was dropped"
    return elapsed


def both_arrangements(parts: int, repeats: int) -> dict[str, list[float]]:
    """`repeats` timings of each arrangement, alternated (and which goes first too) so that
    the machine's drift reaches both, after one untimed registration of each: the first of a
    process pays one-off costs (about 14x a warm one at 1,024 parts), which a median of one or
    two runs would report as the registration's time."""
    kvs = {a: kv_tensor(parts, a) for a in ARRANGEMENTS}
    for kv in kvs.values():
        KVCacheRegistration([kv])
    times: dict[str, list[float]] = {a: [] for a in ARRANGEMENTS}
    for i in range(repeats):
        for a in ARRANGEMENTS if i % 2 == 0 else ARRANGEMENTS[::-1]:
            times[a].append(seconds(kvs[a]))
    return times


def main() -> None:
    """Run the benchmark; print a table and optionally write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--parts", type=int_list(1), default=[1024, 4096, 16384, 65536])
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    require_distinct(p, "--parts", args.parts, "count")  # else rows print twice
    # The largest tensor, before any run: else a huge --parts ends in torch's allocation
    # traceback, after the smaller ones have run.
    need = max(args.parts) * NUM_BLOCKS * WIDTH
    require_memory(p, need, f"--parts {max(args.parts)}")
    require_writable(p, args.json)

    results: list[tuple[int, str, list[float]]] = []
    for parts in args.parts:
        progress(f"{parts} parts ...")
        timed = both_arrangements(parts, args.repeats)
        results += [(parts, arrangement, timed[arrangement]) for arrangement in ARRANGEMENTS]
    print(f"{'parts':>7} {'arrangement':<12} {'median s':>9} {'µs/part':>8}")
    for parts, arrangement, times in results:
        median = statistics.median(times)
        print(f"{parts:>7} {arrangement:<12} {median:>9.3f} {median / parts * 1e6:>8.1f}")
    if args.json is not None:
        rows = [{"parts": parts, "arrangement": arrangement, "seconds": times,
                 "median_seconds": statistics.median(times)}
                for parts, arrangement, times in results]  # fmt: skip
        write_results(args.json, json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    run_main(main)
