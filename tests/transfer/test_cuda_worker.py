"""The CUDA backend: byte-exact round trips and store-after-compute ordering (GPU only)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.transfer import HostPool, KVCacheRegistration, KVTensor, make_transfer_worker
from kvtier.transfer.testing import (
    DTYPES,
    NUM_BLOCKS,
    assert_block_equals,
    make_layout,
    snapshot,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _round_trip(kvs: list[KVTensor], bpc: int, seed: int, stage_bytes: int = 32 << 20) -> None:
    rng = np.random.default_rng(seed)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, bpc, num_slots=9)
    assert pool.pinned
    before = snapshot(kvs)
    half = NUM_BLOCKS // 2
    src_space, dst_space = rng.permutation(half), half + rng.permutation(NUM_BLOCKS - half)
    slots = rng.permutation(pool.num_slots)
    per_job = 2 * bpc
    with make_transfer_worker(reg, pool, "cuda", stage_bytes=stage_bytes) as w:
        for j in range(3):
            w.submit_store(j, src_space[j * per_job : (j + 1) * per_job], slots[2 * j : 2 * j + 2])
        w.wait(range(3))
        results = w.get_finished()
        assert [r.job_id for r in results] == [0, 1, 2] and all(r.success for r in results)
        expected = []
        for j in range(3):
            skip = int(rng.integers(bpc))
            n = per_job - skip - (int(rng.integers(bpc)) if per_job - skip > bpc else 0)
            dst = dst_space[j * per_job : j * per_job + n]
            w.submit_load(10 + j, slots[2 * j : 2 * j + 2], dst, skip_blocks=skip, urgent=j == 2)
            expected += zip(
                src_space[j * per_job + skip : j * per_job + skip + n], dst, strict=True
            )
        w.wait([10, 11, 12])
        assert all(r.success for r in w.get_finished())
    for s, d in expected:
        assert_block_equals(kvs, int(d), before[int(s)])
    pool.close()


@pytest.mark.parametrize("bpc", [1, 2, 4])
def test_round_trip_every_layout(layout: str, bpc: int) -> None:
    _round_trip(make_layout(layout, torch.float16, "cuda", seed=bpc), bpc, bpc)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype(dtype: torch.dtype) -> None:
    _round_trip(make_layout("flash", dtype, "cuda", seed=1), 2, 5)


def test_round_trip_through_many_stage_pieces() -> None:
    _round_trip(make_layout("cross_layer", torch.bfloat16, "cuda", seed=2), 2, 9, stage_bytes=1)


def test_store_waits_for_the_compute_that_wrote_the_block() -> None:
    kv = torch.zeros(16, 256, 1024, dtype=torch.float32, device="cuda")
    reg = KVCacheRegistration([KVTensor(kv, "mla")])
    pool = HostPool(reg, 1, num_slots=4)
    a = torch.randn(2048, 2048, device="cuda")
    with make_transfer_worker(reg, pool, "cuda") as w:
        for _ in range(20):  # keep the compute stream busy for a while
            a = torch.tanh(a @ a)
        kv[3].fill_(7.0)  # the "attention output" the store must see
        w.submit_store(1, [3], [2])
        w.wait([1])
        assert w.get_finished()[0].success
    got = pool.tensor[2].view(torch.float32)
    assert torch.all(got == 7.0)
    pool.close()


def test_failed_job_on_cuda_is_reported_failed() -> None:
    kvs = make_layout("mla", torch.float16, "cuda")
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 1, num_slots=4)
    before = snapshot(kvs)

    def fail_two(job_id: int, direction: str) -> None:
        if job_id == 2:
            raise RuntimeError("injected")

    with make_transfer_worker(reg, pool, "cuda", fault_injector=fail_two) as w:
        w.submit_store(1, [1], [0])
        w.submit_store(2, [2], [1])
        w.wait([1, 2])
        w.submit_load(3, [0], [30])
        w.wait([3])
        ok = {r.job_id: r.success for r in w.get_finished()}
    assert ok == {1: True, 2: False, 3: True}
    assert_block_equals(kvs, 30, before[1])
    pool.close()
