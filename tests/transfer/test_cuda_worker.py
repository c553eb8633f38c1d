"""The CUDA backend: byte-exact round trips and store-after-compute ordering (GPU only)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvtier.transfer import HostPool, KVCacheRegistration, KVTensor, cuda_dma, make_transfer_worker
from kvtier.transfer.cuda_worker import CUDATransferWorker
from kvtier.transfer.pageable import PageableCUDATransferWorker
from kvtier.transfer.testing import (
    DTYPES,
    NUM_BLOCKS,
    assert_block_equals,
    fill_random_bytes,
    make_layout,
    snapshot,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


PATHS: dict[str, dict[str, Any]] = {
    "compiled": {"compiled": True},
    "coalesced": {"compiled": True, "coalesce_depth": 2},
    "torch": {"compiled": False},
}


@pytest.fixture(params=list(PATHS))
def path(request: pytest.FixtureRequest) -> dict[str, Any]:
    """CUDATransferWorker's submit paths as its keyword arguments: compiled (each job launched
    by its submitter; fails where it cannot be built), compiled with launch threads that
    coalesce queued jobs, and torch ops."""
    return PATHS[request.param]


def _round_trip(
    kvs: list[KVTensor],
    bpc: int,
    seed: int,
    stage_bytes: int = 32 << 20,
    pin: bool = True,
    copy_mode: str = "kernel",
    path: dict[str, Any] | None = None,
) -> None:
    rng = np.random.default_rng(seed)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, bpc, num_slots=9, pin=pin)
    assert pool.pinned == pin
    before = snapshot(kvs)
    half = NUM_BLOCKS // 2
    src_space, dst_space = rng.permutation(half), half + rng.permutation(NUM_BLOCKS - half)
    slots = rng.permutation(pool.num_slots)
    per_job = 2 * bpc
    kwargs = {"copy_mode": copy_mode, **(path or PATHS["compiled"])} if pin else {}
    with make_transfer_worker(reg, pool, "cuda", stage_bytes=stage_bytes, **kwargs) as w:
        for j in range(3):
            w.submit_store(j, src_space[j * per_job : (j + 1) * per_job], slots[2 * j : 2 * j + 2])
        w.wait(range(3))
        results = w.get_finished()
        assert [r.job_id for r in results] == [0, 1, 2] and all(r.success for r in results)
        expected: list[tuple[np.int64, np.int64]] = []
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
def test_round_trip_every_layout(layout: str, bpc: int, path: dict[str, Any]) -> None:
    _round_trip(make_layout(layout, torch.float16, "cuda", seed=bpc), bpc, bpc, path=path)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype(dtype: torch.dtype, path: dict[str, Any]) -> None:
    _round_trip(make_layout("flash", dtype, "cuda", seed=1), 2, 5, path=path)


def test_round_trip_through_many_stage_pieces() -> None:
    kvs = make_layout("cross_layer", torch.bfloat16, "cuda", seed=2)
    _round_trip(kvs, 2, 9, stage_bytes=1, path=PATHS["torch"])


@pytest.mark.skipif(not cuda_dma.available(), reason="driver has no cuMemcpyBatchAsync")
@pytest.mark.parametrize("bpc", [1, 4])
def test_round_trip_on_the_copy_engines(layout: str, bpc: int, path: dict[str, Any]) -> None:
    kvs = make_layout(layout, torch.bfloat16, "cuda", seed=bpc)
    _round_trip(kvs, bpc, bpc, copy_mode="dma", path=path)


@pytest.mark.parametrize("width", [1, 2, 6, 12, 40])
def test_compiled_kernel_copies_rows_of_any_alignment(width: int) -> None:
    # Pages of 3 x width bytes: the engine picks 1-, 2-, 4- and 8-byte accesses for these
    # (16 for none), and a one-byte offset into the tensor's storage misaligns every row.
    size = NUM_BLOCKS * 3 * width
    base = torch.empty(1 + size, dtype=torch.uint8, device="cuda")
    kv = base[1:].view(NUM_BLOCKS, 3, width)
    fill_random_bytes(kv, width)
    _round_trip([KVTensor(kv, "mla")], 2, width, path=PATHS["compiled"])
    kv = base[:size].view(NUM_BLOCKS, 3, width)
    fill_random_bytes(kv, width + 1)
    _round_trip([KVTensor(kv, "mla")], 1, width, path=PATHS["coalesced"])


@pytest.mark.parametrize("mode", ["kernel", "dma"])
def test_compiled_jobs_of_more_rows_than_one_launch_takes(mode: str) -> None:
    if mode == "dma" and not cuda_dma.available():
        pytest.skip("driver has no cuMemcpyBatchAsync")
    # 1,000 rows: three launches of at most 480 rows on the kernel path.
    kv = torch.empty(2100, 2, 4, 2, 64, dtype=torch.float16, device="cuda")
    fill_random_bytes(kv, 3)
    kvs = [KVTensor(kv, "flashinfer")]
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 1, num_slots=1000)
    before = snapshot(kvs, 2100)
    rng = np.random.default_rng(0)
    src, dst = rng.permutation(1000), 1000 + rng.permutation(1100)[:1000]
    slots = rng.permutation(1000)
    w = CUDATransferWorker(reg, pool, copy_mode=mode, compiled=True)
    assert w.copy_path == "compiled"
    with w:
        w.submit_store(1, src, slots)
        w.wait([1])  # a slot is loaded only once its store is reported (the lanes overlap)
        w.submit_load(2, slots, dst)
        w.wait([2])
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True), (2, True)]
    for s, d in zip(src, dst, strict=True):
        assert_block_equals(kvs, int(d), before[int(s)])
    pool.close()


def test_compiled_path_is_the_default_and_refuses_bad_ids_like_the_planner() -> None:
    reg = KVCacheRegistration(make_layout("flash", torch.float16, "cuda"))
    pool = HostPool(reg, 2, num_slots=4)
    with make_transfer_worker(reg, pool, "cuda") as w:
        assert isinstance(w, CUDATransferWorker) and w.copy_path == "compiled"
        with pytest.raises(ValueError, match="len\\(device_blocks\\)=3 must equal"):
            w.submit_store(1, [1, 2, 3], [0])
        with pytest.raises(ValueError, match="slots contains 9"):
            w.submit_store(1, [1, 2], [9])
        with pytest.raises(ValueError, match="repeats id 5"):
            w.submit_load(1, [0, 1], [5, 5, 6])
        w.submit_store(1, [1, 2], [0])  # the refused calls left nothing behind
        w.wait([1])
        assert [(r.job_id, r.success, r.bytes) for r in w.get_finished()] == [
            (1, True, 2 * reg.page_bytes(0))
        ]
    pool.close()


@pytest.mark.parametrize("mode", ["auto", "kernel", "dma"])
def test_large_and_small_jobs_round_trip_in_every_copy_mode(
    mode: str, path: dict[str, Any]
) -> None:
    if mode == "dma" and not cuda_dma.available():
        pytest.skip("driver has no cuMemcpyBatchAsync")
    # 1 MiB pages in two segments: a 17-block job is over DMA_MIN_JOB_BYTES, a 2-block one under.
    kvs = [KVTensor(torch.empty(2, 40, 256, 8, 256, dtype=torch.uint8, device="cuda"), "flash")]
    fill_random_bytes(kvs[0].tensor, 7)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 1, num_slots=19)
    before = snapshot(kvs, 40)
    big, small = list(range(3, 20)), [30, 1]
    with make_transfer_worker(reg, pool, "cuda", copy_mode=mode, **path) as w:
        w.submit_store(1, big, list(range(17))[::-1])
        w.submit_store(2, small, [17, 18])
        w.wait([1, 2])
        w.submit_load(3, list(range(17))[::-1], list(range(21, 38)))
        w.submit_load(4, [17, 18], [20, 38])
        w.wait([3, 4])
        assert all(r.success for r in w.get_finished())
    for s, d in [*zip(big, range(21, 38), strict=True), (30, 20), (1, 38)]:
        assert_block_equals(kvs, d, before[s])
    pool.close()


@pytest.mark.skipif(not cuda_dma.available(), reason="driver has no cuMemcpyBatchAsync")
@pytest.mark.parametrize(
    ("blocks", "head_bytes", "batched"), [(2100, 256, False), (600, 2048, True)]
)
def test_auto_leaves_large_jobs_of_small_copies_to_the_kernel(
    blocks: int, head_bytes: int, batched: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two copies a block (K and V) of 16 x head_bytes: 4 KiB copies in a 17 MB job, which the
    # copy engines move slowly, a copy at a time; or 32 KiB copies in a 39 MB job.
    calls: list[int] = []
    run = cuda_dma.DmaCopier.run

    def counted(self: cuda_dma.DmaCopier, job: Any, stream: int) -> None:
        calls.append(len(job))
        run(self, job, stream)

    monkeypatch.setattr(cuda_dma.DmaCopier, "run", counted)
    n = blocks + 8
    kv = torch.empty(2, n, 16, 1, head_bytes, dtype=torch.uint8, device="cuda")
    fill_random_bytes(kv, 11)
    kvs = [KVTensor(kv, "flash")]
    reg = KVCacheRegistration(kvs)
    assert blocks * reg.page_bytes(0) > 16 << 20
    pool = HostPool(reg, 1, num_slots=blocks)
    before = snapshot(kvs, n)
    rng = np.random.default_rng(blocks)
    src = rng.permutation(blocks)
    with make_transfer_worker(reg, pool, "cuda", compiled=False) as w:
        w.submit_store(1, src, np.arange(blocks))
        w.wait([1])
        w.submit_load(2, np.arange(blocks), src[::-1] + 8)
        w.wait([2])
        assert all(r.success for r in w.get_finished())
    assert calls == ([blocks, blocks] if batched else [])
    for s, d in zip(src, src[::-1] + 8, strict=True):
        assert_block_equals(kvs, int(d), before[int(s)])
    pool.close()


@pytest.mark.parametrize("bpc", [1, 4])
def test_round_trip_with_a_pageable_pool(layout: str, bpc: int) -> None:
    _round_trip(make_layout(layout, torch.float16, "cuda", seed=bpc), bpc, bpc, pin=False)


def test_pageable_pool_gets_the_bounce_buffer_worker() -> None:
    reg = KVCacheRegistration(make_layout("flash", torch.float16, "cuda"))
    pool = HostPool(reg, 1, num_slots=4, pin=False)
    with make_transfer_worker(reg, pool, "cuda") as w:
        assert isinstance(w, PageableCUDATransferWorker)
    with pytest.raises(ValueError, match="pinned host pool"):
        CUDATransferWorker(reg, pool)


@pytest.mark.parametrize(
    "mode", ["compiled-kernel", "compiled-dma", "coalesced-kernel", "kernel", "dma", "pageable"]
)
def test_store_waits_for_the_compute_that_wrote_the_block(mode: str) -> None:
    if mode.endswith("dma") and not cuda_dma.available():
        pytest.skip("driver has no cuMemcpyBatchAsync")
    kv = torch.zeros(16, 256, 1024, dtype=torch.float32, device="cuda")
    reg = KVCacheRegistration([KVTensor(kv, "mla")])
    pool = HostPool(reg, 1, num_slots=4, pin=mode != "pageable")
    kwargs: dict[str, object] = {}
    if mode != "pageable":
        submit_path = mode.split("-")[0] if "-" in mode else "torch"
        kwargs = {"copy_mode": mode.split("-")[-1], **PATHS[submit_path]}
    a = torch.randn(2048, 2048, device="cuda")
    with make_transfer_worker(reg, pool, "cuda", **kwargs) as w:
        for _ in range(20):  # keep the compute stream busy for a while
            a = torch.tanh(a @ a)
        kv[3].fill_(7.0)  # the "attention output" the store must see
        w.submit_store(1, [3], [2])
        w.wait([1])
        assert w.get_finished()[0].success
    got = pool.tensor[2].view(torch.float32)
    assert torch.all(got == 7.0)
    pool.close()


@pytest.mark.parametrize("pin", ["compiled", "coalesced", "torch", "pageable"])
def test_failed_job_on_cuda_is_reported_failed(pin: str) -> None:
    kvs = make_layout("mla", torch.float16, "cuda")
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 1, num_slots=4, pin=pin != "pageable")
    before = snapshot(kvs)
    kwargs = PATHS[pin] if pin != "pageable" else {}

    def fail_two(job_id: int, direction: str) -> None:
        if job_id == 2:
            raise RuntimeError("injected")

    with make_transfer_worker(reg, pool, "cuda", fault_injector=fail_two, **kwargs) as w:
        w.submit_store(1, [1], [0])
        w.submit_store(2, [2], [1])
        w.wait([1, 2])
        w.submit_load(3, [0], [30])
        w.wait([3])
        ok = {r.job_id: r.success for r in w.get_finished()}
    assert ok == {1: True, 2: False, 3: True}
    assert_block_equals(kvs, 30, before[1])
    pool.close()


@pytest.mark.parametrize("missing", ["library", "nvrtc"])
def test_without_the_compiled_engine_the_worker_falls_back_to_torch_ops(
    monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    from kvtier.transfer import cuda_engine, nvrtc  # the nvrtc module cuda_engine calls

    if missing == "library":
        monkeypatch.setattr(cuda_engine, "library", lambda: None)
    else:
        monkeypatch.setattr(nvrtc, "cubin", lambda capability: None)
    kvs = make_layout("flash", torch.float16, "cuda", seed=4)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 1, num_slots=4)
    with pytest.raises(RuntimeError, match=r"native library|NVRTC"):
        CUDATransferWorker(reg, pool, compiled=True)
    before = snapshot(kvs)
    w = CUDATransferWorker(reg, pool)
    assert w.copy_path == "torch"
    with w:
        w.submit_store(1, [5], [2])
        w.wait([1])
        w.submit_load(2, [2], [9])
        w.wait([2])
        assert all(r.success for r in w.get_finished())
    assert_block_equals(kvs, 9, before[5])
    pool.close()


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_compiled_path_reports_long_bursts_in_order_with_their_times(depth: int) -> None:
    # Hundreds of jobs queued behind each other (each then starts when the one before it
    # ends, and is timed from there), collected while more are queued: the lanes' rings grow
    # and wrap. Every job is reported once, in order, with a plausible time and exact bytes.
    # With launch threads (depth 1, 2) most of them leave in merged batches.
    kv = torch.empty(600, 8, 1024, dtype=torch.uint8, device="cuda")
    fill_random_bytes(kv, 11)
    kvs = [KVTensor(kv, "mla")]
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 1, num_slots=600)
    before = snapshot(kvs, 300)
    rng = np.random.default_rng(5)
    slots = rng.permutation(600)
    results = []
    with CUDATransferWorker(reg, pool, compiled=True, coalesce_depth=depth) as w:
        for j in range(300):
            w.submit_store(j, [j], [int(slots[j])])
            if j % 97 == 96:
                results += w.get_finished()
        w.wait(range(300))  # a slot is loaded only once its store is reported done
        for j in range(300):
            w.submit_load(1000 + j, [int(slots[j])], [300 + j])
            if j % 89 == 88:
                results += w.get_finished()
        w.wait([*range(300), *range(1000, 1300)])
        results += w.get_finished()
    ids = [r.job_id for r in results]
    assert sorted(ids) == [*range(300), *range(1000, 1300)]
    assert [i for i in ids if i < 1000] == list(range(300))
    assert [i for i in ids if i >= 1000] == list(range(1000, 1300))
    assert all(r.success and r.bytes == 8192 and 0 < r.seconds < 1 for r in results)
    for j in range(300):
        assert_block_equals(kvs, 300 + j, before[j])
    pool.close()


def test_multiple_groups_use_their_own_tables(path: dict[str, Any]) -> None:
    # A hybrid model: two KV-cache groups of different page sizes share the pool's slots.
    a = make_layout("flash", torch.float16, "cuda", seed=1)
    b = [
        KVTensor(t.tensor, "mla", group=1)
        for t in make_layout("mla", torch.float16, "cuda", seed=2)
    ]
    reg = KVCacheRegistration(a + b)
    assert reg.page_bytes(0) != reg.page_bytes(1)
    pool = HostPool(reg, 2, num_slots=6)
    before_a, before_b = snapshot(a), snapshot(b)
    with CUDATransferWorker(reg, pool, **path) as w:
        w.submit_store(1, [5, 6, 7, 8], [0, 1], group=0)
        w.submit_store(2, [20, 3], [2], group=1)
        w.wait([1, 2])
        w.submit_load(3, [0, 1], [40, 41, 42], group=0, skip_blocks=1)
        w.submit_load(4, [2], [44], group=1, skip_blocks=1, urgent=True)
        w.wait([3, 4])
        results = {r.job_id: (r.success, r.bytes) for r in w.get_finished()}
    assert results == {
        1: (True, 4 * reg.page_bytes(0)),
        2: (True, 2 * reg.page_bytes(1)),
        3: (True, 3 * reg.page_bytes(0)),
        4: (True, reg.page_bytes(1)),
    }
    for dst, src in zip([40, 41, 42], [6, 7, 8], strict=True):
        assert_block_equals(a, dst, before_a[src])
    assert_block_equals(b, 44, before_b[3])
    pool.close()
