"""What the compiled copy thread adds over the Python one; the shared contract is tested for
both in test_cpu_worker.py."""

from __future__ import annotations

import array
import ctypes
import gc
import os
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.transfer import (
    CPUTransferWorker,
    HostPool,
    KVCacheRegistration,
    KVTensor,
    NativeCPUTransferWorker,
    TransferWorker,
    make_transfer_worker,
    native_worker,
)
from kvtier.transfer.native import library, submit_extension

pytestmark = pytest.mark.skipif(library() is None, reason="the compiled engine cannot be built")


@pytest.fixture(autouse=True, params=["extension", "ctypes"])
def submit_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test on both submit paths: the CPython extension, and ctypes where it is not
    built."""
    if request.param == "ctypes":
        monkeypatch.setattr("kvtier.transfer.native_worker.submit_extension", lambda: None)
    elif submit_extension() is None:
        pytest.skip("the submit extension cannot be built here (no Python headers?)")
    return str(request.param)


@pytest.fixture
def long_gil_slices() -> Iterator[None]:
    """A thread holding the GIL keeps it for seconds: other Python threads cannot run."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    yield
    sys.setswitchinterval(old)


def _setup() -> tuple[torch.Tensor, KVCacheRegistration, HostPool]:
    kv = torch.arange(8 * 4096, dtype=torch.int32).view(8, 4096)
    reg = KVCacheRegistration([KVTensor(kv, 0)])
    return kv, reg, HostPool(reg, 1, num_slots=8)


def _copied_while_holding_the_gil(
    worker: TransferWorker, pool: HostPool, kv: torch.Tensor, seconds: float
) -> bool:
    """Whether the copy lands while this thread keeps the GIL for up to `seconds` (less than
    the switch interval of `long_gil_slices`)."""
    want = kv[3].numpy().view(np.uint8)[-64:].tobytes()
    tail = pool.rows[5].numpy()[-64:]
    worker.submit_store(1, [3], [5])
    deadline = time.perf_counter() + seconds
    # Only tiny numpy calls: numpy releases the GIL in loops over larger arrays.
    while time.perf_counter() < deadline:
        if tail.tobytes() == want:
            return True
    return False


def test_copies_run_while_another_thread_holds_the_gil(long_gil_slices: None) -> None:
    kv, reg, pool = _setup()
    with NativeCPUTransferWorker(reg, pool) as w:
        # A generous bound for a loaded machine: it returns as soon as the bytes are there.
        assert _copied_while_holding_the_gil(w, pool, kv, seconds=10.0)
        w.wait([1])
        assert [r.success for r in w.get_finished()] == [True]


def test_the_python_thread_waits_for_the_gil(long_gil_slices: None) -> None:
    """The control for the test above: it can fail, and does with a Python copy thread."""
    kv, reg, pool = _setup()
    with CPUTransferWorker(reg, pool) as w:
        time.sleep(0.05)  # let the copy thread reach its wait for work
        assert not _copied_while_holding_the_gil(w, pool, kv, seconds=1.0)
        w.wait([1])  # blocking releases the GIL: now it runs
        assert [r.success for r in w.get_finished()] == [True]
        assert torch.equal(pool.rows[5, :16384], kv[3].view(torch.uint8))


def test_factory_picks_the_compiled_engine_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    _, reg, pool = _setup()
    with make_transfer_worker(reg, pool, "cpu", copy_threads=3) as w:
        assert isinstance(w, NativeCPUTransferWorker)
    monkeypatch.setattr("kvtier.transfer.factory.library", lambda: None)
    with make_transfer_worker(reg, pool, "cpu", copy_threads=3) as w:
        assert type(w) is CPUTransferWorker  # and the native-only argument is dropped


@pytest.mark.parametrize("native", [True, False])
def test_factory_drops_the_cuda_options_on_the_cpu(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One configuration for every device: the CUDA options mean nothing to a CPU worker.
    _, reg, pool = _setup()
    if not native:
        monkeypatch.setattr("kvtier.transfer.factory.library", lambda: None)
    cuda_only = {"copy_mode": "kernel", "compiled": True, "coalesce_depth": 2}
    with make_transfer_worker(reg, pool, "cpu", **cuda_only) as w:
        assert isinstance(w, NativeCPUTransferWorker) is native


def test_refuses_to_start_without_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    _, reg, pool = _setup()
    monkeypatch.setattr("kvtier.transfer.native_worker.library", lambda: None)
    with pytest.raises(RuntimeError, match="compiled copy engine is unavailable"):
        NativeCPUTransferWorker(reg, pool)


def test_a_dropped_worker_releases_its_engine() -> None:
    _, reg, pool = _setup()
    w = NativeCPUTransferWorker(reg, pool, fault_injector=lambda j, d: None)
    w.submit_store(1, [0], [0])
    w.wait([1])
    finalizer = w._finalizer
    w.shutdown()
    del w
    gc.collect()
    assert not finalizer.alive, "the engine (and its thread) outlived the worker"


_SubmitIds = ctypes.CFUNCTYPE(
    ctypes.c_int, *([ctypes.c_void_p] * 2), ctypes.c_int64, ctypes.c_int, ctypes.c_uint64,
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
)  # fmt: skip


def _refuse(w: NativeCPUTransferWorker, code: int) -> Callable[[], None]:
    """Make the engine's submit-with-ids answer `code` on both paths; returns the undo."""
    real_lib, real_fn = w._lib, w._submit_fn
    keep = [_SubmitIds(lambda *args: code)]  # alive while the engine may call it
    w._lib = _Refusing(real_lib, code)  # type: ignore[assignment]
    w._submit_fn = ctypes.cast(keep[0], ctypes.c_void_p).value

    def undo() -> None:
        w._lib, w._submit_fn = real_lib, real_fn
        keep.clear()

    return undo


class _Refusing:
    """The engine library, with `kvt_engine_submit_ids` answering `code`."""

    def __init__(self, real: object, code: int) -> None:
        self.real, self.code = real, code

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)

    def kvt_engine_submit_ids(self, *args: object) -> int:
        return self.code


def test_a_refused_submit_leaves_no_trace() -> None:
    _, reg, pool = _setup()
    with NativeCPUTransferWorker(reg, pool) as w:
        undo = _refuse(w, -1)
        with pytest.raises(RuntimeError, match="refused job 4"):
            w.submit_store(4, [0], [0])
        undo()
        w.submit_store(4, [0], [0])  # the id is free again
        w.wait([4])
        assert [r.job_id for r in w.get_finished()] == [4]


def test_arguments_the_engine_refuses_go_through_the_planner() -> None:
    """Were the C checks ever stricter than plan.py's, a valid job would still run."""
    kv, reg, pool = _setup()
    with NativeCPUTransferWorker(reg, pool) as w:
        undo = _refuse(w, 1)
        w.submit_store(1, [3], [5])
        undo()
        w.wait([1])
        assert [r.success for r in w.get_finished()] == [True]
    assert torch.equal(pool.rows[5, :16384], kv[3].view(torch.uint8))


def test_the_caller_may_reuse_its_id_arrays_at_once() -> None:
    """The engine copies the ids it is given: the caller's arrays are free after submit."""
    kv, reg, pool = _setup()
    gate = threading.Event()

    def held(job_id: int, direction: str) -> None:
        gate.wait(5)

    with NativeCPUTransferWorker(reg, pool, fault_injector=held) as w:
        blocks, slots = np.array([3, 4]), np.array([6, 7])
        w.submit_store(1, blocks, slots)
        blocks[:], slots[:] = [0, 1], [0, 1]  # before the copy runs
        gate.set()
        w.wait([1])
        assert [r.success for r in w.get_finished()] == [True]
    assert torch.equal(pool.rows[6, :16384], kv[3].view(torch.uint8))
    assert torch.equal(pool.rows[7, :16384], kv[4].view(torch.uint8))
    assert not torch.equal(pool.rows[0, :16384], kv[0].view(torch.uint8))


@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_large_jobs_split_over_helpers_are_byte_exact(threads: int, rows: int) -> None:
    """Large jobs are copied in slices by several threads (fewer rows than
    threads included); every byte must land in the right row."""
    gen = torch.Generator().manual_seed(rows)
    kvs = [torch.randint(-(2**31), 2**31 - 1, (40, 512 * 1024 // 4), generator=gen,
                         dtype=torch.int32) for _ in range(2)]  # fmt: skip
    reg = KVCacheRegistration([KVTensor(t, 0) for t in kvs])  # 1 MiB pages, two segments
    pool = HostPool(reg, 1, num_slots=20)
    before = [t.clone() for t in kvs]
    rng = np.random.default_rng(threads)
    src, slots = rng.permutation(20)[:rows], rng.permutation(20)[:rows]
    dst = 20 + np.arange(rows)[::-1].copy()  # descending: scattered on both sides
    with NativeCPUTransferWorker(reg, pool, copy_threads=threads) as w:
        w.submit_store(1, src, slots)
        w.submit_load(2, slots, dst)
        w.wait([1, 2])
        assert [r.success for r in w.get_finished()] == [True, True]
    for t, b in zip(kvs, before, strict=True):
        assert torch.equal(t[torch.from_numpy(dst)], b[torch.from_numpy(src)])
        assert torch.equal(t[:20], b[:20]), "a load wrote outside its blocks"


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4", 1025, 2**32 + 1])
def test_copy_threads_must_be_an_int_in_range(bad: object) -> None:
    _, reg, pool = _setup()
    with pytest.raises(ValueError, match="copy_threads"):
        NativeCPUTransferWorker(reg, pool, copy_threads=bad)  # type: ignore[arg-type]


def test_many_split_jobs_in_flight_then_shutdown() -> None:
    """Split and unsplit jobs queued together; a shutdown with jobs queued reports each one
    once, and the jobs that ran copied the right bytes."""
    gen = torch.Generator().manual_seed(7)
    kv = torch.randint(0, 2**31 - 1, (64, 256 * 1024 // 4), generator=gen, dtype=torch.int32)
    reg = KVCacheRegistration([KVTensor(kv, 0)])  # 256 KiB pages
    pool = HostPool(reg, 1, num_slots=64)
    before = kv.clone()
    rng = np.random.default_rng(1)
    w = NativeCPUTransferWorker(reg, pool, copy_threads=3)
    jobs = {}
    for j in range(30):
        n = int(rng.choice([1, 3, 12]))  # 256 KiB, 768 KiB and 3 MiB jobs
        blocks = rng.permutation(64)[:n]
        w.submit_store(j, blocks, blocks)  # block b into slot b
        jobs[j] = blocks
    w.wait([10])
    w.shutdown()
    results = w.get_finished()
    assert sorted(r.job_id for r in results) == list(range(30))
    assert all(r.success for r in results if r.job_id <= 10)
    for r in results:
        if r.success:
            for b in jobs[r.job_id]:
                assert torch.equal(pool.rows[int(b)], before[int(b)].view(torch.uint8))


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16])
def test_long_jobs_and_narrow_id_types(dtype: type[np.integer[Any]]) -> None:
    """Ids of any integer width, in jobs longer than the reusable id buffer's first size."""
    kv = torch.arange(3000 * 16, dtype=torch.int32).view(3000, 16)  # 64-byte pages
    reg = KVCacheRegistration([KVTensor(kv, 0)])
    pool = HostPool(reg, 1, num_slots=3000)
    rng = np.random.default_rng(5)
    src, slots = rng.permutation(3000).astype(dtype), rng.permutation(3000).astype(dtype)
    before = kv.clone()
    with NativeCPUTransferWorker(reg, pool) as w:
        w.submit_store(1, src, slots)
        w.wait([1])
        kv.zero_()
        w.submit_load(2, slots[:1700], src[:1700])
        w.wait([2])
        assert [r.success for r in w.get_finished()] == [True, True]
    idx = torch.from_numpy(src[:1700].astype(np.int64))
    assert torch.equal(kv[idx], before[idx])
    assert int(kv.count_nonzero()) == int(before[idx].count_nonzero())  # nothing else written


def test_concurrent_waiters_each_wake_when_their_job_is_done() -> None:
    """The engine wakes waiters only once a lane reaches the lowest job one of them needs:
    a waiter for a later job, registered first, must not hold back one for an earlier job,
    and each must find its job's bytes in place when it returns. (Without shared backlogs:
    a batch taken for the first waiter is reported whole, so an earlier job in it returns
    with the batch.)

    Jobs 9 and 15 do not start until the waiters for jobs 3 and 11 have returned (or 10 s
    have passed): a waiter woken only with the latest job waited for would hold them back,
    and the test reads that from events, not from clocks."""
    kv = torch.arange(32 * 1024, dtype=torch.int32).view(32, 1024)
    reg = KVCacheRegistration([KVTensor(kv, 0)])
    pool = HostPool(reg, 1, num_slots=32)
    pool.rows[30].fill_(9)
    woke = {3: threading.Event(), 11: threading.Event()}
    after = {9: 3, 15: 11}  # job -> the waiter that must have returned before it starts
    woke_first: dict[int, bool] = {}

    def slow(job: int, direction: str) -> None:
        if job in after:
            woke_first[job] = woke[after[job]].wait(10)
        time.sleep(0.02)  # paced, so that the waiters register while their jobs are queued

    w = NativeCPUTransferWorker(reg, pool, fault_injector=slow, share_backlog=False)
    for j in range(16):
        w.submit_store(j, [j], [j])
    w.submit_load(100, [30], [20], urgent=True)  # the urgent lane, ahead of the stores
    returned: dict[int, bool] = {}

    def waiter(job: int, slot: int, block: int) -> None:
        w.wait([job])
        returned[job] = torch.equal(pool.rows[slot, :4096], kv[block].view(torch.uint8))
        if job in woke:
            woke[job].set()

    threads = [threading.Thread(target=waiter, args=(100, 30, 20))]
    threads += [threading.Thread(target=waiter, args=(j, j, j)) for j in (15, 11, 3)]
    for t in threads:  # the later job's waiter first: each new one lowers the wake point
        t.start()
        time.sleep(0.002)
    for t in threads:
        t.join(timeout=30)
    try:
        assert not any(t.is_alive() for t in threads), "a waiter was never woken"
        assert returned == {100: True, 15: True, 11: True, 3: True}
        # Woken when its own job finished, not when the latest waited-for one did.
        assert woke_first == {9: True, 15: True}
    finally:
        w.shutdown()


def _tasks() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="thread affinity is Linux-only")
def test_copy_cpus_confine_every_copy_thread() -> None:
    """The engine's thread and its helpers run only on `copy_cpus`, and copy correctly."""
    cpu = max(os.sched_getaffinity(0))
    kv, reg, pool = _small_rows(16, 3, kib=256)
    before = _tasks()
    w = NativeCPUTransferWorker(reg, pool, copy_threads=3, copy_cpus=[cpu])
    try:
        started = _tasks() - before
        assert w.copy_cpus == (cpu,)
        assert len(started) == 3
        assert all(os.sched_getaffinity(t) == {cpu} for t in started)
        w.submit_store(1, np.arange(16), np.arange(16)[::-1].copy())  # 4 MiB: split in 3
        w.wait([1])
        assert [r.success for r in w.get_finished()] == [True]
    finally:
        w.shutdown()
    assert torch.equal(pool.rows[15 - np.arange(16)], kv.view(torch.uint8).view(16, -1))


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="thread affinity is Linux-only")
def test_copy_cpus_of_two_keep_the_helper_off_the_engines_cpu() -> None:
    """With two `copy_cpus`, a split job's helper runs on the one the engine's thread is not
    on, and never leaves the two."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    cpus = allowed[-2:]
    kv, reg, pool = _small_rows(16, 5, kib=256)
    before = _tasks()
    w = NativeCPUTransferWorker(reg, pool, copy_threads=2, copy_cpus=cpus)
    try:
        threads = _tasks() - before
        w.submit_store(1, np.arange(16), np.arange(16)[::-1].copy())  # 4 MiB: split in 2
        w.wait([1])
        assert [r.success for r in w.get_finished()] == [True]
        sets = sorted((os.sched_getaffinity(t) for t in threads), key=len)
        assert len(sets[0]) == 1 and sets[0] < set(cpus) and sets[1] == set(cpus)
    finally:
        w.shutdown()
    assert torch.equal(pool.rows[15 - np.arange(16)], kv.view(torch.uint8).view(16, -1))


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="thread affinity is Linux-only")
def test_copy_cpus_caps_the_default_thread_count() -> None:
    _, reg, pool = _setup()
    before = _tasks()
    with NativeCPUTransferWorker(reg, pool, copy_cpus=[0]):
        assert len(_tasks() - before) == 1
    with NativeCPUTransferWorker(reg, pool) as w:
        assert w.copy_cpus is None
    # An array of numpy ints, outside the declared type: kept as Python ints.
    with NativeCPUTransferWorker(reg, pool, copy_cpus=np.array([0, 0])) as w:  # type: ignore[arg-type]
        assert w.copy_cpus == (0,) and type(w.copy_cpus[0]) is int


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ([], "non-empty list"),
        ([0, "1"], "non-empty list"),
        ([True], "non-empty list"),
        ("0", "list of CPU numbers"),
        (0, "list of CPU numbers"),
        ([-1], r"no CPU \[-1\]"),
        ([0, 4096], r"no CPU \[4096\]"),
    ],
)
def test_bad_copy_cpus_are_refused(bad: object, match: str) -> None:
    _, reg, pool = _setup()
    before = _tasks()
    with pytest.raises(ValueError, match=match):
        NativeCPUTransferWorker(reg, pool, copy_cpus=bad)  # type: ignore[arg-type]
    assert _tasks() == before, "a refused worker left a thread behind"


def test_copy_cpus_are_checked_against_the_kernels_cpu_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With CPUs offline or absent, numbers have gaps: os.cpu_count() counts CPUs and does
    not number them, so a check against it refused CPU 8 on a "0-3,8-11" machine."""
    listed = tmp_path / "possible"
    listed.write_text("0-3,8-11,2000-2001\n")
    assert native_worker._possible_cpus(str(listed)) == {0, 1, 2, 3, 8, 9, 10, 11}
    listed.write_text("0\n")
    assert native_worker._possible_cpus(str(listed)) == {0}
    fallback = set(range(os.cpu_count() or 1))
    assert native_worker._possible_cpus(str(tmp_path / "absent")) == fallback
    listed.write_text("garbage\n")
    assert native_worker._possible_cpus(str(listed)) == fallback

    monkeypatch.setattr(native_worker, "_possible_cpus", lambda: {0, 1, 2, 3, 8, 9, 10, 11})
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert native_worker._check_cpus([9, 8, 9]) == [8, 9]
    with pytest.raises(ValueError, match=r"no CPU \[4, 12\]; this machine's CPUs are 0-3,8-11$"):
        native_worker._check_cpus([4, 12, 0])


def test_the_factory_passes_copy_cpus_and_the_fallback_ignores_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, reg, pool = _setup()
    with make_transfer_worker(reg, pool, "cpu", copy_cpus=[0], share_backlog=False) as w:
        assert isinstance(w, NativeCPUTransferWorker) and not w.share_backlog
    with pytest.raises(ValueError, match="copy_cpus"):
        make_transfer_worker(reg, pool, "cpu", copy_cpus=[-1])
    monkeypatch.setattr("kvtier.transfer.factory.library", lambda: None)
    with make_transfer_worker(
        reg, pool, "cpu", copy_cpus=[-1], copy_threads=3, share_backlog=False
    ) as w:
        assert type(w) is CPUTransferWorker


@pytest.mark.parametrize("depth", [True, -1, 9, 2.0, "2"])
def test_the_cuda_worker_refuses_a_bad_coalesce_depth_before_touching_cuda(depth: object) -> None:
    from kvtier.transfer.cuda_worker import CUDATransferWorker

    _, reg, pool = _setup()
    with pytest.raises(ValueError, match=f"coalesce_depth={depth!r} is not valid.*0 .off. to 8"):
        CUDATransferWorker(reg, pool, coalesce_depth=depth)  # type: ignore[arg-type]
    # A valid depth gets as far as the device check; the CPU backends ignore the option.
    with pytest.raises(ValueError, match="needs KV tensors on a CUDA device"):
        CUDATransferWorker(reg, pool, coalesce_depth=2)
    with make_transfer_worker(reg, pool, "cpu", coalesce_depth=2) as w:
        assert isinstance(w, NativeCPUTransferWorker)


def _id_forms() -> list[tuple[str, Callable[[list[int]], object], bool]]:
    """(name, ids -> that form, whether the extension reads it without numpy)."""
    return [
        ("list", list, True),
        ("tuple", tuple, True),
        ("int64", lambda v: np.array(v, np.int64), True),
        ("int32", lambda v: np.array(v, np.int32), True),
        ("uint8", lambda v: np.array(v, np.uint8), True),
        ("int16", lambda v: np.array(v, np.int16), True),
        ("uint64", lambda v: np.array(v, np.uint64), True),
        ("array.array", lambda v: array.array("q", v), True),
        ("memoryview", lambda v: memoryview(array.array("i", v)), True),
        ("numpy scalars", lambda v: [np.int64(x) for x in v], False),
        ("big-endian", lambda v: np.array(v, ">i8"), False),  # read in C only on such hosts
        ("strided", lambda v: np.repeat(np.array(v, np.int64), 2)[::2], False),
        ("torch", lambda v: torch.tensor(v), False),
    ]


@pytest.mark.parametrize(("form", "read_in_c"), [(f, c) for _, f, c in _id_forms()],
                         ids=[n for n, _, _ in _id_forms()])  # fmt: skip
def test_every_id_form_round_trips(
    submit_path: str, form: Callable[[list[int]], object], read_in_c: bool
) -> None:
    """Ids of each form reach the engine unchanged, on the extension's own path where it reads
    them and through numpy where it does not."""
    kv = torch.arange(16 * 64, dtype=torch.int32).view(16, 64)
    reg = KVCacheRegistration([KVTensor(kv, 0)])
    pool = HostPool(reg, 2, num_slots=6)
    before = kv.clone()
    with NativeCPUTransferWorker(reg, pool) as w:
        if submit_path == "extension" and read_in_c:
            w._submit_staged = None  # type: ignore[assignment,method-assign]  # must not be needed
        # Some forms (torch tensors) are outside the declared id types, deliberately.
        w.submit_store(1, form([9, 4, 12, 1]), form([5, 2]))  # type: ignore[arg-type]
        w.wait([1])
        kv.zero_()
        w.submit_load(2, form([2, 5]), form([7, 3, 0]), skip_blocks=1)  # type: ignore[arg-type]
        w.wait([2])
        results = w.get_finished()
    assert [(r.job_id, r.success, r.bytes) for r in results] == [(1, True, 1024), (2, True, 768)]
    # Slot 2 holds blocks 12, 1; slot 5 holds 9, 4; from the second block of slot 2 on.
    for dst, src in ((7, 1), (3, 9), (0, 4)):
        assert torch.equal(kv[dst], before[src])
    assert int(kv.count_nonzero()) == int(before[[1, 9, 4]].count_nonzero())


def test_the_extension_is_built_where_python_headers_are(submit_path: str) -> None:
    """CI has Python's headers: there the fast path must really be in use, not silently off
    (and the other path's tests must really run without it)."""
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.exists():
        pytest.skip("no Python headers here")
    ext = submit_extension()
    assert ext is not None
    _, reg, pool = _setup()
    with NativeCPUTransferWorker(reg, pool) as w:
        assert w._ext_submit is (ext.submit if submit_path == "extension" else None)


def test_the_extension_rejects_a_wrong_call() -> None:
    ext = submit_extension()
    if ext is None:
        pytest.skip("the submit extension cannot be built here")
    with pytest.raises(TypeError, match="9 arguments"):
        ext.submit(1, 2, 3)
    with pytest.raises(ValueError, match="needs the engine"):
        ext.submit(0, 0, 0, 1, 0, 1, [0], [0], 0)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="thread affinity is Linux-only")
@pytest.mark.parametrize("avoid", [True, False])
def test_the_copy_thread_keeps_off_the_submitters_cpu_for_jobs_it_copies_alone(
    avoid: bool,
) -> None:
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    mine = min(allowed)
    kv, reg, pool = _small_rows(16, 4, kib=256)
    before = _tasks()
    w = NativeCPUTransferWorker(reg, pool, copy_threads=2, avoid_submitter_cpu=avoid)
    os.sched_setaffinity(0, {mine})  # the submitting thread, on one known CPU
    try:
        threads = _tasks() - before
        w.submit_store(1, [3], [5])  # 256 KiB: copied by the engine's thread alone
        w.wait([1])
        kept_off = [t for t in threads if os.sched_getaffinity(t) == allowed - {mine}]
        assert len(kept_off) == (1 if avoid else 0)
        w.submit_store(2, np.arange(16), np.arange(16)[::-1].copy())  # 4 MiB: split
        w.wait([2])
        # The engine's thread may go anywhere; its helper is kept off the CPU it was on
        # (whatever `avoid` says: that setting is about the submitter).
        sets = sorted((os.sched_getaffinity(t) for t in threads), key=len)
        assert sets[1] == allowed and len(sets[0]) == len(allowed) - 1
        assert [r.success for r in w.get_finished()] == [True, True]
    finally:
        os.sched_setaffinity(0, allowed)
        w.shutdown()
    assert torch.equal(pool.rows[15 - np.arange(16)], kv.view(torch.uint8).view(16, -1))


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="thread affinity is Linux-only")
def test_the_copy_thread_moves_at_once_when_the_submitter_moves_onto_its_cpu() -> None:
    """A submit from a CPU the copy thread is kept on moves the thread off it there and then,
    not when the thread next gets to run: on two CPUs it would run only when the submitter
    sleeps."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    a, b = sorted(allowed)[:2]
    _, reg, pool = _small_rows(8, 6)
    gate = threading.Event()

    def hold(job_id: int, direction: str) -> None:
        if job_id == 2:
            gate.wait(5)

    before = _tasks()
    w = NativeCPUTransferWorker(reg, pool, copy_threads=1, fault_injector=hold)
    (engine,) = _tasks() - before
    try:
        os.sched_setaffinity(0, {a})
        w.submit_store(1, [1], [1])
        w.wait([1])
        assert a not in os.sched_getaffinity(engine)
        w.submit_store(2, [2], [2])  # the engine's thread now waits in the hook
        while w._engine_thread is None:
            time.sleep(0.001)
        os.sched_setaffinity(0, {b})
        w.submit_store(3, [3], [3])  # queued behind job 2: only the submit can move the thread
        assert os.sched_getaffinity(engine) == allowed - {b}
        gate.set()
        w.wait([2, 3])
        assert [r.success for r in w.get_finished()] == [True, True, True]
    finally:
        os.sched_setaffinity(0, allowed)
        gate.set()
        w.shutdown()


def test_avoid_submitter_cpu_must_be_a_bool() -> None:
    _, reg, pool = _setup()
    with pytest.raises(ValueError, match="avoid_submitter_cpu=1"):
        NativeCPUTransferWorker(reg, pool, avoid_submitter_cpu=1)  # type: ignore[arg-type]


def test_share_backlog_must_be_a_bool() -> None:
    _, reg, pool = _setup()
    with pytest.raises(ValueError, match="share_backlog='yes'"):
        NativeCPUTransferWorker(reg, pool, share_backlog="yes")  # type: ignore[arg-type]


class _Hold:
    """A fault hook that holds the engine's thread in job `job_id` until `gate` opens, and says
    when the thread got there: only then is every later job sure to queue behind it (a thread
    starved of CPU until the waiter arrives would otherwise batch the held job as well)."""

    def __init__(self, job_id: int, fail: int | None = None) -> None:
        self.job_id, self.fail = job_id, fail
        self.gate, self.reached = threading.Event(), threading.Event()

    def __call__(self, job_id: int, direction: str) -> None:
        if job_id == self.job_id:
            self.reached.set()
            self.gate.wait(5)
        if job_id == self.fail:
            raise RuntimeError("injected")

    def held(self) -> None:
        assert self.reached.wait(5), f"job {self.job_id} never reached the fault hook"


def _held_backlog(
    w: NativeCPUTransferWorker, hold: _Hold, submit: Callable[[], list[int]]
) -> list[int]:
    """Submit with the engine's thread held in the fault hook of the first job (`submit` calls
    `hold.held()` after submitting it), then wait for all while the gate opens: the engine finds
    the rest queued behind a waiter."""
    ids = submit()
    threading.Timer(0.3, hold.gate.set).start()
    w.wait(ids)
    return ids


def _small_rows(
    n: int, seed: int, kib: int = 16
) -> tuple[torch.Tensor, KVCacheRegistration, HostPool]:
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randint(0, 2**31 - 1, (n, kib * 1024 // 4), generator=gen, dtype=torch.int32)
    reg = KVCacheRegistration([KVTensor(kv, 0)])
    return kv, reg, HostPool(reg, 1, num_slots=n)


@pytest.mark.parametrize("share", [True, False])
def test_a_waiters_backlog_is_copied_by_every_copy_thread(share: bool) -> None:
    """Small jobs queued behind a waiting thread are copied in a batch over the copy threads
    (share_backlog), byte-exact and reported in order; without it, one by one."""
    kv, reg, pool = _small_rows(64, 1)
    rng = np.random.default_rng(2)
    blocks, slots = rng.permutation(64)[:41], rng.permutation(64)[:41]

    def submit() -> list[int]:
        for j in range(41):
            w.submit_store(j, [blocks[j]], [slots[j]])
            if j == 0:
                hold.held()
        return list(range(41))

    hold = _Hold(0)
    with NativeCPUTransferWorker(
        reg, pool, copy_threads=2, share_backlog=share, fault_injector=hold
    ) as w:
        assert w.share_backlog is share
        ids = _held_backlog(w, hold, submit)
        results = w.get_finished()
        # 40 jobs of 16 KiB behind the first: one batch of 640 KiB, in slices of 256 KiB.
        assert w.shared_jobs == (40 if share else 0)
    assert [r.job_id for r in results] == ids
    assert all(r.success and r.seconds > 0 for r in results)
    rows = kv.view(torch.uint8).view(64, -1)
    assert torch.equal(pool.rows[torch.from_numpy(slots)], rows[torch.from_numpy(blocks)])


def test_a_backlog_writing_one_row_twice_is_copied_in_order() -> None:
    """Loads into the same device block cannot run side by side: the last one must win."""
    kv, reg, pool = _small_rows(64, 3)
    rows = kv.view(torch.uint8).view(64, -1)
    want = rows.clone()
    with NativeCPUTransferWorker(reg, pool, copy_threads=2) as w:
        w.submit_store(0, np.arange(40), np.arange(40))
        w.wait([0])
        w.get_finished()
    hold = _Hold(1)
    with NativeCPUTransferWorker(reg, pool, copy_threads=2, fault_injector=hold) as w:

        def submit() -> list[int]:
            for j in range(40):  # slot j into block 50 + j % 8: each block written 5 times
                w.submit_load(1 + j, [j], [50 + j % 8])
                if j == 0:
                    hold.held()
            return list(range(1, 41))

        _held_backlog(w, hold, submit)
        assert all(r.success for r in w.get_finished())
        assert w.shared_jobs == 0
    for b in range(8):
        assert torch.equal(rows[50 + b], want[32 + b]), f"block {50 + b}: not the last load's"


def test_a_backlog_keeps_direction_order_and_isolates_a_failure() -> None:
    """A load queued behind the store that fills its slot reads the stored bytes; a job that
    fails inside a shared batch is reported failed and writes nothing, and the rest land."""
    kv, reg, pool = _small_rows(96, 5)
    rows = kv.view(torch.uint8).view(96, -1)
    want = rows.clone()
    pool.tensor.zero_()
    hold = _Hold(0, fail=7)
    with NativeCPUTransferWorker(reg, pool, copy_threads=2, fault_injector=hold) as w:

        def submit() -> list[int]:
            for j in range(40):
                w.submit_store(j, [j], [j])  # job 7 fails: slot 7 stays zero
                if j == 0:
                    hold.held()
            for j in range(40):
                w.submit_load(40 + j, [j], [50 + j % 46])
            return list(range(80))

        ids = _held_backlog(w, hold, submit)
        results = w.get_finished()
        assert w.shared_jobs == 39 + 40, "both runs of small jobs should have been shared"
    assert [r.job_id for r in results] == ids
    assert [r.job_id for r in results if not r.success] == [7]
    assert not pool.rows[7].any()
    for j in range(40):
        expect = torch.zeros_like(want[0]) if j == 7 else want[j]
        assert torch.equal(rows[50 + j % 46], expect), f"load {j}"


@pytest.mark.parametrize("seed", range(4))
def test_random_backlogs_match_a_sequential_model(seed: int) -> None:
    """Random stores and loads, in runs of one direction, over few enough rows that jobs in a
    backlog often write or read what another writes, waited for at random points while the
    engine is held: whatever is batched, and however, the final bytes are those of running
    every job in submission order."""
    rng = np.random.default_rng(seed)
    kv, reg, pool = _small_rows(160, seed, kib=64)
    rows = kv.view(torch.uint8).view(160, -1)
    pool.tensor.copy_(torch.from_numpy(rng.integers(0, 256, pool.tensor.shape, dtype=np.uint8)))
    dev, host = rows.clone(), pool.rows.clone()
    gates = [threading.Event() for _ in range(4)]
    held = {int(j): g for j, g in zip(rng.choice(300, 4, replace=False), gates, strict=True)}

    def hold(job_id: int, direction: str) -> None:
        if job_id in held:
            held[job_id].wait(5)

    with NativeCPUTransferWorker(reg, pool, copy_threads=2, fault_injector=hold) as w:
        pending: list[int] = []
        storing = True
        for j in range(300):
            n = int(rng.integers(1, 4))
            blocks, slots = rng.choice(160, n, replace=False), rng.choice(160, n, replace=False)
            storing ^= bool(rng.random() < 0.15)
            if storing:
                w.submit_store(j, blocks, slots)
                host[torch.from_numpy(slots)] = dev[torch.from_numpy(blocks)]
            else:
                w.submit_load(j, slots, blocks)
                dev[torch.from_numpy(blocks)] = host[torch.from_numpy(slots)]
            pending.append(j)
            if rng.random() < 0.05 or j == 299:
                # A held job, if queued, lets go while we wait.
                timers = [threading.Timer(0.05, g.set) for g in gates]
                for t in timers:
                    t.start()
                w.wait(pending)
                results = w.get_finished()
                assert [r.job_id for r in results] == pending
                assert all(r.success for r in results)
                pending = []
                # A timer still to fire after a short wait would open its gate early, and a later
                # held job would then pass with no backlog formed behind it.
                for t in timers:
                    t.cancel()
                    t.join()
                for g in gates:
                    g.clear()
        shared = w.shared_jobs
    assert torch.equal(rows, dev)
    assert torch.equal(pool.rows, host)
    assert shared > 0, "no backlog was shared: the test did not exercise batches"
