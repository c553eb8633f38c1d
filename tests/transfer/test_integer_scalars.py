"""Job ids, `skip_blocks` and groups given as numpy or torch integer scalars are taken on every
CPU backend and submit path, as block ids already were; bools and floats are refused, naming
the value, with nothing queued."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, cast

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
)
from kvtier.transfer.native import library
from kvtier.transfer.testing import assert_block_equals, make_layout, snapshot

Make = Callable[[KVCacheRegistration, HostPool], TransferWorker]


def _native(reg: KVCacheRegistration, pool: HostPool) -> TransferWorker:
    if library() is None:
        pytest.skip("no compiled copy engine here")
    return NativeCPUTransferWorker(reg, pool, copy_threads=1)


def _native_ctypes(reg: KVCacheRegistration, pool: HostPool) -> TransferWorker:
    w = _native(reg, pool)
    w._ext_submit = None  # type: ignore[attr-defined]  # the ctypes route, as without headers
    return w


WORKERS: dict[str, Make] = {
    "python": lambda reg, pool: CPUTransferWorker(reg, pool),
    "native": _native,
    "native-ctypes": _native_ctypes,
}

SCALARS: dict[str, Callable[[int], Any]] = {
    "np.int64": np.int64,
    "np.int32": np.int32,
    "np.uint16": np.uint16,
    "torch": torch.tensor,
    "torch.int32": lambda v: torch.tensor(v, dtype=torch.int32),
}


@pytest.mark.parametrize("scalar", list(SCALARS))
@pytest.mark.parametrize("worker", list(WORKERS))
def test_integer_scalars_are_taken_for_job_id_skip_and_group(worker: str, scalar: str) -> None:
    kvs = make_layout("flash", torch.float16)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 2, num_slots=4)
    before = snapshot(kvs)
    conv = SCALARS[scalar]
    with WORKERS[worker](reg, pool) as w:
        w.submit_store(conv(3), [7, 9], [1], group=conv(0))
        w.wait([3])
        w.submit_load(conv(4), [1], [20], group=conv(0), skip_blocks=conv(1))
        w.wait([4])
        results = w.get_finished()
        assert [(r.job_id, r.success) for r in results] == [(3, True), (4, True)]
        assert all(type(r.job_id) is int for r in results)
        assert not w.holds(3) and not w.holds(4)
    assert_block_equals(kvs, 20, before[9])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"job_id": np.True_}, "job_id=np.True_ must be an int"),
        ({"job_id": torch.tensor(True)}, r"job_id=tensor\(True\) must be an int"),
        ({"job_id": np.float64(3.0)}, r"job_id=np.float64\(3.0\) must be an int"),
        ({"job_id": torch.tensor([3])}, r"job_id=tensor\(\[3\]\) must be an int"),
        ({"job_id": np.uint64(2**63)}, "does not fit in 64 bits"),
        ({"skip_blocks": np.True_}, "skip_blocks=np.True_ must be an int"),
        ({"skip_blocks": np.float32(1)}, r"skip_blocks=np.float32\(1.0\) must be an int"),
        ({"skip_blocks": np.int64(2)}, r"skip_blocks=2 must be in 0\.\.1"),
        ({"group": torch.tensor(0.0)}, r"group=tensor\(0\.\) must be an int"),
        ({"group": np.int8(1)}, r"group=1 is not registered; groups are \[0\]"),
    ],
)
@pytest.mark.parametrize("worker", list(WORKERS))
def test_bad_scalars_are_refused_naming_them(
    worker: str, kwargs: dict[str, Any], message: str
) -> None:
    reg = KVCacheRegistration(make_layout("flash", torch.float16))
    pool = HostPool(reg, 2, num_slots=4)
    with WORKERS[worker](reg, pool) as w:
        args: dict[str, Any] = {"job_id": 5, "slots": [1], "device_blocks": [20], **kwargs}
        with pytest.raises(ValueError, match=message):
            w.submit_load(**args)
        job_id = args["job_id"]
        assert not w.holds(5) and w.get_finished() == []
        if isinstance(job_id, int):
            return
        # The id was not taken: a valid job under it goes through.
        w.submit_load(5, [1], [20])
        w.wait([5])
        assert [r.success for r in w.get_finished()] == [True]


@pytest.mark.parametrize("worker", list(WORKERS))
def test_wait_and_holds_take_a_torch_scalar_id(worker: str) -> None:
    """A tensor hashes by identity: taken as it is, `wait` returned before the job ran and
    `holds` said False while it was queued."""
    gate = threading.Event()
    reg = KVCacheRegistration(make_layout("flash", torch.float16))
    pool = HostPool(reg, 1, num_slots=4)
    w: TransferWorker
    if worker == "python":
        w = CPUTransferWorker(reg, pool, fault_injector=lambda j, d: gate.wait(30))
    else:
        if library() is None:
            pytest.skip("no compiled copy engine here")
        w = NativeCPUTransferWorker(reg, pool, fault_injector=lambda j, d: gate.wait(30))
        if worker == "native-ctypes":
            w._ext_submit = None  # the ctypes route, as without headers
    with w:
        w.submit_store(cast(Any, torch.tensor(7)), [3], [0])
        assert w.holds(cast(Any, torch.tensor(7))) and w.holds(cast(Any, np.int64(7)))
        threading.Timer(0.05, gate.set).start()
        tensor_ids: list[Any] = [torch.tensor(7)]
        w.wait(tensor_ids)
        # Finished: its result is there without polling again.
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(7, True)]
        with pytest.raises(ValueError, match=r"job id=1.5 must be an int"):
            w.wait([cast(Any, 1.5)])


def _any(value: object) -> Any:
    """`value`, typed for calls whose annotations say int: numpy's and torch's are the point."""
    return value


def test_constructors_take_integer_scalars() -> None:
    """KVTensor's group and block dimension, HostPool's sizes and copy_threads: numpy's and
    torch's integers are taken as ints (they were refused as "not an int")."""
    t = torch.zeros(2, 8, 4, 2, 8, dtype=torch.float16)
    kv = KVTensor(t, _any(np.int64(1)), group=_any(np.int32(2)))
    assert (kv.block_dim, kv.group, type(kv.group)) == (1, 2, int)
    assert KVTensor(t, _any(torch.tensor(1))).block_dim == 1
    reg = KVCacheRegistration([KVTensor(t, "flash", group=_any(torch.tensor(0)))])
    assert reg.groups == (0,)
    pool = HostPool(reg, _any(np.int64(2)), num_slots=_any(np.int32(3)))
    assert (pool.blocks_per_chunk, pool.num_slots, type(pool.num_slots)) == (2, 3, int)
    budget = HostPool(reg, _any(torch.tensor(1)), byte_budget=_any(np.uint32(5 * reg.page_bytes())))
    assert budget.num_slots == 5
    assert (
        HostPool.slots_for_budget(reg, _any(np.int8(1)), _any(np.int64(3 * reg.page_bytes()))) == 3
    )
    if library() is not None:
        with NativeCPUTransferWorker(reg, pool, copy_threads=_any(np.int64(2))) as w:
            w.submit_store(1, [0, 1], [2])
            w.wait([1])
            assert [r.success for r in w.get_finished()] == [True]


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda t, reg: KVTensor(t, "flash", group=_any(np.True_)),
            ValueError,
            "group=np.True_",
        ),
        (lambda t, reg: KVTensor(t, "flash", group=_any(np.int64(-1))), ValueError, "non-negative"),
        (lambda t, reg: KVTensor(t, _any(np.float64(1))), TypeError, r"layout=np.float64\(1.0\)"),
        (lambda t, reg: KVTensor(t, _any(np.int64(7))), ValueError, "block dimension 7 is out of"),
        (lambda t, reg: HostPool(reg, _any(np.True_), num_slots=2), ValueError, "blocks_per_chunk"),
        (
            lambda t, reg: HostPool(reg, 1, num_slots=_any(np.int64(0))),
            ValueError,
            r"num_slots=np.int64\(0\) must be a positive int",
        ),
        (lambda t, reg: HostPool(reg, 1, byte_budget=_any(2.0**20)), ValueError, "byte_budget"),
        (
            lambda t, reg: NativeCPUTransferWorker(
                reg, HostPool(reg, 1, num_slots=2), copy_threads=_any(np.int64(0))
            ),
            ValueError,
            r"copy_threads=np.int64\(0\) must be an int from 1",
        ),
    ],
)
def test_constructors_refuse_bad_scalars_naming_them(
    make: Callable[[torch.Tensor, KVCacheRegistration], object],
    error: type[Exception],
    message: str,
) -> None:
    t = torch.zeros(2, 8, 4, 2, 8, dtype=torch.float16)
    reg = KVCacheRegistration([KVTensor(t, "flash")])
    with pytest.raises(error, match=message):
        make(t, reg)
