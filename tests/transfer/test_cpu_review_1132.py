"""CPU transfer review follow-ups: `CPUTransferWorker` fails a job whose both sides are scattered
when a registered tensor's storage was freed or moved (its raw-address copy killed the process
with SIGSEGV, where the docs promise a failed job), and a `HostPool` or a CPU worker refuses
pickling and copying by name (a `copy.copy` of a worker shared its queue or engine, which the
original's collection stopped or freed under the copy)."""

from __future__ import annotations

import copy
import gc
import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvtier.transfer import HostPool, NativeCPUTransferWorker
from kvtier.transfer.cpu_worker import CPUTransferWorker
from kvtier.transfer.registration import KVCacheRegistration, KVTensor
from kvtier.transfer.testing import block_bytes, make_layout

# ---- a registered tensor's storage freed or moved under the Python worker ----

_FREED = textwrap.dedent(
    """
    import sys, torch
    from kvtier.transfer.host_pool import HostPool
    from kvtier.transfer.cpu_worker import CPUTransferWorker
    from kvtier.transfer.registration import KVCacheRegistration, KVTensor

    # 1024 blocks of 32 KiB: 32 MiB, which the allocator maps on its own and unmaps when freed.
    t = torch.zeros(2, 1024, 16, 8, 64, dtype=torch.float16)
    reg = KVCacheRegistration([KVTensor(t, "flash")])
    pool = HostPool(reg, 1, num_slots=16, pin=False)
    w = CPUTransferWorker(reg, pool)
    # Scattered on both sides: the compiled row copier's (or memmove's) raw-address path.
    dev, slots = [1000 - 64 * i for i in range(15)], [15 - i for i in range(15)]
    t.view(torch.uint8).view(2, 1024, -1)[:, dev] = torch.arange(15, dtype=torch.uint8)[:, None]
    w.submit_store(1, dev, slots)  # while the storage is intact, the same jobs copy
    w.submit_load(2, slots[::-1], dev)
    w.wait([1, 2])
    assert t.view(torch.uint8).view(2, 1024, -1)[0, dev, 0].tolist() == list(range(15))[::-1]
    storage = t.untyped_storage()
    if sys.argv[1] == "freed":
        storage.resize_(0)
    else:  # moved: torch copies the bytes to a new place and frees the old one
        storage.resize_(storage.nbytes() * 2)
    w.submit_store(3, dev, slots)
    w.submit_load(4, slots, dev)
    w.wait([3, 4])
    print(sorted((r.job_id, r.success) for r in w.get_finished()))
    w.shutdown()
    pool.close()
    """
)


@pytest.mark.parametrize("change", ["freed", "moved"])
@pytest.mark.parametrize("native_rows", ["1", "0"], ids=["row-copier", "memmove"])
def test_python_worker_fails_scattered_jobs_over_a_freed_or_moved_storage(
    change: str, native_rows: str
) -> None:
    """In a child process: before, the copy went to the addresses recorded at registration, and
    the process died of SIGSEGV (or the job was reported copied). Before the change, the same
    jobs copy as ever: only a storage that changed is refused."""
    env = {**os.environ, "KVTIER_NATIVE_COPY": native_rows}
    proc = subprocess.run(
        [sys.executable, "-c", _FREED, change],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = "[(1, True), (2, True), (3, False), (4, False)]"
    assert proc.stdout.strip().splitlines()[-1] == want
    assert "storage was freed or moved" in proc.stderr


# ---- pickling and copying refused by name ----

_COPIES: list[Callable[[Any], object]] = [pickle.dumps, copy.copy, copy.deepcopy]


@pytest.mark.parametrize("how", _COPIES, ids=["pickle", "copy", "deepcopy"])
def test_host_pool_refuses_pickling_and_copying_by_name(how: Callable[[Any], object]) -> None:
    """Before: pickle named only "mmap.mmap", and copy.copy made a second pool over the same
    memory, whose close() unpinned the first one's."""
    reg = KVCacheRegistration([KVTensor(torch.zeros(2, 8, 4, 2, 8), "flash")])
    pool = HostPool(reg, 1, num_slots=2, pin=False)
    with pytest.raises(TypeError, match="a HostPool cannot be pickled or copied"):
        how(pool)
    assert not pool.closed
    pool.tensor.fill_(7)  # still usable, then closes as ever
    pool.close()
    assert pool.closed


_WORKERS = [CPUTransferWorker, NativeCPUTransferWorker]


@pytest.mark.parametrize("how", _COPIES, ids=["pickle", "copy", "deepcopy"])
@pytest.mark.parametrize("kind", _WORKERS, ids=["python", "compiled"])
def test_cpu_workers_refuse_pickling_and_copying_by_name(
    kind: type[CPUTransferWorker] | type[NativeCPUTransferWorker], how: Callable[[Any], object]
) -> None:
    """Before: copy.copy gave a worker sharing the original's queue (the Python worker: its
    jobs were never run once the original was collected, and wait() hung) or engine handle
    (the compiled one: freed with the original, then read by the copy)."""
    kvs = make_layout("mla", torch.bfloat16, seed=5)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 1, num_slots=4, pin=False)
    w = kind(reg, pool)
    with pytest.raises(TypeError, match=f"a {kind.__name__} cannot be pickled or copied"):
        how(w)
    # The worker is untouched: it copies, reports, shuts down, and the pool closes.
    want = block_bytes(kvs, 3)
    w.submit_store(1, [3], [2])
    w.submit_load(2, [2], [6])
    w.wait([1, 2])
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True), (2, True)]
    for got, exp in zip(block_bytes(kvs, 6), want, strict=True):
        assert torch.equal(got, exp)
    w.shutdown()
    del w
    gc.collect()
    pool.close()
    assert pool.closed


@pytest.mark.parametrize("how", _COPIES, ids=["pickle", "copy", "deepcopy"])
def test_every_transfer_backend_refuses_copies(how: Callable[[Any], object]) -> None:
    """The refusal is the base class's: the CUDA worker (its streams, engine handle and pool
    pins) too, checked on a bare instance since there is no GPU here."""
    from kvtier.transfer.cuda_worker import CUDATransferWorker

    bare = object.__new__(CUDATransferWorker)
    with pytest.raises(TypeError, match=r"a CUDATransferWorker cannot be pickled or copied"):
        how(bare)
