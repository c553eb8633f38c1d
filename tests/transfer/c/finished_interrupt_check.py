"""`CUDATransferWorker.get_finished` on the compiled path, interrupted (KeyboardInterrupt) at
every point where CPython can raise one in the frames of one source file (`helpers.interrupt_at`),
over c/fake_cuda.c with torch's CUDA calls stood in as in worker_check.py: run by
test_cuda_get_finished_interrupts.py with the fake as the `libcuda.so.1` on LD_LIBRARY_PATH.

Arguments: the launch threads' depth (0: none), "alive" (results in the engine) or "freed"
(the engine freed as at interpreter exit, its results kept by `cuda_engine._close`), and the
files whose frames are interrupted (worker.py, cuda_worker.py, cuda_engine.py; all three by
default). Each job must be reported exactly once, by
the interrupted call or the next, be held until then, and its id be free afterwards. Prints
"ok", or one line per interrupt point that lost or repeated a result.
"""

from __future__ import annotations

import gc
import sys

from worker_check import _Stream, fake_cuda_worker

import kvtier.transfer.cuda_engine
import kvtier.transfer.cuda_worker
import kvtier.transfer.worker
from helpers import get_finished_interrupted
from kvtier.transfer.cuda_worker import CUDATransferWorker

MODULES = {
    "worker.py": kvtier.transfer.worker,
    "cuda_worker.py": kvtier.transfer.cuda_worker,
    "cuda_engine.py": kvtier.transfer.cuda_engine,
}
JOBS = [1, 2, 3, 4, 5]
"""Stores 1-3, a load (4) and an urgent load (5): all three lanes."""


def submit_jobs(w: CUDATransferWorker) -> None:
    for j in (1, 2, 3):
        w.submit_store(j, [2 * j, 2 * j + 1], [j])
    w.submit_load(4, [6], [30, 31])
    w.submit_load(5, [7], [32, 33], urgent=True)


def one_point(n: int, filename: str, depth: int, freed: bool) -> tuple[list[str], str | None]:
    """Interrupt the `n`-th point; returns what went wrong, and where it fired (None: the call
    ran past fewer points)."""
    _Stream._next = 1  # the last worker's streams again: the fake has room for 16
    w, _ = fake_cuda_worker(2, 12, coalesce_depth=depth)
    page = w.registration.page_bytes(0)
    wrong: list[str] = []
    fired: list[str] = []  # stays empty if the worker cannot be built
    try:
        submit_jobs(w)
        w.wait(JOBS)
        engine = w._engine
        assert engine is not None
        if freed:
            engine._finalizer()  # as at interpreter exit: the results wait in `_drained`
        try:
            got, fired = get_finished_interrupted(w, n, filename, JOBS)
        except AssertionError as e:  # a job neither reported nor held
            wrong.append(str(e))
            got = w.get_finished()
        ids = sorted(r.job_id for r in got)
        if ids != JOBS:
            wrong.append(f"reported {ids}, want {JOBS}")
        if not all(r.success and r.bytes == 2 * page for r in got):
            wrong.append(f"results {got}")
        if any(w.holds(j) for j in JOBS):
            wrong.append(f"jobs {[j for j in JOBS if w.holds(j)]} held for good")
        if w.get_finished():
            wrong.append("a third call reported more")
        if not freed and not wrong:  # the id is free again (a freed engine takes no job)
            w.submit_store(1, [4, 5], [4])
            w.wait([1])
            if [r.job_id for r in w.get_finished()] != [1]:
                wrong.append("job 1, submitted again, was not reported once")
    finally:
        w.shutdown()
        w.pool.pinned = False
        w.pool.close()
    return wrong, fired[0] if fired else None


def main(depth: int, mode: str, names: list[str]) -> None:
    # Two results per engine call: the interrupts also fall between two peeks of one call.
    kvtier.transfer.cuda_engine._POLL = 2
    gc.freeze()  # the imports' objects: each point's collection then takes milliseconds
    failures = []
    for name in names:
        filename = str(MODULES[name].__file__)
        n = 0
        while True:
            wrong, where = one_point(n, filename, depth, mode == "freed")
            if wrong:
                failures.append(f"{name}, interrupted {where}: {'; '.join(wrong)}")
            if where is None:
                break
            n += 1
        if n == 0:
            failures.append(f"{name}: no interrupt point was reached")
        print(f"{name}: {n} interrupt points", file=sys.stderr)
    print("\n".join(failures) or "ok")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3:] or list(MODULES))
