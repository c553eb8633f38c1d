"""Store and load throughput of kvtier's transfer worker next to a contiguous-copy ceiling.

For each page size and job size (blocks per job) it registers one KV tensor of
`(num_blocks, page_bytes)`, stores random device blocks into random host slots (and loads them
back into other random blocks) with many jobs in flight, and times the same number of bytes
copied as one contiguous copy between the same two memories in the same run, alternating the
two so both see the same machine noise. Figures are medians.

    python benchmarks/transfer_bw.py                    # CPU here, CUDA where present
    python benchmarks/transfer_bw.py --backend cpu --json out/transfer_bw.json
    python benchmarks/transfer_bw.py --backend cpu --cpu-worker python   # the Python copy thread
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from rich.table import Table

from _bench import KiB, show_and_save, sync
from _cli import (
    at_least,
    positive_int,
    progress,
    require_distinct,
    require_memory,
    require_writable,
    run_main,
)
from kvtier.transfer import (
    CPUTransferWorker,
    HostPool,
    KVCacheRegistration,
    KVTensor,
    TransferWorker,
    make_transfer_worker,
)

MiB = 1 << 20


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def bench_page(
    backend: str,
    device: torch.device,
    page: int,
    batches: list[int],
    region: int,
    moved: int,
    repeats: int,
    rng: np.random.Generator,
    pageable: bool = False,
    copy_mode: str = "auto",
    cpu_worker: str = "auto",
    settle: float = 0.0,
    copy_threads: int | None = None,
    copy_cpus: list[int] | None = None,
    cuda_path: str = "auto",
    coalesce_depth: int = 0,
) -> list[dict[str, object]]:
    """Rows for one page size: store and load for every batch size."""
    num_blocks = max(region // page, 2 * max(batches))
    dev = torch.empty(num_blocks, page, dtype=torch.uint8, device=device)
    dev.fill_(7)  # touch every page before timing
    reg = KVCacheRegistration([KVTensor(dev, 0)])
    pool = HostPool(reg, 1, num_slots=num_blocks, pin=False if pageable else None)
    pool.tensor.fill_(3)
    if copy_cpus:
        # As an engine that gives the copy threads their own cores would: the submitting
        # thread stays off them. Set after the fills, so torch's OpenMP threads (created by
        # the first parallel op, inheriting the creator's CPUs) keep every CPU for the ceiling.
        others = set(range(os.cpu_count() or 1)) - set(copy_cpus)
        if others:
            os.sched_setaffinity(0, others)
    dev_flat, host_flat = dev.view(-1), pool.tensor.view(-1)
    rows: list[dict[str, object]] = []
    kwargs: dict[str, object] = {}
    if backend == "cuda" and not pageable:
        kwargs = {
            "copy_mode": copy_mode,
            "compiled": {"auto": None, "compiled": True}.get(cuda_path, False),
        }
        if coalesce_depth:
            kwargs["coalesce_depth"] = coalesce_depth
    worker: TransferWorker
    if backend == "cpu" and cpu_worker == "python":
        worker = CPUTransferWorker(reg, pool)
    else:
        if backend == "cpu" and copy_threads is not None:
            kwargs["copy_threads"] = copy_threads
        if backend == "cpu" and copy_cpus is not None:
            kwargs["copy_cpus"] = copy_cpus
        worker = make_transfer_worker(reg, pool, backend, **kwargs)
    name = type(worker).__name__
    with worker:
        next_id = 0
        for blocks in batches:
            jobs = max(1, min(moved // (blocks * page), num_blocks // blocks))
            nbytes = jobs * blocks * page

            def run(direction: str, jobs: int = jobs, blocks: int = blocks) -> float:
                nonlocal next_id
                ids = []
                dev_ids = rng.permutation(num_blocks)[: jobs * blocks].reshape(jobs, blocks)
                slot_ids = rng.permutation(num_blocks)[: jobs * blocks].reshape(jobs, blocks)

                def go() -> None:
                    nonlocal next_id
                    for j in range(jobs):
                        if direction == "store":
                            worker.submit_store(next_id, dev_ids[j], slot_ids[j])
                        else:
                            worker.submit_load(next_id, slot_ids[j], dev_ids[j])
                        ids.append(next_id)
                        next_id += 1
                    worker.wait(ids)

                seconds = _timed(go, device)
                results = worker.get_finished()
                assert all(r.success for r in results), "a benchmark transfer failed"
                return seconds

            def ceiling(direction: str, nbytes: int = nbytes) -> float:
                def copy() -> None:
                    # Same number of bytes, same two memories, at a random place in each
                    # (a new one per copy, so that no copy finds its bytes in the cache).
                    a = int(rng.integers(0, num_blocks * page - nbytes + 1)) // 4096 * 4096
                    b = int(rng.integers(0, num_blocks * page - nbytes + 1)) // 4096 * 4096
                    src, dst = (
                        (dev_flat, host_flat) if direction == "store" else (host_flat, dev_flat)
                    )
                    dst[b : b + nbytes].copy_(src[a : a + nbytes], non_blocking=True)

                # Best of three back to back: the first wakes idle threads (and vCPUs), so
                # the ceiling is the copy at its best, never flattered by a slow start.
                return min(_timed(copy, device) for _ in range(3))

            times: dict[str, list[float]] = {"store": [], "load": []}
            ceil: dict[str, list[float]] = {"store": [], "load": []}
            for direction in ("store", "load"):
                run(direction)  # warm-up
                ceiling(direction)
                for _ in range(repeats):
                    ceil[direction].append(ceiling(direction))
                    # torch's OpenMP threads spin for a while after its parallel copy, and a
                    # worker's copy threads started meanwhile would share the cores with them.
                    # The run starts from an idle machine, as a burst of submits does.
                    time.sleep(settle)
                    times[direction].append(run(direction))
                rows.append(
                    {
                        "backend": backend
                        + ("-python" if name == "CPUTransferWorker" else "")
                        + ("-pageable" if pageable else "")
                        + (f"-{copy_mode}" if backend == "cuda" else "")
                        + ("-torch" if getattr(worker, "copy_path", "") == "torch" else "")
                        + (f"-cpus{','.join(map(str, copy_cpus))}" if copy_cpus else ""),
                        "direction": direction,
                        "page_bytes": page,
                        "blocks_per_job": blocks,
                        "gbps": nbytes / statistics.median(times[direction]) / 1e9,
                        "ceiling_gbps": nbytes / statistics.median(ceil[direction]) / 1e9,
                    }
                )
    pool.close()
    return rows


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run every page size, print the table, write JSON if asked."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--pages-kib", type=positive_int, nargs="+",
                    default=[8, 16, 64, 256, 1024, 2048])  # fmt: skip
    ap.add_argument("--batches", type=positive_int, nargs="+", default=[1, 16, 128])
    ap.add_argument("--region-mib", type=positive_int, default=256,
                    help="device and host memory each")  # fmt: skip
    ap.add_argument("--moved-mib", type=positive_int, default=64,
                    help="bytes moved per measurement")  # fmt: skip
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--seed", type=at_least(0), default=0)
    ap.add_argument("--json", metavar="FILE", help="write the rows as a JSON list")
    ap.add_argument("--copy-mode", choices=["auto", "kernel", "dma"], default="auto",
                    help="CUDA: index kernels through mapped memory, or batched DMA")  # fmt: skip
    ap.add_argument("--cuda-path", choices=["auto", "compiled", "torch"], default="auto",
                    help="CUDA: submit through the compiled engine (where it builds), or "
                    "through torch ops")  # fmt: skip
    ap.add_argument("--coalesce-depth", type=at_least(0), default=0,
                    help="CUDA, compiled path: launch threads that keep this many batches "
                    "queued per lane and merge the jobs behind them (0: off)")  # fmt: skip
    ap.add_argument("--cpu-worker", choices=["auto", "python"], default="auto",
                    help="CPU: the factory's worker (compiled copy thread where it builds), or "
                    "CPUTransferWorker (Python copy thread)")  # fmt: skip
    ap.add_argument("--copy-threads", type=positive_int, default=None,
                    help="CPU: the compiled worker's copy threads (default: torch's, "
                    "at most 8)")  # fmt: skip
    ap.add_argument("--copy-cpus", type=at_least(0), nargs="+", default=None,
                    help="CPU: confine the compiled worker's copy threads to these CPUs, "
                    "and the submitting thread to the others (default: anywhere)")  # fmt: skip
    ap.add_argument("--settle-ms", type=float, default=50.0,
                    help="pause between the ceiling copies and the timed run, so that "
                    "torch's OpenMP threads stop spinning (0: back to back)")  # fmt: skip
    ap.add_argument(
        "--pageable", action="store_true", help="leave the host pool unpinned (CUDA fallback)"
    )
    args = ap.parse_args(argv)
    # Else the size's rows print (and are saved) twice, each pair timed at different moments.
    require_distinct(ap, "--pages-kib", args.pages_kib, "size")
    require_distinct(ap, "--batches", args.batches, "size")
    require_distinct(ap, "--copy-cpus", args.copy_cpus or [], "CPU")
    if args.coalesce_depth and args.cuda_path == "torch":
        ap.error("--coalesce-depth needs the compiled path, not --cuda-path torch")
    if args.copy_cpus and args.cpu_worker == "python":
        ap.error("--copy-cpus places the compiled worker's threads; not with --cpu-worker python")
    # Else ignored, and the rows, labelled as any other run's, pass for the count asked for.
    if args.copy_threads is not None and args.cpu_worker == "python":
        ap.error("--copy-threads sets the compiled worker's threads; not with --cpu-worker python")
    backend = args.backend
    if backend == "auto":
        backend = "cuda" if torch.cuda.is_available() else "cpu"
    elif backend == "cuda" and not torch.cuda.is_available():
        ap.error(f"--backend cuda: no CUDA device is visible to torch {torch.__version__}")
    # Else ignored on CPU, --pageable even naming the rows "cpu-pageable" for a plain run.
    cuda_only = [flag for flag, given in (("--pageable", args.pageable),
                 ("--copy-mode", args.copy_mode != "auto"),
                 ("--cuda-path", args.cuda_path != "auto")) if given]  # fmt: skip
    if cuda_only and backend != "cuda":
        ap.error(f"{', '.join(cuda_only)}: only with --backend cuda; the backend here is cpu")
    if args.coalesce_depth and backend != "cuda":
        ap.error("--coalesce-depth sets the CUDA backend's launch threads; the backend is cpu")
    if args.copy_threads is not None and backend != "cpu":
        ap.error("--copy-threads sets the CPU backend's copy threads; the backend here is cuda")
    if args.copy_cpus and backend != "cpu":
        ap.error("--copy-cpus places the CPU backend's copy threads; the backend here is cuda")
    cpus = os.cpu_count() or 1
    if args.copy_cpus and max(args.copy_cpus) >= cpus:
        ap.error(f"--copy-cpus {args.copy_cpus}: this machine has CPUs 0 to {cpus - 1}")
    if not 0 <= args.settle_ms <= 60_000:  # also nan and inf, which time.sleep refuses late
        ap.error(f"--settle-ms {args.settle_ms} is invalid; expected 0 to 60000")
    # Per page size, as bench_page allocates them: the device region, and a host pool of as
    # many blocks (both in this machine's memory on CPU).
    region = max(
        max(args.region_mib * MiB // (p * KiB), 2 * max(args.batches)) * p * KiB
        for p in args.pages_kib
    )
    require_memory(
        ap,
        region * (2 if backend == "cpu" else 1),
        f"--region-mib {args.region_mib} with --pages-kib "
        f"{' '.join(map(str, args.pages_kib))} and --batches {' '.join(map(str, args.batches))}",
    )
    require_writable(ap, args.json)
    device = torch.device("cuda" if backend == "cuda" else "cpu")
    rng = np.random.default_rng(args.seed)
    rows: list[dict[str, object]] = []
    for i, page_kib in enumerate(args.pages_kib, 1):
        rows += bench_page(
            backend, device, page_kib * KiB, args.batches, args.region_mib * MiB,
            args.moved_mib * MiB, args.repeats, rng, args.pageable, args.copy_mode,
            args.cpu_worker, args.settle_ms / 1e3, args.copy_threads, args.copy_cpus,
            args.cuda_path, args.coalesce_depth,
        )  # fmt: skip
        progress(f"{page_kib} KiB pages: done ({i} of {len(args.pages_kib)})")
    label = str(rows[0]["backend"]) if rows else backend
    table = Table(title=f"kvtier transfer throughput ({label}, torch threads "
                  f"{torch.get_num_threads()})")  # fmt: skip
    for col in ("direction", "page", "blocks/job", "GB/s", "ceiling GB/s", "ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        gbps, ceil = float(r["gbps"]), float(r["ceiling_gbps"])  # type: ignore[arg-type]
        table.add_row(
            str(r["direction"]), f"{int(r['page_bytes']) // KiB} KiB",  # type: ignore[call-overload]
            str(r["blocks_per_job"]), f"{gbps:.2f}", f"{ceil:.2f}", f"{gbps / ceil:.0%}",
        )  # fmt: skip
    show_and_save(table, rows, args.json)


if __name__ == "__main__":
    run_main(main)
