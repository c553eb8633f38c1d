"""What the benchmark scripts share: parsing a `PAGE_KIBxBLOCKS` case, a timed burst of jobs,
waiting for a device, showing and saving rows.

The scripts run as `python benchmarks/NAME.py`, which puts this folder on `sys.path`.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch
from rich.console import Console
from rich.table import Table

from _cli import write_results
from kvtier.base import TransferResult
from kvtier.transfer import TransferWorker

KiB = 1 << 10


def parse_case(text: str) -> tuple[int, int]:
    """`"256x16"` -> (page bytes, blocks per job); argparse's error for anything else."""
    page, _, blocks = text.partition("x")
    try:
        p, b = int(page), int(blocks)
    except ValueError:
        p = b = 0
    if p < 1 or b < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected PAGE_KIBxBLOCKS with both at least 1, e.g. 256x16"
        )
    return p * KiB, b


@dataclass
class Burst:
    """One burst's timings: the whole submit phase, each submit (with `time_each`), the wall
    time from the first submit to the last job done, and the results (all successful)."""

    submit: float
    wall: float
    results: list[TransferResult]
    each: list[float] = field(default_factory=list)


def run_burst(
    worker: TransferWorker,
    direction: str,
    dev: npt.NDArray[np.integer],
    slots: npt.NDArray[np.integer],
    first_id: int,
    *,
    time_each: bool = False,
) -> Burst:
    """Submit job `first_id + j` for row `j` of `dev` and `slots` ("store" or "load"), with
    nothing in flight before, then wait for all. `time_each` times every submit call too,
    which costs two clock reads a job."""
    submit = worker.submit_store if direction == "store" else worker.submit_load
    store = direction == "store"
    ids = list(range(first_id, first_id + len(dev)))
    each: list[float] = []
    t0 = time.perf_counter()
    for j, job_id in enumerate(ids):
        a, b = (dev[j], slots[j]) if store else (slots[j], dev[j])
        if time_each:
            t = time.perf_counter()
            submit(job_id, a, b)
            each.append(time.perf_counter() - t)
        else:
            submit(job_id, a, b)
    t1 = time.perf_counter()
    worker.wait(ids)
    wall = time.perf_counter() - t0
    results = worker.get_finished()
    assert len(results) == len(ids) and all(x.success for x in results), "a job failed"
    return Burst(t1 - t0, wall, results, each)


def sync(device: torch.device) -> None:
    """Wait for the work queued on `device` (a GPU's kernels run asynchronously); no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def show_and_save(table: Table, rows: list[dict[str, object]], json_path: str | None) -> None:
    """Print `table`; write `rows` as a JSON list to `json_path` if given."""
    Console().print(table)
    if json_path:
        # Serialised first: a row that does not serialise leaves no file half-written.
        write_results(json_path, json.dumps(rows, indent=1))
