"""The CUDA worker's kernel launches stay within the grid's limits, over c/fake_cuda.c wrapped
by a `cuLaunchKernel` that refuses what a GPU refuses (grid y and z above 65,535, x above
2^31 - 1; the fake alone accepts any grid).

A group's segments are the launch's grid z: a generic layout with many dims before the block
dim (here 2 x 32,769 parts) once went out as one launch of 65,538 in z, refused, so every job
of the group failed."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import run_over_fake_cuda

WRAPPER = r"""
#define cuLaunchKernel fake_launch_any_grid
#include "fake_cuda.c"
#undef cuLaunchKernel

CUresult cuLaunchKernel(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shmem, void *stream, void **params,
                        void **extra) {
    if (gx > 2147483647u || gy > 65535u || gz > 65535u)
        return 1; /* CUDA_ERROR_INVALID_VALUE, as the driver answers */
    return fake_launch_any_grid(fn, gx, gy, gz, bx, by, bz, shmem, stream, params, extra);
}
"""

CHILD = r"""
import sys

import torch
from worker_check import stand_in_for_the_gpu
from kvtier.transfer import HostPool, KVCacheRegistration, KVTensor
from kvtier.transfer.cuda_worker import CUDATransferWorker

torch.manual_seed(0)
big = torch.randn(2, 32769, 4, 16, dtype=torch.float16)  # blocks on dim 2: 65,538 parts
reg = KVCacheRegistration([KVTensor(big, 2)])
assert len(reg.segments(0)) == 65538
pool = HostPool(reg, 1, num_slots=2, pin=False)
reg.device = torch.device("cuda", 0)
pool.pinned = True
stand_in_for_the_gpu(pool)
before = big.clone()
w = CUDATransferWorker(reg, pool, copy_mode="kernel", compiled=True,
                       coalesce_depth=int(sys.argv[1]))
w.submit_store(1, [1, 3], [0, 1])
w.wait([1])
w.submit_load(2, [1, 0], [0, 2])
w.wait([2])
got = sorted((r.job_id, r.success) for r in w.get_finished())
w.shutdown()
assert got == [(1, True), (2, True)], got
assert torch.equal(big[:, :, 0], before[:, :, 3]) and torch.equal(big[:, :, 2], before[:, :, 1])
assert torch.equal(big[:, :, 1], before[:, :, 1]) and torch.equal(big[:, :, 3], before[:, :, 3])
pool.pinned = False
print("ok")
"""


@pytest.mark.parametrize("depth", [0, 2])
def test_a_group_of_more_segments_than_a_grid_holds_is_copied(tmp_path: Path, depth: int) -> None:
    assert run_over_fake_cuda(tmp_path, CHILD, str(depth), wrapper=WRAPPER).strip() == "ok"
