"""Host time per submit and GPU time per job of the CUDA worker's submit paths, side by side.

The paths: "compiled" (each job launched by its submitter), "coalesced" (the compiled engine's
launch threads, `--coalesce-depth` batches queued per lane, the jobs behind them merged) and
"torch" (torch ops). For each (page, blocks per job), the paths take turns, in an order that
rotates every round, as does the order of the directions (so that none always runs first, on
a colder or warmer machine): a burst of `--jobs` jobs (fewer where the region holds fewer) of
random device blocks and random slots is submitted with nothing in flight before it, then
waited for.
Per path and direction it reports medians over the rounds (the first is a warm-up) of:
the median `submit_*` call, the burst's wall time per job (first submit to last job done), and
the median job's GPU time from its own events (`TransferResult.seconds`; a merged batch's time
is shared among its jobs by their bytes). A path is host bound where the submit is longer
than the GPU time.

    python benchmarks/cuda_submit.py                       # needs a CUDA device
    python benchmarks/cuda_submit.py --cases 256x16 1024x1 --rounds 7 --json out/submit.json
    python benchmarks/cuda_submit.py --paths compiled coalesced --cases 256x1 1024x1 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch
from rich.table import Table

from _bench import KiB, parse_case, run_burst, show_and_save
from _cli import at_least, positive_int, progress, require_distinct, require_writable, run_main
from kvtier.transfer import HostPool, KVCacheRegistration, KVTensor
from kvtier.transfer.cuda_worker import CUDATransferWorker

PATHS = ("compiled", "coalesced", "torch")


def rotated(items: list[str], r: int) -> list[str]:
    """Round `r`'s order of `items` (paths, directions): each leads once every `len(items)`
    rounds."""
    k = r % len(items)
    return items[k:] + items[:k]


def burst_sizes(rows: list[dict[str, object]], asked: int) -> str:
    """The jobs a burst that `rows` ran, for a title: `bench_case` runs fewer than `asked`
    where the region holds fewer jobs' blocks."""
    used = sorted({int(r["jobs"]) for r in rows}) or [asked]  # type: ignore[call-overload]
    if len(used) == 1:
        return f"{used[0]} jobs a burst"
    return f"{used[0]}-{used[-1]} jobs a burst, by case"


def bench_case(
    page: int, blocks: int, jobs: int, rounds: int, region: int, rng: np.random.Generator,
    paths: list[str], depth: int,
) -> list[dict[str, object]]:  # fmt: skip
    """Rows for one (page, blocks per job): every path, both directions."""
    num_blocks = region // page
    jobs = min(jobs, num_blocks // blocks)
    dev = torch.empty(num_blocks, page, dtype=torch.uint8, device="cuda")
    dev.fill_(7)
    reg = KVCacheRegistration([KVTensor(dev, 0)])
    pool = HostPool(reg, 1, num_slots=num_blocks)
    kwargs = {
        "compiled": {"compiled": True},
        "coalesced": {"compiled": True, "coalesce_depth": depth},
        "torch": {"compiled": False},
    }
    workers = {p: CUDATransferWorker(reg, pool, **kwargs[p]) for p in paths}  # type: ignore[arg-type]
    seen: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    next_id = 0
    for r in range(rounds + 1):
        for path in rotated(list(workers), r):
            w = workers[path]
            for direction in rotated(["store", "load"], r):
                d = rng.permutation(num_blocks)[: jobs * blocks].reshape(jobs, blocks)
                h = rng.permutation(num_blocks)[: jobs * blocks].reshape(jobs, blocks)
                torch.cuda.synchronize()
                burst = run_burst(w, direction, d, h, next_id, time_each=True)
                next_id += jobs
                if r:  # round 0 warms every path up
                    gpu = statistics.median(x.seconds for x in burst.results)
                    seen.setdefault((path, direction), []).append(
                        (statistics.median(burst.each), burst.wall / jobs, gpu)
                    )
    for w in workers.values():
        w.shutdown()
    pool.close()
    rows: list[dict[str, object]] = []
    for path in workers:  # in the order asked for, whichever ran first in a round
        for direction in ("store", "load"):
            values = seen[path, direction]
            submit, wall, gpu = (statistics.median(v[i] for v in values) for i in range(3))
            rows.append(
                {
                    "path": path, "direction": direction, "page_bytes": page,
                    "blocks_per_job": blocks, "jobs": jobs, "submit_us": submit * 1e6,
                    "wall_us": wall * 1e6, "gpu_us": gpu * 1e6,
                    "gbps": page * blocks / wall / 1e9,
                }
            )  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run every case, print the table, write JSON if asked."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cases = ("256x16", "1024x1", "64x16", "256x1", "16x128")
    ap.add_argument("--cases", type=parse_case, nargs="+", default=[parse_case(c) for c in cases],
                    help="PAGE_KIBxBLOCKS per job")  # fmt: skip
    ap.add_argument("--jobs", type=positive_int, default=256, help="jobs per burst")
    ap.add_argument("--rounds", type=positive_int, default=3, help="timed rounds after a warm-up")
    ap.add_argument("--region-mib", type=positive_int, default=1024,
                    help="device and host memory each")  # fmt: skip
    ap.add_argument("--seed", type=at_least(0), default=0)
    ap.add_argument("--paths", choices=PATHS, nargs="+", default=list(PATHS))
    ap.add_argument("--coalesce-depth", type=positive_int, default=2,
                    help="the coalesced path's batches queued on the GPU per lane")  # fmt: skip
    ap.add_argument("--json", metavar="FILE", help="write the rows as a JSON list")
    args = ap.parse_args(argv)
    # Else the case's (or path's) rows print twice; refused before the device check.
    require_distinct(ap, "--cases", [f"{p // KiB}x{b}" for p, b in args.cases], "case")
    require_distinct(ap, "--paths", args.paths, "path")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    for page, blocks in args.cases:
        if (args.region_mib << 20) // page < blocks:
            ap.error(f"--region-mib {args.region_mib} holds fewer than the {blocks} pages of "
                     f"{page // KiB} KiB a job of case {page // KiB}x{blocks} moves")  # fmt: skip
    require_writable(ap, args.json)
    rng = np.random.default_rng(args.seed)
    rows: list[dict[str, object]] = []
    for i, (page, blocks) in enumerate(args.cases, 1):
        rows += bench_case(
            page, blocks, args.jobs, args.rounds, args.region_mib << 20, rng, args.paths,
            args.coalesce_depth,
        )  # fmt: skip
        progress(f"{page // KiB} KiB x {blocks}: done ({i} of {len(args.cases)})")
    table = Table(title="CUDA worker: host time per submit and GPU time per job "
                  f"({burst_sizes(rows, args.jobs)}, medians of {args.rounds} rounds)")  # fmt: skip
    for col in ("page", "blocks/job", "path", "direction", "submit µs", "wall µs/job",
                "GPU µs/job", "GB/s"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{int(r['page_bytes']) // KiB} KiB", str(r["blocks_per_job"]), str(r["path"]),  # type: ignore[call-overload]
            str(r["direction"]), f"{r['submit_us']:.1f}", f"{r['wall_us']:.1f}",
            f"{r['gpu_us']:.1f}", f"{r['gbps']:.1f}",
        )  # fmt: skip
    show_and_save(table, rows, args.json)


if __name__ == "__main__":
    run_main(main)
