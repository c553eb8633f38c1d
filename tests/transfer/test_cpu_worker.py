"""Byte-exact round trips and fault behaviour of the CPU transfer backend."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable

import numpy as np
import pytest
import torch

from kvtier.base import TransferResult
from kvtier.transfer import HostPool, KVCacheRegistration, KVTensor
from kvtier.transfer.cpu_worker import CPUTransferWorker
from kvtier.transfer.native import library, submit_extension
from kvtier.transfer.native_worker import NativeCPUTransferWorker
from kvtier.transfer.testing import (
    DTYPES,
    NUM_BLOCKS,
    assert_block_equals,
    make_layout,
    snapshot,
)
from kvtier.transfer.worker import TransferWorker

CPUWorker = type[CPUTransferWorker] | type[NativeCPUTransferWorker]


@pytest.fixture(params=["python", "native", "native-ctypes"])
def worker_cls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> CPUWorker:
    """Both CPU backends: the copy thread in Python, and in compiled code (submitting through
    the CPython extension, or through ctypes where it is not built)."""
    if request.param == "python":
        return CPUTransferWorker
    if library() is None:
        pytest.skip("the compiled copy engine cannot be built here")
    if request.param == "native-ctypes":
        monkeypatch.setattr("kvtier.transfer.native_worker.submit_extension", lambda: None)
    elif submit_extension() is None:
        pytest.skip("the submit extension cannot be built here (no Python headers?)")
    return NativeCPUTransferWorker


def _drain(worker: TransferWorker, ids: Iterable[int]) -> list[TransferResult]:
    worker.wait(ids)
    return worker.get_finished()


def round_trip(
    worker_cls: CPUWorker,
    kvs: list[KVTensor],
    bpc: int,
    rng: np.random.Generator,
    *,
    stage_bytes: int = 1 << 20,
    jobs: int = 3,
) -> None:
    """Store random blocks to random slots, load them (from mid-chunk) into other blocks."""
    reg = KVCacheRegistration(kvs)
    chunks_per_job = 2
    pool = HostPool(reg, bpc, num_slots=jobs * chunks_per_job + 3)
    before = snapshot(kvs)
    half = NUM_BLOCKS // 2
    src_space, dst_space = rng.permutation(half), half + rng.permutation(NUM_BLOCKS - half)
    slots = rng.permutation(pool.num_slots)
    with worker_cls(reg, pool, stage_bytes=stage_bytes) as w:
        per_job = chunks_per_job * bpc
        plan = []
        for j in range(jobs):  # many stores in flight
            src = src_space[j * per_job : (j + 1) * per_job]
            sl = slots[j * chunks_per_job : (j + 1) * chunks_per_job]
            w.submit_store(j, src, sl)
            plan.append((src, sl))
        results = _drain(w, list(range(jobs)))
        assert [r.job_id for r in results] == list(range(jobs))
        assert all(r.success and r.bytes == per_job * reg.page_bytes() for r in results)
        loads = []
        for j, (src, sl) in enumerate(plan):  # many loads in flight
            skip = int(rng.integers(bpc))
            tail = int(rng.integers(bpc)) if per_job - skip > bpc else 0
            n = per_job - skip - tail
            dst = dst_space[j * per_job : j * per_job + n]
            w.submit_load(100 + j, sl, dst, skip_blocks=skip)
            loads.append((src[skip : skip + n], dst))
        results = _drain(w, [100 + j for j in range(jobs)])
        assert [r.job_id for r in results] == [100 + j for j in range(jobs)]
        assert all(r.success for r in results)
    for src, dst in loads:
        for s, d in zip(src, dst, strict=True):
            assert_block_equals(kvs, int(d), before[int(s)])
    for b in src_space:  # stores never write device memory
        assert_block_equals(kvs, int(b), before[int(b)])


@pytest.mark.parametrize("bpc", [1, 2, 4])
def test_round_trip_every_layout(worker_cls: CPUWorker, layout: str, bpc: int) -> None:
    round_trip(
        worker_cls, make_layout(layout, torch.float16, seed=bpc), bpc, np.random.default_rng(bpc)
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["flash", "cross_layer", "mla", "aliased"])
def test_round_trip_every_dtype(worker_cls: CPUWorker, name: str, dtype: torch.dtype) -> None:
    round_trip(worker_cls, make_layout(name, dtype, seed=3), 2, np.random.default_rng(7))


@pytest.mark.parametrize("bpc", [1, 4])
def test_round_trip_with_tiny_stage_takes_many_pieces(worker_cls: CPUWorker, bpc: int) -> None:
    kvs = make_layout("flash", torch.bfloat16, seed=5)
    round_trip(worker_cls, kvs, bpc, np.random.default_rng(11), stage_bytes=1)


@pytest.mark.parametrize("direction", ["host_run", "device_run"])
def test_one_pass_paths_round_trip(worker_cls: CPUWorker, direction: str) -> None:
    """Consecutive slots or consecutive device blocks take the single-pass copy paths."""
    kvs = make_layout("flashinfer", torch.float32, seed=9)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 2, num_slots=10)
    before = snapshot(kvs)
    if direction == "host_run":
        src, slots, dst = [9, 2, 17, 4, 30, 1], [3, 4, 5], [40, 33, 35, 47, 41, 25]
    else:
        src, slots, dst = [10, 11, 12, 13, 14, 15], [7, 0, 5], [30, 31, 32, 33, 34]
    with worker_cls(reg, pool) as w:
        w.submit_store(1, src, slots)
        w.submit_load(2, slots, dst, skip_blocks=1 if len(dst) == 5 else 0)
        results = _drain(w, [1, 2])
    assert [r.success for r in results] == [True, True]
    offset = 1 if len(dst) == 5 else 0
    for i, d in enumerate(dst):
        assert_block_equals(kvs, d, before[src[i + offset]])


def test_multiple_groups_use_their_own_pages(worker_cls: CPUWorker) -> None:
    a = make_layout("flash", torch.float16, seed=1)
    b = [KVTensor(t.tensor, "mla", group=1) for t in make_layout("mla", torch.float16, seed=2)]
    reg = KVCacheRegistration(a + b)
    pool = HostPool(reg, 2, num_slots=6)
    assert pool.slot_bytes == 2 * max(reg.page_bytes(0), reg.page_bytes(1))
    before_a, before_b = snapshot(a), snapshot(b)
    with worker_cls(reg, pool) as w:
        w.submit_store(1, [5, 6, 7, 8], [0, 1], group=0)
        w.submit_store(2, [20, 3], [2], group=1)
        w.submit_load(3, [0, 1], [40, 41, 42], group=0, skip_blocks=1)
        w.submit_load(4, [2], [44], group=1, skip_blocks=1)
        assert all(r.success for r in _drain(w, [1, 2, 3, 4]))
    for dst, src in zip([40, 41, 42], [6, 7, 8], strict=True):
        assert_block_equals(a, dst, before_a[src])
    assert_block_equals(b, 44, before_b[3])


def test_results_of_each_lane_come_in_submission_order(worker_cls: CPUWorker) -> None:
    kvs = make_layout("mla", torch.float16)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 1, num_slots=NUM_BLOCKS)
    rng = np.random.default_rng(0)

    def jitter(job_id: int, direction: str) -> None:
        time.sleep(float(rng.random()) * 1e-3)

    seen: list[int] = []
    with worker_cls(reg, pool, fault_injector=jitter) as w:
        for j in range(40):
            if j % 2:
                w.submit_load(j, [j], [j])
            else:
                w.submit_store(j, [j], [j])
            seen += [r.job_id for r in w.get_finished()]
        w.wait(range(40))
        seen += [r.job_id for r in w.get_finished()]
    assert sorted(seen) == list(range(40))
    stores = [j for j in seen if j % 2 == 0]
    loads = [j for j in seen if j % 2]
    assert stores == sorted(stores) and loads == sorted(loads)


def test_failed_job_is_reported_failed_and_later_jobs_are_correct(worker_cls: CPUWorker) -> None:
    kvs = make_layout("flash", torch.float16, seed=4)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 2, num_slots=8)
    before = snapshot(kvs)

    def fail_some(job_id: int, direction: str) -> None:
        if job_id in (2, 5):
            time.sleep(0.002)  # time spent on a failed job is not reported as copy time
            raise RuntimeError("injected copy failure")

    with worker_cls(reg, pool, fault_injector=fail_some) as w:
        w.submit_store(1, [0, 1], [0])
        w.submit_store(2, [2, 3], [1])  # fails
        w.submit_store(3, [4, 5], [2])
        w.submit_load(4, [0, 2], [30, 31, 32, 33])
        w.submit_load(5, [2], [40, 41])  # fails
        w.submit_load(6, [2], [42])
        results = {r.job_id: r for r in _drain(w, range(1, 7))}
    assert {j for j, r in results.items() if not r.success} == {2, 5}
    assert [(results[j].bytes, results[j].seconds) for j in (2, 5)] == [(0, 0.0), (0, 0.0)]
    for dst, src in zip([30, 31, 32, 33, 42], [0, 1, 4, 5, 4], strict=True):
        assert_block_equals(kvs, dst, before[src])
    for untouched in (40, 41):
        assert_block_equals(kvs, untouched, before[untouched])


def test_failure_inside_the_copy_marks_only_that_job(monkeypatch: pytest.MonkeyPatch) -> None:
    kvs = make_layout("mla", torch.float32, seed=6)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 1, num_slots=8)
    before = snapshot(kvs)
    w = CPUTransferWorker(reg, pool)
    real_run = w._copier.run

    def flaky(job, dev_idx, host_idx):  # type: ignore[no-untyped-def]
        if job.job_id == 7:
            first = dataclasses.replace(job, dev_rows=job.dev_rows[:1], host_rows=job.host_rows[:1])
            real_run(first, dev_idx[:1], host_idx[:1])  # partly written, then breaks
            raise RuntimeError("copy broke halfway")
        real_run(job, dev_idx, host_idx)

    monkeypatch.setattr(w._copier, "run", flaky)
    w.submit_store(7, [1, 2], [0, 1])
    w.submit_store(8, [3, 4], [2, 3])
    w.submit_load(9, [2, 3], [20, 21])
    results = {r.job_id: r.success for r in _drain(w, [7, 8, 9])}
    w.shutdown()
    assert results == {7: False, 8: True, 9: True}
    assert_block_equals(kvs, 20, before[3])
    assert_block_equals(kvs, 21, before[4])


def test_shutdown_with_jobs_in_flight_reports_each_job_once(worker_cls: CPUWorker) -> None:
    kvs = make_layout("cross_layer", torch.bfloat16, seed=8)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 1, num_slots=NUM_BLOCKS)
    before = snapshot(kvs)
    gate, started = threading.Event(), threading.Event()

    def slow_first(job_id: int, direction: str) -> None:
        if job_id == 0:
            started.set()
            gate.wait(5)

    w = worker_cls(reg, pool, fault_injector=slow_first)
    for j in range(20):
        w.submit_store(j, [j], [j])
    started.wait(5)  # job 0 is running, 1..19 are queued
    threading.Timer(0.05, gate.set).start()
    w.shutdown()
    w.shutdown()  # idempotent
    # Waiting for a cancelled job before collecting its result returns (it once hung).
    waiter = threading.Thread(target=w.wait, args=([19],), daemon=True)
    waiter.start()
    waiter.join(5)
    assert not waiter.is_alive(), "wait() for a cancelled job hung after shutdown"
    results = w.get_finished()
    # In submission order: the running job's result first, then the cancelled ones.
    assert [r.job_id for r in results] == list(range(20))
    assert {r.job_id for r in results if r.success} == {0}
    w.wait(range(20))  # nothing left in flight: returns at once
    with pytest.raises(RuntimeError, match="shut down"):
        w.submit_store(99, [0], [0])
    assert_block_equals(kvs, 0, before[0])
    assert torch.equal(pool.rows[0, : reg.page_bytes()], torch.cat(before[0]))


def test_urgent_load_overtakes_queued_loads(worker_cls: CPUWorker) -> None:
    kvs = make_layout("mla", torch.float16, seed=2)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 1, num_slots=8)
    gate, started = threading.Event(), threading.Event()

    def hold(job_id: int, direction: str) -> None:
        if job_id == 0:
            started.set()
            gate.wait(5)

    with worker_cls(reg, pool, fault_injector=hold) as w:
        w.submit_store(0, [1], [0])
        started.wait(5)  # job 0 is running; the next two queue behind it
        w.submit_load(1, [0], [10])
        w.submit_load(2, [0], [11], urgent=True)
        gate.set()
        order = [r.job_id for r in _drain(w, [0, 1, 2])]
    assert order == [0, 2, 1]


def test_submit_does_not_wait_for_copies(worker_cls: CPUWorker) -> None:
    kvs = make_layout("mla", torch.float16)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 1, num_slots=8)
    gate = threading.Event()

    def held(job_id: int, direction: str) -> None:
        gate.wait(5)

    with worker_cls(reg, pool, fault_injector=held) as w:
        for j in range(5):
            w.submit_store(j, [j], [j])  # would hang here if submit waited for the copy
        assert w.get_finished() == []
        gate.set()
        assert len(_drain(w, range(5))) == 5


def test_threads_submitting_at_once_each_get_their_own_jobs(worker_cls: CPUWorker) -> None:
    """Several threads submit at the same time (an engine with a thread per request batch):
    every job runs once, with its own bytes, and its result names its own id."""
    kv = torch.arange(64 * 256, dtype=torch.int32).view(64, 256)
    reg = KVCacheRegistration([KVTensor(kv, 0)])
    pool = HostPool(reg, 1, num_slots=64)
    errors: list[BaseException] = []
    with worker_cls(reg, pool) as w:

        def submit(first: int) -> None:
            try:
                for b in range(first, 64, 4):  # thread t stores blocks t, t + 4, ...
                    w.submit_store(b, [b], [63 - b])
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=submit, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        w.wait(range(64))
        results = w.get_finished()
    assert errors == []
    assert sorted(r.job_id for r in results) == list(range(64))
    assert all(r.success and r.bytes == 1024 for r in results)
    assert torch.equal(pool.rows[63 - torch.arange(64)], kv.view(torch.uint8).view(64, -1))


def test_the_caller_may_reuse_its_id_arrays_at_once(worker_cls: CPUWorker) -> None:
    """The job owns its rows: the Python worker once copied the caller's (reused) arrays'
    new contents, reporting success for bytes put in the wrong slots."""
    kv = torch.arange(16 * 64, dtype=torch.int32).view(16, 64)
    reg = KVCacheRegistration([KVTensor(kv, 0)])
    pool = HostPool(reg, 1, num_slots=8)
    gate = threading.Event()

    def held(job_id: int, direction: str) -> None:
        gate.wait(5)

    with worker_cls(reg, pool, fault_injector=held) as w:
        blocks, slots = np.array([3, 4]), np.array([6, 7])
        w.submit_store(1, blocks, slots)
        dst = torch.tensor([10, 11])  # np.asarray of a tensor is a view of it
        w.submit_load(2, [6, 7], dst)  # type: ignore[arg-type]  # a tensor: not a declared form
        blocks[:], slots[:], dst[:] = torch.tensor([0, 1]), torch.tensor([0, 1]), 12
        gate.set()
        assert [r.success for r in _drain(w, [1, 2])] == [True, True]
    rows = pool.rows.view(torch.int32)
    assert torch.equal(rows[6:8], kv[3:5]) and torch.equal(kv[10:12], kv[3:5])
    assert not torch.equal(rows[0], kv[0])


def test_a_storage_less_aligned_than_its_data_round_trips(worker_cls: CPUWorker) -> None:
    """A tensor whose data is 16-byte aligned in a storage that is not (`torch.from_numpy`
    of a sliced array): the Python worker once viewed the device rows as 8-byte and the host
    rows as 16-byte elements, and every job of consecutive rows failed."""
    nb, width = 8, 64
    raw = np.zeros(nb * width + 32, dtype=np.uint8)
    skew = (8 - raw.ctypes.data) % 16  # the storage starts at 8 mod 16
    storage = torch.from_numpy(raw[skew : skew + nb * width + 8])
    kv = storage[8:].view(nb, width)
    assert storage.data_ptr() % 16 == 8 and kv.data_ptr() % 16 == 0
    kv.copy_(torch.randint(0, 256, (nb, width), dtype=torch.uint8))
    before = kv.clone()
    reg = KVCacheRegistration([KVTensor(kv, 0)])
    pool = HostPool(reg, 1, num_slots=4)
    with worker_cls(reg, pool) as w:
        w.submit_store(1, [2, 3], [0, 1])  # consecutive slots: one index op per segment
        w.submit_load(2, [0, 1], [5, 6])  # consecutive device blocks
        assert [r.success for r in _drain(w, [1, 2])] == [True, True]
    assert torch.equal(kv[5:7], before[2:4])


class _Abort(BaseException):
    """Not an Exception, as pytest's `fail()` and `skip()` outcomes are not."""


def test_an_injector_raising_a_base_exception_fails_only_its_job(worker_cls: CPUWorker) -> None:
    """The Python worker's thread once died with the job (every later job lost, `wait`
    hanging); the compiled one let ctypes return an undefined value for it."""
    kvs = make_layout("mla", torch.float16, seed=3)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 1, num_slots=4)
    before = snapshot(kvs)

    def abort_first(job_id: int, direction: str) -> None:
        if job_id == 1:
            raise _Abort("injected")

    with worker_cls(reg, pool, fault_injector=abort_first) as w:
        w.submit_store(1, [0], [0])
        w.submit_store(2, [1], [1])
        w.submit_load(3, [1], [20])
        waiter = threading.Thread(target=w.wait, args=([1, 2, 3],), daemon=True)
        waiter.start()
        waiter.join(5)
        assert not waiter.is_alive(), "wait() hung: a job was lost"
        results = {r.job_id: r.success for r in w.get_finished()}
    assert results == {1: False, 2: True, 3: True}
    assert_block_equals(kvs, 20, before[1])
