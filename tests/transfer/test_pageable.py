"""The bounce-buffer copier behind the CUDA fallback for pageable pools, run on CPU tensors.

The GPU tests (test_cuda_worker.py) cover the worker around it; here the index logic (pieces,
runs, scattered rows, mid-chunk loads, groups) is checked byte for byte where CI can run it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.transfer import HostPool, KVCacheRegistration, make_transfer_worker
from kvtier.transfer.pageable import BounceCopier, PageableCUDATransferWorker
from kvtier.transfer.plan import JobPlanner
from kvtier.transfer.testing import NUM_BLOCKS, assert_block_equals, make_layout, snapshot


@pytest.mark.parametrize("bpc", [1, 2, 4])
@pytest.mark.parametrize("piece_rows", [1, 3, 64])
def test_bounce_round_trip_is_byte_exact(layout: str, bpc: int, piece_rows: int) -> None:
    rng = np.random.default_rng(bpc * 100 + piece_rows)
    kvs = make_layout(layout, torch.bfloat16, seed=bpc)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, bpc, num_slots=8, pin=False)
    copier = BounceCopier(reg, pool.rows, bounce_bytes=piece_rows * pool.row_bytes)
    planner = JobPlanner(
        NUM_BLOCKS, pool.num_slots, bpc, {g: reg.page_bytes(g) for g in reg.groups}
    )
    before = snapshot(kvs)
    half = NUM_BLOCKS // 2
    src = rng.permutation(half)[: 4 * bpc]
    src[:bpc] = np.arange(bpc)  # one chunk whose device blocks form a run
    slots = rng.permutation(pool.num_slots)[:4]
    store = planner.store(1, src, slots, 0)
    copier.run(store, torch.from_numpy(store.dev_rows), torch.from_numpy(store.host_rows))
    skip = bpc - 1
    dst = half + rng.permutation(NUM_BLOCKS - half)[: 4 * bpc - skip]
    load = planner.load(2, slots, dst, 0, skip, False)
    copier.run(load, torch.from_numpy(load.dev_rows), torch.from_numpy(load.host_rows))
    for s, d in zip(src[skip:], dst, strict=True):
        assert_block_equals(kvs, int(d), before[int(s)])
    untouched = set(range(NUM_BLOCKS)) - set(dst.tolist())
    for b in untouched:
        assert_block_equals(kvs, b, before[b])


def test_bounce_copier_keeps_other_rows_of_the_pool() -> None:
    kvs = make_layout("mla", torch.float16, seed=3)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 1, num_slots=6, pin=False)
    pool.tensor.fill_(0xAB)
    copier = BounceCopier(reg, pool.rows, bounce_bytes=pool.row_bytes)
    planner = JobPlanner(NUM_BLOCKS, pool.num_slots, 1, {0: reg.page_bytes(0)})
    job = planner.store(1, [5, 2], [4, 1], 0)
    copier.run(job, torch.from_numpy(job.dev_rows), torch.from_numpy(job.host_rows))
    for slot in (0, 2, 3, 5):
        assert bool(torch.all(pool.tensor[slot] == 0xAB)), f"slot {slot} was written"
    assert not bool(torch.all(pool.tensor[4] == 0xAB))


def test_pageable_cuda_worker_refuses_cpu_tensors() -> None:
    reg = KVCacheRegistration(make_layout("flash", torch.float16))
    pool = HostPool(reg, 1, num_slots=2, pin=False)
    with pytest.raises(ValueError, match="CUDA device, got cpu"):
        PageableCUDATransferWorker(reg, pool)
    with pytest.raises(ValueError, match="CUDA device, got cpu"):
        make_transfer_worker(reg, pool, "cuda")
