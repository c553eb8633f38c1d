"""Review of the CUDA worker (2026-11-28), over c/fake_cuda.c where the compiled engine runs.

- A CUDA worker inherited by a forked child: collecting it there, or the child's exit, freed
  the engine, whose launch threads are the parent's (joining them crashed the child with
  SIGSEGV), and `wait` there was not refused as the CPU workers refuse it.
- A registration or pool of the wrong type died on a missing attribute, where the CPU
  workers refuse it by name.
- An engine whose setup failed after the driver made it (a table upload out of device memory,
  say) was never freed: its kernel image stayed loaded, with its locks and memory.
- The torch-ops path's copy engines (`DmaCopier`) failed a job of no blocks.
- benchmarks/cuda_submit.py ran its paths in one order every round, and its title gave the
  `--jobs` asked for where a case used fewer.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers import FORK_WITH_A_STORE_IN_FLIGHT, run_over_fake_cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

FORK_CHILD = (
    r"""
import gc, os, signal, sys

from worker_check import fake_cuda_worker
"""
    + FORK_WITH_A_STORE_IN_FLIGHT
    + r"""    seen = []
    try:
        w.wait([2])
        seen.append("wait returned")
    except RuntimeError as exc:
        seen.append("wait refused" if "forked" in str(exc) else repr(exc))
    w.shutdown()
    w.shutdown()
    seen.append("shut down")
    del w
    gc.collect()  # the engine's finalizer runs here
    seen.append("collected")
    print("child", seen, flush=True)
    sys.exit(0)  # through the interpreter's exit, and its exit hooks
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
# The parent's worker is untouched: its jobs are reported, and it takes more.
w.submit_store(3, [6, 7], [3])
w.wait([2, 3])
got = [(r.job_id, r.success) for r in w.get_finished()]
w.shutdown()
print("parent", got, flush=True)
"""
)


@pytest.mark.parametrize("depth", [0, 2])
def test_a_cuda_worker_inherited_by_a_forked_child_is_left_to_the_parent(
    tmp_path: Path, depth: int
) -> None:
    out = run_over_fake_cuda(tmp_path, FORK_CHILD, str(depth), timeout=120)
    lines = out.splitlines()
    assert "child ['wait refused', 'shut down', 'collected']" in lines, out
    assert "child exit 0" in lines, out  # -11: SIGSEGV, -14: it hung
    assert "parent [(1, True), (2, True), (3, True)]" in lines, out


# Counts the kernel images the engine loads and unloads (its free unloads its image).
MODULE_COUNT = r"""
#define cuModuleLoadData fake_module_load
#define cuModuleUnload fake_module_unload
#include "fake_cuda.c"
#undef cuModuleLoadData
#undef cuModuleUnload

static int modules;

CUresult cuModuleLoadData(void **module, const void *image) {
    CUresult r = fake_module_load(module, image);
    pthread_mutex_lock(&mu);
    modules += r == OK;
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuModuleUnload(void *module) {
    CUresult r = fake_module_unload(module);
    pthread_mutex_lock(&mu);
    modules -= r == OK;
    pthread_mutex_unlock(&mu);
    return r;
}

int fake_modules(void) { LOCKED(int, modules); }
"""

SETUP_FAILS = r"""
import gc, sys

import torch

from kvtier.transfer import HostPool, KVCacheRegistration, cuda_engine
from kvtier.transfer.cuda_worker import CUDATransferWorker
from kvtier.transfer.testing import make_layout
from worker_check import FAKE, stand_in_for_the_gpu

kvs = make_layout("flash", torch.float16, "cpu", seed=5)
reg = KVCacheRegistration(kvs)
pool = HostPool(reg, 2, num_slots=12, pin=False)
reg.device = torch.device("cuda", 0)
pool.pinned = True
stand_in_for_the_gpu(pool)
fake = cuda_engine.torch


class OutOfMemory:
    def __init__(self, array: object) -> None:
        pass

    def to(self, device: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")


def sync_fails(device: object = None) -> None:
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


if sys.argv[1] == "upload":
    fake.from_numpy = OutOfMemory
else:
    fake.cuda.synchronize = sync_fails
try:
    CUDATransferWorker(reg, pool, copy_mode="kernel", compiled=True)
except RuntimeError as exc:
    print("raised", type(exc).__name__, flush=True)
gc.collect()
print("modules loaded", FAKE.fake_modules(), flush=True)
"""


@pytest.mark.parametrize("failing", ["upload", "synchronize"])
def test_an_engine_whose_setup_fails_is_freed(tmp_path: Path, failing: str) -> None:
    out = run_over_fake_cuda(tmp_path, SETUP_FAILS, failing, wrapper=MODULE_COUNT, timeout=120)
    lines = out.splitlines()
    assert any(ln.startswith("raised ") for ln in lines), out
    assert "modules loaded 0" in lines, out


_BURSTS: list[tuple[str, str]] = []
"""The path and direction of each burst `_fake_burst` ran, in order."""


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("registration", "registration must be a KVCacheRegistration, got list"),
        ("pool", "pool must be a HostPool, got NoneType"),
    ],
)
def test_a_registration_or_pool_of_the_wrong_type_is_refused_by_name(
    bad: str, message: str
) -> None:
    """As the CPU workers refuse them: the CUDA worker read `registration.device` and
    `pool.pinned` first, and died on a missing attribute."""
    torch = pytest.importorskip("torch")
    from kvtier.transfer import HostPool, KVCacheRegistration, KVTensor
    from kvtier.transfer.cuda_worker import CUDATransferWorker

    kv = KVTensor(torch.zeros(8, 256, dtype=torch.uint8), 0)
    reg = KVCacheRegistration([kv])
    pool = HostPool(reg, 1, num_slots=4, pin=False)
    reg.device = torch.device("cuda", 0)  # as a registration on a GPU says
    args: tuple[Any, Any] = ([kv], pool) if bad == "registration" else (reg, None)
    with pytest.raises(TypeError, match=message):
        CUDATransferWorker(*args)


EMPTY_DMA_JOBS = r"""
import ctypes

import torch

from kvtier.transfer import HostPool, KVCacheRegistration, cuda_dma
from kvtier.transfer.plan import JobPlanner
from kvtier.transfer.testing import make_layout
from worker_check import FAKE

batch = ctypes.cast(FAKE.fake_memcpy_batch, ctypes.c_void_p).value
cuda_dma._cached = (cuda_dma._Fn(batch), True)  # the stand-in's cuMemcpyBatchAsync
reg = KVCacheRegistration(make_layout("flash", torch.float16, "cpu", seed=5))
pool = HostPool(reg, 2, num_slots=4, pin=False)
pages = {g: reg.page_bytes(g) for g in reg.groups}
planner = JobPlanner(reg.num_blocks, pool.num_slots, pool.blocks_per_chunk, pages)
dma = cuda_dma.DmaCopier(reg, pool.address, pool.row_bytes, 0)
for job in (planner.store(1, [], [], 0), planner.load(2, [], [], 0, 0, False)):
    try:
        dma.run(job, 7)
        print("empty queued", FAKE.fake_batches(), flush=True)
    except RuntimeError as exc:
        print("empty refused", exc, flush=True)
dma.run(planner.store(3, [2, 3], [1], 0), 7)
print("ran", FAKE.fake_batches(), FAKE.fake_run(), flush=True)
"""


def test_a_job_of_no_blocks_on_the_copy_engines_is_done_not_failed(tmp_path: Path) -> None:
    """The torch-ops path with copy_mode="dma" hands every job to `DmaCopier`, and the driver
    (as its stand-in) refuses a batch of no copies: a job of no blocks was reported failed,
    where the compiled path and the CPU workers report it done."""
    out = run_over_fake_cuda(tmp_path, EMPTY_DMA_JOBS, timeout=120)
    assert out.splitlines() == ["empty queued 0", "empty queued 0", "ran 1 1"], out


class _Recorder:
    """Stands in for a CUDA worker in benchmarks/cuda_submit.py: records each burst's path."""

    def __init__(self, reg: Any, pool: Any, **options: Any) -> None:
        self.path = (
            "torch"
            if not options["compiled"]
            else "coalesced"
            if options.get("coalesce_depth")
            else "compiled"
        )

    def shutdown(self) -> None:
        pass


def _fake_burst(w: _Recorder, direction: str, d: Any, h: Any, first: int, **kw: Any) -> Any:
    from _bench import Burst
    from kvtier.base import TransferResult

    _BURSTS.append((w.path, direction))
    results = [TransferResult(first + j, True, 1, 1e-6) for j in range(len(d))]
    return Burst(1e-6, 2e-6 * len(d), results, [1e-6] * len(d))


# The stand-in CPU tensor's host pool cannot be pinned (no CUDA here): a warning says so.
_UNPINNED = pytest.mark.filterwarnings("ignore:could not pin:RuntimeWarning")


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    """benchmarks/cuda_submit.py with what needs a GPU stood in: the device tensor is made on
    the CPU, the workers record the bursts they would run."""
    torch = pytest.importorskip("torch")
    import cuda_submit

    real_empty = torch.empty

    def empty(*shape: Any, **kw: Any) -> Any:
        kw.pop("device", None)
        return real_empty(*shape, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_submit, "CUDATransferWorker", _Recorder)
    monkeypatch.setattr(cuda_submit, "run_burst", _fake_burst)
    _BURSTS.clear()
    return cuda_submit


@_UNPINNED
@pytest.mark.parametrize("paths", [["compiled", "torch"], ["compiled", "coalesced", "torch"]])
def test_cuda_submit_runs_each_path_first_equally_often(bench: Any, paths: list[str]) -> None:
    n = len(paths)
    rows = bench.bench_case(64 << 10, 1, 4, 2 * n - 1, 1 << 20, np.random.default_rng(0), paths, 2)
    assert len(rows) == 2 * n
    bursts = _BURSTS
    per_round = 2 * n  # each path, both directions
    rounds = [bursts[i : i + per_round] for i in range(0, len(bursts), per_round)]
    assert len(rounds) == 2 * n  # the warm-up and the timed ones
    firsts = [r[0][0] for r in rounds]
    # Each path leads in as many rounds as every other, and never twice in a row; so does
    # each direction within a path's turn.
    assert sorted(firsts) == sorted(paths * 2), firsts
    assert all(a != b for a, b in itertools.pairwise(firsts)), firsts
    directions = [r[0][1] for r in rounds]
    assert all(a != b for a, b in itertools.pairwise(directions)), directions


@_UNPINNED
def test_cuda_submit_titles_the_jobs_a_burst_that_ran(
    bench: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # 1 MiB of 64 KiB pages: 16 blocks, so jobs of 8 blocks come 2 a burst, not the 256 asked.
    bench.main(["--cases", "64x8", "--region-mib", "1", "--rounds", "1", "--paths", "torch"])
    out = capsys.readouterr().out
    assert "2 jobs a burst" in out, out
    assert "256 jobs" not in out, out
