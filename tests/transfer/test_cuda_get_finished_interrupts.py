"""An interrupt (KeyboardInterrupt) inside the CUDA worker's `get_finished`, at every point
where CPython can raise one in the frames of the worker's code (`helpers.interrupt_at`), as
test_get_finished_interrupts.py does for the CPU workers: each job is reported exactly once, by
that call or the next, is held until then, and its id is free again afterwards.

They were lost: the compiled engine's poll removed the results before Python held them (an
interrupt as it returned, or while Python built its lists, dropped them), and the torch-ops
path popped each job's record before its result was kept; their ids stayed taken for good.
Where the engine was freed at exit, the results it left were lost the same way, and the jobs
then reported failed. The compiled path runs over c/fake_cuda.c here
(c/finished_interrupt_check.py), the torch-ops path over stand-in events; both on a GPU with
`-m gpu`.
"""

from __future__ import annotations

import threading
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import kvtier.transfer.cuda_engine
import kvtier.transfer.cuda_worker
import kvtier.transfer.worker
from helpers import HARNESSES, FakeCudaEvent, get_finished_interrupted, run_over_fake_cuda
from kvtier.base import TransferResult
from kvtier.transfer import HostPool, KVCacheRegistration
from kvtier.transfer.cuda_worker import CUDATransferWorker, _Record
from kvtier.transfer.testing import make_layout

FILES = [kvtier.transfer.worker, kvtier.transfer.cuda_worker, kvtier.transfer.cuda_engine]


@pytest.mark.parametrize(("mode", "depth"), [("alive", 0), ("alive", 2), ("freed", 0)])
def test_an_interrupted_compiled_get_finished_loses_no_result(
    tmp_path: Path, mode: str, depth: int
) -> None:
    """The compiled path over the stand-in driver: results of all three lanes, two per engine
    call, in the engine ("alive") or kept when it was freed as at interpreter exit ("freed"),
    with and without launch threads; every point in worker.py, cuda_worker.py and
    cuda_engine.py."""
    check = (HARNESSES / "finished_interrupt_check.py").read_text()
    out = run_over_fake_cuda(tmp_path, check, str(depth), mode)
    assert out.strip() == "ok", out


def _torch_ops_worker() -> tuple[Any, FakeCudaEvent]:
    """A torch-ops `CUDATransferWorker`'s state without a GPU: stores 1 and 2 (2's end event
    raises), loads 3 (done) and 4 (still copying); returns it and 4's end event."""
    w: Any = object.__new__(CUDATransferWorker)
    pending = FakeCudaEvent(False)

    def record(job_id: int, end: FakeCudaEvent) -> _Record:
        return _Record(job_id, 64, True, FakeCudaEvent(True), end, None)  # type: ignore[arg-type]

    stores = [record(1, FakeCudaEvent(True)), record(2, FakeCudaEvent(None))]
    loads = [record(3, FakeCudaEvent(True)), record(4, pending)]
    w._engine = None
    w._lanes = {
        "store": SimpleNamespace(records=deque(stores)),
        "load": SimpleNamespace(records=deque(loads)),
    }
    w._events, w._indices = [], SimpleNamespace(give=lambda buf: None)
    w._by_id = {r.job_id: r for r in stores + loads}
    w._lock = threading.Lock()
    w._ready, w._ready_ids, w._unreported = [], set(), {1, 2, 3, 4}
    return w, pending


@pytest.mark.parametrize("module", FILES[:2], ids=lambda m: Path(m.__file__).name)
def test_an_interrupted_torch_ops_get_finished_loses_no_result(module: Any) -> None:
    """The torch-ops path (stand-in events): a job done, one whose end event raises (reported
    failed), one done in another lane, and one still copying (held, reported later)."""
    want = [
        TransferResult(1, True, 64, 0.002),
        TransferResult(2, False, 0, 0.0),
        TransferResult(3, True, 64, 0.002),
    ]
    n = 0
    while True:
        w, pending = _torch_ops_worker()
        got, fired = get_finished_interrupted(w, n, str(module.__file__), (1, 2, 3, 4))
        where = fired[0] if fired else "nowhere"
        assert sorted(got, key=lambda r: r.job_id) == want, f"interrupted {where}"
        assert w.holds(4) and not any(w.holds(j) for j in (1, 2, 3)), where
        assert [r.job_id for r in w._lanes["load"].records] == [4], where
        pending.done = True
        assert w.get_finished() == [TransferResult(4, True, 64, 0.002)], where
        assert not w.holds(4) and w.get_finished() == [], where
        if not fired:
            break
        n += 1
    assert n > 0, "no interrupt point was reached"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("compiled", "module"),
    [(True, m) for m in FILES] + [(False, m) for m in FILES[:2]],
    ids=lambda v: Path(v.__file__).name if hasattr(v, "__file__") else ("compiled", "torch")[not v],
)
def test_an_interrupted_get_finished_on_a_gpu_loses_no_result(
    compiled: bool, module: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both paths on a real GPU: stores, a load and an urgent load, interrupted at every point
    of `module`'s frames, with two results per engine call on the compiled path."""
    monkeypatch.setattr(kvtier.transfer.cuda_engine, "_POLL", 2)
    kvs = make_layout("flash", torch.float16, "cuda", seed=3)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 1, num_slots=8, pin=True)
    page = reg.page_bytes(0)
    jobs = [1, 2, 3, 4, 5]
    n = 0
    try:
        while True:
            w = CUDATransferWorker(reg, pool, compiled=None if compiled else False,
                                   copy_mode="kernel")  # fmt: skip
            if w.copy_path != ("compiled" if compiled else "torch"):
                w.shutdown()
                pytest.skip("the compiled engine does not build here")
            try:
                for j in (1, 2, 3):
                    w.submit_store(j, [j], [j])
                w.submit_load(4, [6], [10])
                w.submit_load(5, [7], [11], urgent=True)
                w.wait(jobs)
                torch.cuda.synchronize()
                got, fired = get_finished_interrupted(w, n, str(module.__file__), jobs)
                where = fired[0] if fired else "nowhere"
                assert sorted(r.job_id for r in got) == jobs, f"interrupted {where}"
                assert all(r.success and r.bytes == page for r in got), where
                assert not any(w.holds(j) for j in jobs), where
                assert w.get_finished() == [], where
                w.submit_store(1, [4], [4])  # the id is free again
                w.wait([1])
                assert [r.job_id for r in w.get_finished()] == [1], where
            finally:
                w.shutdown()
            if not fired:
                break
            n += 1
    finally:
        pool.close()
    assert n > 0, "no interrupt point was reached"
