"""Host time of a CUDA worker submit without a GPU: the extension route against ctypes.

`CUDATransferWorker` runs unchanged over tests/transfer/c/fake_cuda.c (a stand-in for the
driver on host memory, built here with the C compiler), with torch's CUDA calls stood in as in
tests/transfer/c/worker_check.py. Both routes make the same driver calls into the same
stand-in, so the difference between them is the Python side of a submit: the extension reads
the ids and calls the engine directly, the ctypes route converts them with numpy, copies them
into a staging buffer and passes ten ctypes arguments. The absolute times include the
stand-in's calls, which are not a real driver's; only the difference carries over to a GPU.

The routes take turns, `--jobs` single-chunk stores each, for `--rounds` rounds after a
warm-up; each row gives the median over rounds of the median submit.

    python benchmarks/cuda_submit_host.py
    python benchmarks/cuda_submit_host.py --blocks 1 16 --rounds 21 --json out/submit_host.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.table import Table

from _bench import show_and_save
from _cli import positive_int, require_distinct, require_writable, run_main

REPO = Path(__file__).resolve().parent.parent
HARNESSES = REPO / "tests" / "transfer" / "c"


def measure(blocks: list[int], jobs: int, rounds: int) -> list[dict[str, object]]:
    """In the child process (the stand-in first on LD_LIBRARY_PATH): the rows."""
    import torch

    sys.path.insert(0, str(HARNESSES))
    import worker_check

    from kvtier.transfer import HostPool, KVCacheRegistration
    from kvtier.transfer.cuda_worker import CUDATransferWorker
    from kvtier.transfer.testing import make_layout

    nb = max(blocks) * jobs
    kvs = make_layout("mla", torch.float16, "cpu", seed=5, nb=nb)
    reg = KVCacheRegistration(kvs)
    rows: list[dict[str, object]] = []
    for n in blocks:
        pool = HostPool(reg, n, num_slots=jobs, pin=False)
        reg.device = torch.device("cuda", 0)
        pool.pinned = True
        worker_check.stand_in_for_the_gpu(pool)
        w = CUDATransferWorker(reg, pool, copy_mode="kernel", compiled=True)
        ext = w._ext_submit
        if ext is None:
            raise SystemExit("the submit extension does not build here (no Python headers?)")
        seen: dict[str, list[float]] = {"extension": [], "ctypes": []}
        job = 0
        for r in range(rounds + 1):
            for route in seen:
                w._ext_submit = ext if route == "extension" else None
                times, ids = [], []
                for k in range(jobs):
                    device_blocks = list(range(k * n, (k + 1) * n))
                    start = time.perf_counter()
                    w.submit_store(job, device_blocks, [k])
                    times.append(time.perf_counter() - start)
                    ids.append(job)
                    job += 1
                w.wait(ids)
                w.get_finished()
                if r:  # round 0 warms both up
                    seen[route].append(statistics.median(times))
        w.shutdown()
        pool.pinned = False
        pool.close()
        reg.device = torch.device("cpu")
        for route, values in seen.items():
            rows.append(
                {"route": route, "blocks_per_job": n, "submit_us": statistics.median(values) * 1e6,
                 "min_us": min(values) * 1e6, "max_us": max(values) * 1e6}
            )  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    """Build the stand-in, run the measurement in a child that loads it, print and save."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Typed so that a refusal names the flag and the value at fault.
    ap.add_argument("--blocks", type=positive_int, nargs="+", default=[1, 16],
                    help="blocks per job")  # fmt: skip
    ap.add_argument("--jobs", type=positive_int, default=1000, help="submits per route and round")
    ap.add_argument("--rounds", type=positive_int, default=11,
                    help="timed rounds after a warm-up")  # fmt: skip
    ap.add_argument("--json", metavar="FILE", help="write the rows as a JSON list")
    ap.add_argument("--child", metavar="OUT", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    require_distinct(ap, "--blocks", args.blocks, "size")  # else rows print twice
    if args.child:
        Path(args.child).write_text(json.dumps(measure(args.blocks, args.jobs, args.rounds)))
        return
    require_writable(ap, args.json)
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        ap.error("needs a C compiler to build the stand-in driver")
    with tempfile.TemporaryDirectory() as tmp:
        lib = Path(tmp) / "libcuda.so.1"
        build = subprocess.run(
            [cc, "-O2", "-pthread", "-fPIC", "-shared", "-Wl,-soname,libcuda.so.1", "-o",
             str(lib), str(HARNESSES / "fake_cuda.c")],
            check=False, capture_output=True, text=True,
        )  # fmt: skip
        if build.returncode:
            sys.stderr.write(build.stderr)
            ap.error(f"CC={cc} could not build the stand-in driver (exit status "
                     f"{build.returncode})")  # fmt: skip
        out = Path(tmp) / "rows.json"
        env = {**os.environ, "LD_LIBRARY_PATH": tmp}
        child = [sys.executable, __file__, "--child", str(out), "--jobs", str(args.jobs),
                 "--rounds", str(args.rounds), "--blocks", *map(str, args.blocks)]  # fmt: skip
        # The child prints its own error; a traceback of this process would add nothing.
        # In a session of its own: a terminal's Ctrl-C reaches only this process, which
        # kills the child and says so once (the child's import would add a traceback).
        done = subprocess.run(child, check=False, env=env, start_new_session=True)
        if done.returncode:
            ap.error(f"the measurement failed (exit status {done.returncode}); its error is above")
        rows = json.loads(out.read_text())
    table = Table(title=f"CUDA worker submit over the stand-in driver ({args.jobs} jobs a "
                  f"route and round, medians of {args.rounds} rounds)")  # fmt: skip
    for col in ("blocks/job", "route", "submit µs", "range µs"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["blocks_per_job"]), str(r["route"]), f"{r['submit_us']:.2f}",
            f"{r['min_us']:.2f}-{r['max_us']:.2f}",
        )  # fmt: skip
    show_and_save(table, rows, args.json)


if __name__ == "__main__":
    run_main(main)
