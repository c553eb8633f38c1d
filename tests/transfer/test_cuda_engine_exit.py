"""The CUDA worker's compiled engine at interpreter exit, over c/fake_cuda.c (built here as the
`libcuda.so.1` the engine opens, as test_native_c.py does for c/worker_check.py).

`CUDAEngine` is freed by its finalizer at exit (weakref.finalize's exit hook), and an exit
handler registered earlier runs after that hook. Such a handler polling the worker
(`get_finished`, `wait`) or submitting once called into the freed engine: glibc's
MALLOC_PERTURB_ fills freed memory, so that use crashes or hangs instead of passing by luck."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import build_fake_libcuda
from kvtier.transfer import native

HARNESSES = Path(__file__).with_name("c")
CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")

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

sys.path.insert(0, sys.argv[2])
import torch
from worker_check import stand_in_for_the_gpu
from kvtier.transfer import HostPool, KVCacheRegistration
from kvtier.transfer.cuda_worker import CUDATransferWorker
from kvtier.transfer.testing import make_layout

kvs = make_layout("flash", torch.float16, "cpu", seed=5)
reg = KVCacheRegistration(kvs)
pool = HostPool(reg, 2, num_slots=12, pin=False)
reg.device = torch.device("cuda", 0)
pool.pinned = True
stand_in_for_the_gpu(pool)
w = CUDATransferWorker(reg, pool, copy_mode="kernel", compiled=True,
                       coalesce_depth=int(sys.argv[1]))
w.submit_store(1, [0, 1, 2, 3], [0, 1])
w.submit_store(2, [4, 5], [2])
w.submit_load(3, [0], [30, 31], urgent=True)
late.append(w)
print("page", reg.page_bytes(0), flush=True)
"""


@pytest.mark.skipif(CC is None, reason="needs a C compiler")
@pytest.mark.parametrize("depth", [0, 2])
def test_results_survive_the_engine_freed_at_exit_and_submits_are_refused(
    tmp_path: Path, depth: int
) -> None:
    if native.library() is None or native.submit_extension() is None:
        pytest.skip("the library or the submit extension does not build here")
    assert CC is not None
    build_fake_libcuda(CC, tmp_path, HARNESSES / "fake_cuda.c", HARNESSES)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path), "MALLOC_PERTURB_": "165"}
    try:
        run = subprocess.run(
            [sys.executable, str(script), str(depth), str(HARNESSES)],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:  # a wait on a freed engine may never return
        raise AssertionError("the exit handler hung on the freed engine") from exc
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.split("\n")
    page = int(next(ln for ln in lines if ln.startswith("page ")).split()[1])
    want = [(1, True, 4 * page), (2, True, 2 * page), (3, True, 2 * page)]
    assert f"late True {want} [] True" in lines, run.stdout + run.stderr
