"""The CUDA worker's compiled engine at interpreter exit, over c/fake_cuda.c (built here as the
`libcuda.so.1` the engine opens, as test_native_c.py does for c/worker_check.py).

`CUDAEngine` is freed by its finalizer at exit (weakref.finalize's exit hook), and an exit
handler registered earlier runs after that hook. Such a handler polling the worker
(`get_finished`, `wait`) or submitting once called into the freed engine: glibc's
MALLOC_PERTURB_ fills freed memory, so that use crashes or hangs instead of passing by luck."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import run_over_fake_cuda

CHILD = r"""
import atexit, sys, weakref

# Registered before any weakref.finalize exists: atexit runs it after finalize's exit hook,
# which frees the engine.
assert not weakref.finalize._registered_with_atexit
late = []


def later_exit_handler() -> None:
    w = late[0]
    freed = not w._engine._finalizer.alive
    w.wait([1, 2, 3])
    got = sorted((r.job_id, r.success, r.bytes) for r in w.get_finished())
    again = w.get_finished()
    try:
        w.submit_store(9, [0, 1], [5])
        refused = False
    except RuntimeError:
        refused = True
    print("late", freed, got, again, refused, flush=True)


atexit.register(later_exit_handler)

from worker_check import fake_cuda_worker

w, _ = fake_cuda_worker(2, 12, coalesce_depth=int(sys.argv[1]))
reg = w.registration
w.submit_store(1, [0, 1, 2, 3], [0, 1])
w.submit_store(2, [4, 5], [2])
w.submit_load(3, [0], [30, 31], urgent=True)
late.append(w)
print("page", reg.page_bytes(0), flush=True)
"""


@pytest.mark.parametrize("depth", [0, 2])
def test_results_survive_the_engine_freed_at_exit_and_submits_are_refused(
    tmp_path: Path, depth: int
) -> None:
    # A wait on a freed engine may never return: the run's timeout says so.
    out = run_over_fake_cuda(
        tmp_path, CHILD, str(depth), env={"MALLOC_PERTURB_": "165"}, timeout=120
    )
    lines = out.split("\n")
    page = int(next(ln for ln in lines if ln.startswith("page ")).split()[1])
    want = [(1, True, 4 * page), (2, True, 2 * page), (3, True, 2 * page)]
    assert f"late True {want} [] True" in lines, out
