"""`CUDATransferWorker`'s compiled submit paths interrupted (KeyboardInterrupt) just before and
just after the engine's call, over c/fake_cuda.c with torch's CUDA calls stood in as in
worker_check.py: run by test_interrupt_cuda.py with the fake as the `libcuda.so.1` on
LD_LIBRARY_PATH. Argument: the launch threads' depth (0: none). Prints "ok" when every check
passes.

The engine numbers each lane's jobs itself, and the worker counts along (`wait` names a job
by that number): after the interrupt, `holds` must say whether the job was queued, the
worker's count must be the engine's, the job must be reported exactly once if queued and never
if not, and a later job must be waited for by its own number.
"""

from __future__ import annotations

import sys

import torch
from worker_check import _Stream, stand_in_for_the_gpu

from helpers import LibWith, interrupt_once
from kvtier.base import TransferResult
from kvtier.transfer import HostPool, KVCacheRegistration
from kvtier.transfer.cuda_worker import CUDATransferWorker, _lane
from kvtier.transfer.plan import Direction
from kvtier.transfer.testing import assert_block_equals, make_layout, snapshot


def submit(w: CUDATransferWorker, kind: str, job_id: int, n: int) -> None:
    """Job `n` of a scenario: stores of blocks 2n, 2n+1 into slot n; urgent loads of slot 1
    into blocks 20 + 2n, 21 + 2n (job 1, a store of slot 1, comes first)."""
    if kind == "store" or n == 1:
        w.submit_store(job_id, [2 * n, 2 * n + 1], [n])
    else:
        w.submit_load(job_id, [1], [20 + 2 * n, 21 + 2 * n], urgent=True)


def drain(w: CUDATransferWorker, ids: list[int]) -> list[TransferResult]:
    w.wait(ids)
    return w.get_finished()


def scenario(
    reg: KVCacheRegistration, pool: HostPool, depth: int, route: str, when: str, kind: str
) -> None:
    what = f"{route}/{when}/{kind}/depth {depth}"
    planned = route == "planned"  # a fault injector sends every job through plan.py's Job
    _Stream._next = 1  # the last scenario's streams again: the fake has room for 16
    w = CUDATransferWorker(
        reg, pool, copy_mode="kernel", compiled=True, coalesce_depth=depth,
        fault_injector=(lambda j, d: None) if planned else None,
    )  # fmt: skip
    engine = w._engine
    assert engine is not None
    if route == "ctypes":
        w._ext_submit = None
    submit(w, kind, 1, 1)
    assert [r.job_id for r in drain(w, [1])] == [1], what
    if route == "extension":
        assert w._ext_submit is not None
        w._ext_submit = interrupt_once(w._ext_submit, when)
    else:
        name = "kvt_cuda_submit" if planned else "kvt_cuda_submit_ids"
        fn = interrupt_once(getattr(engine._lib, name), when)
        engine._lib = LibWith(engine._lib, **{name: fn})  # type: ignore[assignment]
    try:
        submit(w, kind, 2, 2)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError(f"{what}: the interrupt did not come")
    queued = when == "after"
    assert w.holds(2) is queued, what
    lane = _lane(Direction.STORE if kind == "store" else Direction.LOAD, kind != "store")
    assert w._next_seq[lane] == engine.accepted(lane) + 1, (what, w._next_seq, lane)
    if queued:
        try:
            submit(w, kind, 2, 2)
        except ValueError:
            pass
        else:
            raise AssertionError(f"{what}: a second job 2 was accepted while one is queued")
    submit(w, kind, 3, 3)
    assert w._live[3].seq == engine.accepted(lane), what  # waited for by its own number
    results = drain(w, [2, 3])
    if not queued:  # the id is free: submit it for real
        submit(w, kind, 2, 2)
        results += drain(w, [2])
    page = reg.page_bytes(0)
    got = sorted((r.job_id, r.success, r.bytes) for r in results)
    assert got == [(2, True, 2 * page), (3, True, 2 * page)], (what, got)
    assert not w.holds(2)
    w.shutdown()


def main(depth: int) -> None:
    kvs = make_layout("flash", torch.float16, "cpu", seed=7)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 2, num_slots=8, pin=False)
    reg.device = torch.device("cuda", 0)  # as the worker will see it
    pool.pinned = True
    stand_in_for_the_gpu(pool)
    before = snapshot(kvs)
    for route in ("extension", "ctypes", "planned"):
        for when in ("before", "after"):
            for kind in ("store", "urgent_load"):
                scenario(reg, pool, depth, route, when, kind)
    # The bytes: slots 1-3 hold blocks 2-7, and every urgent load put slot 1 into its blocks.
    for dst in (24, 25, 26, 27):
        assert_block_equals(kvs, dst, before[2 + dst % 2])
    pool.pinned = False
    pool.close()
    print("ok")


if __name__ == "__main__":
    main(int(sys.argv[1]))
