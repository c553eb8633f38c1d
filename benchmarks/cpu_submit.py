"""Two variants of the compiled CPU worker side by side: submit paths, copy-thread placement or
backlog sharing.

`--compare submit` (default): the submit extension against ctypes, on one worker.
`--compare placement`: `avoid_submitter_cpu` on against off, two workers on one host pool.
`--compare backlog`: `share_backlog` on against off, two workers on one host pool.
One process: for each (page, blocks per job) the two variants take turns burst by burst (the
order swapped every round), so both see the same memory and the same moments of a noisy
machine. A burst moves `--moved-mib` as jobs of random device blocks and
random slots, submitted with nothing in flight, then waited for; before each pair of bursts
the ceiling is the best of three contiguous copies of the same bytes between the same two
memories (as in transfer_bw.py). Per path and direction it reports medians over the rounds:
the share of the ceiling, the submit call's mean time within a burst, the median job's copy
time on the engine's thread (`TransferResult.seconds`), and the burst's wall time per job
(first submit to last job done; where the ceiling itself is noisy, compare these). A burst
is submit bound where the submit takes longer than the copy.

    python benchmarks/cpu_submit.py
    python benchmarks/cpu_submit.py --cases 64x1 256x1 64x16 --rounds 20 --json out/cpu_submit.json
    python benchmarks/cpu_submit.py --compare placement --cases 64x1 64x16 1024x16 --rounds 14
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from _bench import KiB, parse_case, run_burst, show_and_save
from _cli import (
    at_least,
    positive_int,
    require_distinct,
    require_memory,
    require_writable,
    run_main,
)
from kvtier.transfer import HostPool, KVCacheRegistration, KVTensor, NativeCPUTransferWorker
from kvtier.transfer.native import library, submit_extension


def bench_case(
    page: int,
    blocks: int,
    moved: int,
    rounds: int,
    region: int,
    rng: np.random.Generator,
    compare: str = "submit",
) -> list[dict[str, object]]:
    """Rows for one (page, blocks per job): both variants, both directions."""
    num_blocks = region // page
    jobs = max(1, min(moved // (page * blocks), num_blocks // (2 * blocks)))
    nbytes = jobs * blocks * page
    dev = torch.empty(num_blocks, page, dtype=torch.uint8)
    dev.fill_(7)
    reg = KVCacheRegistration([KVTensor(dev, 0)])
    pool = HostPool(reg, 1, num_slots=num_blocks)
    pool.tensor.fill_(3)
    d_flat, h_flat = dev.view(-1), pool.tensor.view(-1)
    flat = {"store": (d_flat, h_flat), "load": (h_flat, d_flat)}
    # Per variant: the worker, and the submit function it is given before each burst.
    variants: dict[str, tuple[NativeCPUTransferWorker, object]] = {}
    if compare == "submit":
        worker = NativeCPUTransferWorker(reg, pool)
        variants = {"extension": (worker, worker._ext_submit), "ctypes": (worker, None)}
    elif compare == "placement":
        for name, avoid in (("avoid", True), ("anywhere", False)):
            w = NativeCPUTransferWorker(reg, pool, avoid_submitter_cpu=avoid)
            variants[name] = (w, w._ext_submit)
    else:
        for name, shared in (("shared", True), ("alone", False)):
            w = NativeCPUTransferWorker(reg, pool, share_backlog=shared)
            variants[name] = (w, w._ext_submit)

    def ceiling(direction: str) -> float:
        src, dst = flat[direction]
        best = float("inf")
        for _ in range(3):
            a = int(rng.integers(0, num_blocks * page - nbytes + 1)) // 4096 * 4096
            b = int(rng.integers(0, num_blocks * page - nbytes + 1)) // 4096 * 4096
            t = time.perf_counter()
            dst[b : b + nbytes].copy_(src[a : a + nbytes])
            best = min(best, time.perf_counter() - t)
        return nbytes / best / 1e9

    seen: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {}
    next_id = 0
    for r in range(rounds + 1):
        order = list(variants) if r % 2 else list(reversed(variants))
        for direction in ("store", "load"):
            ceil = ceiling(direction)
            time.sleep(0.05)  # let torch's copy threads go idle before the burst
            for path in order:
                worker, submit = variants[path]
                worker._ext_submit = submit
                d = rng.permutation(num_blocks)[: jobs * blocks].reshape(jobs, blocks)
                h = rng.permutation(num_blocks)[: jobs * blocks].reshape(jobs, blocks)
                burst = run_burst(worker, direction, d, h, next_id)
                next_id += jobs
                if r:  # round 0 warms both paths up
                    copy = statistics.median(x.seconds for x in burst.results)
                    seen.setdefault((path, direction), []).append(
                        (nbytes / burst.wall / 1e9 / ceil, burst.submit / jobs, copy,
                         burst.wall / jobs)
                    )  # fmt: skip
    for worker, _ in variants.values():
        worker.shutdown()
    pool.close()
    rows: list[dict[str, object]] = []
    for (path, direction), values in sorted(seen.items()):
        share, submit, copy, wall = (statistics.median(v[i] for v in values) for i in range(4))
        rows.append(
            {
                "path": path, "direction": direction, "page_bytes": page,
                "blocks_per_job": blocks, "share_of_ceiling": share,
                "share_min": min(v[0] for v in values), "share_max": max(v[0] for v in values),
                "submit_us": submit * 1e6, "copy_us": copy * 1e6, "wall_us": wall * 1e6,
            }
        )  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run every case, print the table, write JSON if asked."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=parse_case, nargs="+",
                    default=[parse_case(c) for c in ("64x1", "256x1", "64x16", "16x16")],
                    help="PAGE_KIBxBLOCKS per job")  # fmt: skip
    ap.add_argument("--compare", choices=["submit", "placement", "backlog"], default="submit",
                    help="the submit extension against ctypes, avoid_submitter_cpu on "
                    "against off, or share_backlog on against off")  # fmt: skip
    ap.add_argument("--moved-mib", type=positive_int, default=64, help="bytes moved per burst")
    ap.add_argument("--rounds", type=positive_int, default=9,
                    help="timed rounds after a warm-up")  # fmt: skip
    ap.add_argument("--region-mib", type=positive_int, default=256,
                    help="device and host memory each")  # fmt: skip
    ap.add_argument("--seed", type=at_least(0), default=0)
    ap.add_argument("--json", metavar="FILE", help="write the rows as a JSON list")
    args = ap.parse_args(argv)
    # Else the case's rows print twice, with the samples of different rounds.
    require_distinct(ap, "--cases", [f"{p // KiB}x{b}" for p, b in args.cases], "case")
    for page, blocks in args.cases:
        if (args.region_mib << 20) // page < blocks:
            ap.error(f"--region-mib {args.region_mib} holds fewer than the {blocks} pages of "
                     f"{page // KiB} KiB a job of case {page // KiB}x{blocks} moves")  # fmt: skip
    # The device region and a host pool of as many blocks, both in this machine's memory.
    region = max((args.region_mib << 20) // page * page for page, _ in args.cases)
    require_memory(ap, 2 * region, f"--region-mib {args.region_mib}")
    require_writable(ap, args.json)
    if library() is None or submit_extension() is None:
        ap.error("needs the compiled library and the submit extension (a C compiler and "
                 "Python's headers)")  # fmt: skip
    rng = np.random.default_rng(args.seed)
    rows: list[dict[str, object]] = []
    console = Console(stderr=True)
    for page, blocks in args.cases:
        rows += bench_case(page, blocks, args.moved_mib << 20, args.rounds,
                           args.region_mib << 20, rng, args.compare)  # fmt: skip
        console.log(f"{page // KiB} KiB x {blocks}: done")  # a case takes a minute or so
    what = {"submit": "submit paths", "placement": "copy-thread placement",
            "backlog": "a waiter's backlog shared or not"}[args.compare]  # fmt: skip
    table = Table(title=f"CPU worker: {what} side by side (medians of {args.rounds} rounds)")
    # The share's lowest and highest over the rounds (share_min, share_max in the JSON).
    for col in ("page", "blocks", "variant", "dir", "share", "share range", "submit µs",
                "copy µs", "wall µs"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{int(r['page_bytes']) // KiB} KiB", str(r["blocks_per_job"]), str(r["path"]),  # type: ignore[call-overload]
            str(r["direction"]), f"{100 * float(r['share_of_ceiling']):.0f}%",  # type: ignore[arg-type]
            f"{100 * float(r['share_min']):.0f}-{100 * float(r['share_max']):.0f}%",  # type: ignore[arg-type]
            f"{r['submit_us']:.2f}", f"{r['copy_us']:.2f}", f"{r['wall_us']:.2f}",
        )  # fmt: skip
    show_and_save(table, rows, args.json)


if __name__ == "__main__":
    run_main(main)
