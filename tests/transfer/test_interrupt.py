"""An interrupt (KeyboardInterrupt) during a submit, on both CPU backends and every submit path
of the compiled one: raised just before the engine is handed the job, just after it took it,
and, on the Python copy thread, between any two steps of `_submit`. Python raises a pending
KeyboardInterrupt as a C call returns or a Python function starts, so each is a real place.

Afterwards `holds(job_id)` must say whether the job was queued, and the rest must agree with
it: a held job runs, is reported exactly once and its id stays taken until then; a job not
held is never reported and its id is free; `wait` neither misses a queued job nor waits for
one that is not, and a later job's wait lasts until that job is done (its sequence number is
never the interrupted job's). The CUDA worker's compiled paths get the same checks over a
stand-in driver (test_interrupt_cuda.py); the connector's side is
tests/connector/test_interrupt_worker.py.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import sysconfig
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kvtier.transfer
from helpers import LibWith, interrupt_once
from kvtier.base import TransferResult
from kvtier.transfer import (
    CPUTransferWorker,
    HostPool,
    KVCacheRegistration,
    KVTensor,
    NativeCPUTransferWorker,
    TransferWorker,
)
from kvtier.transfer.native import library, submit_extension
from kvtier.transfer.plan import Job

PAGE = 4096 * 4  # bytes of one block of `_setup`'s tensor

# (path, where the interrupt comes) -> whether the job is queued; None: either, as long as
# the worker's account agrees with what happens.
POINTS: dict[tuple[str, str], bool | None] = {
    ("extension", "before"): False,  # as the extension's submit is called
    ("extension", "after"): True,  # as it returns, the engine holding the job
    ("ctypes", "before"): False,  # kvt_engine_submit_ids, through ctypes
    ("ctypes", "after"): True,
    ("planned", "before"): False,  # kvt_engine_submit: a job the planner made
    ("planned", "after"): True,
    ("python", "entry"): False,  # CPUTransferWorker._submit starts
    ("python", "return"): True,  # it returned
    ("python", "in_flight"): None,  # it marked the job in flight
    ("python", "append"): None,  # it queued the job
    ("python", "notify"): None,  # it is about to wake the copy thread
}


def _setup() -> tuple[torch.Tensor, KVCacheRegistration, HostPool]:
    kv = torch.arange(8 * 4096, dtype=torch.int32).view(8, 4096)
    reg = KVCacheRegistration([KVTensor(kv, 0)])
    return kv, reg, HostPool(reg, 1, num_slots=8)


class _Set(set[int]):
    def __init__(self, items: set[int], arm: Callable[[Callable[..., Any]], Callable[..., Any]]):
        super().__init__(items)
        self.add = arm(super().add)  # type: ignore[method-assign]


class _Deque(deque[Job]):
    def __init__(self, arm: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        super().__init__()
        self.append = arm(super().append)  # type: ignore[method-assign]


def _arm(w: TransferWorker, path: str, point: str) -> None:
    """Make the next submit of `w` raise KeyboardInterrupt at `point` of `path`."""
    if path == "extension":
        assert isinstance(w, NativeCPUTransferWorker) and w._ext_submit is not None
        w._ext_submit = interrupt_once(w._ext_submit, point)
    elif path == "ctypes":
        assert isinstance(w, NativeCPUTransferWorker)
        fn = interrupt_once(w._lib.kvt_engine_submit_ids, point)
        w._lib = LibWith(w._lib, kvt_engine_submit_ids=fn)  # type: ignore[assignment]
    elif path == "planned":
        assert isinstance(w, NativeCPUTransferWorker)
        lib: Any = w._lib  # the _Lib of `_worker`
        lib.kvt_engine_submit = interrupt_once(lib.real.kvt_engine_submit, point)
    else:
        assert isinstance(w, CPUTransferWorker)
        jobs = w._jobs
        armed = [True]  # one interrupt, in whichever of the queues the job goes to

        def arm(fn: Callable[..., Any]) -> Callable[..., Any]:
            return interrupt_once(fn, "after", armed)

        if point in ("entry", "return"):
            when = "before" if point == "entry" else "after"
            w._submit = interrupt_once(w._submit, when)  # type: ignore[method-assign]
        elif point == "in_flight":
            jobs.in_flight = _Set(jobs.in_flight, arm)
        elif point == "append":
            jobs.queue, jobs.urgent = _Deque(arm), _Deque(arm)
        else:
            jobs.cv.notify_all = interrupt_once(jobs.cv.notify_all, "before")  # type: ignore[method-assign]


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """Holds job 3's copy until set (set at the end in any case)."""
    g = threading.Event()
    yield g
    g.set()


def _worker(path: str, gate: threading.Event) -> tuple[torch.Tensor, HostPool, TransferWorker]:
    if path != "python" and library() is None:
        pytest.skip("the compiled copy engine cannot be built here")
    if path == "extension" and submit_extension() is None:
        pytest.skip("the submit extension cannot be built here (no Python headers?)")
    kv, reg, pool = _setup()

    def hold_three(job_id: int, direction: str) -> None:
        if job_id == 3:
            gate.wait(30)

    if path == "python":
        return kv, pool, CPUTransferWorker(reg, pool, fault_injector=hold_three)
    w = NativeCPUTransferWorker(reg, pool, fault_injector=hold_three)
    if path != "extension":
        w._ext_submit = None
    if path == "planned":  # the C planner refuses: every job goes through plan.py's Job
        w._lib = LibWith(w._lib, kvt_engine_submit_ids=lambda *args: 1)  # type: ignore[assignment]
    return kv, pool, w


def _waiter(w: TransferWorker, ids: list[int]) -> threading.Thread:
    t = threading.Thread(target=w.wait, args=(ids,), daemon=True)
    t.start()
    return t


def _submit(w: TransferWorker, kind: str, job_id: int, n: int) -> None:
    """Job `n` (1, 2 or 3) of a test: stores of block n into slot n; urgent loads of slot 1
    into block 4 + n (job 1, which stores slot 1, comes first)."""
    if kind == "store" or n == 1:
        w.submit_store(job_id, [n], [n])
    else:
        w.submit_load(job_id, [1], [4 + n], urgent=True)


def _drain(w: TransferWorker, ids: set[int]) -> list[TransferResult]:
    """Every result until each of `ids` has been reported (and a little longer)."""
    got: list[TransferResult] = []
    deadline = time.monotonic() + 30
    while not ids <= {r.job_id for r in got} and time.monotonic() < deadline:
        got += w.get_finished()
        time.sleep(0.005)
    time.sleep(0.05)
    return got + w.get_finished()


@pytest.mark.parametrize("kind", ["store", "urgent_load"])
@pytest.mark.parametrize(("path", "point"), list(POINTS))
def test_an_interrupted_submit_is_held_and_reported_once_or_not_at_all(
    path: str, point: str, kind: str, gate: threading.Event
) -> None:
    kv, pool, w = _worker(path, gate)
    with w:
        _submit(w, kind, 1, 1)
        w.wait([1])
        _arm(w, path, point)
        with pytest.raises(KeyboardInterrupt):
            _submit(w, kind, 2, 2)
        held = w.holds(2)
        if POINTS[path, point] is not None:
            assert held is POINTS[path, point]
        if held:  # its id stays taken until it is reported
            with pytest.raises(ValueError, match="already in flight"):
                _submit(w, kind, 2, 2)
        # Without another submit: a queued job runs (the interrupt may have come before the
        # copy thread was woken), and wait() returns for it; at once for a job not queued.
        early = _waiter(w, [2])
        early.join(10)
        assert not early.is_alive(), "wait() for the interrupted job did not return"

        _submit(w, kind, 3, 3)  # held at its copy until the gate opens
        if isinstance(w, NativeCPUTransferWorker):
            seqs = [(live.lane, live.seq) for live in w._live.values()]
            assert len(set(seqs)) == len(seqs), f"a sequence number was used twice: {seqs}"
        late = _waiter(w, [3])
        late.join(0.3)
        assert late.is_alive(), "wait() for job 3 returned before job 3 was copied"
        gate.set()
        late.join(10)
        assert not late.is_alive()

        results = _drain(w, {1, 2, 3} if held else {1, 3})
        ids = sorted(r.job_id for r in results)
        assert ids == ([1, 2, 3] if held else [1, 3]), results
        assert all(r.success and r.bytes == PAGE for r in results), results
        assert not w.holds(2)
        if not held:  # the id is free, and nothing of the job ran: submit it for real
            _submit(w, kind, 2, 2)
            assert [r.job_id for r in _drain(w, {2})] == [2]
    # Every job's bytes: job 2's too, whichever submit of it ran.
    for n in (1, 2, 3) if kind == "store" else (1,):
        assert torch.equal(pool.rows[n, :PAGE], kv[n].view(torch.uint8))
    if kind == "urgent_load":
        assert torch.equal(kv[6], kv[1]) and torch.equal(kv[7], kv[1])


# -- submitext.c reads ids at any alignment -------------------------------------------------

_SubmitIds = ctypes.CFUNCTYPE(
    ctypes.c_int, *([ctypes.c_void_p] * 2), ctypes.c_int64, ctypes.c_int, ctypes.c_uint64,
    ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t, ctypes.POINTER(ctypes.c_int64),
    ctypes.c_size_t, ctypes.c_size_t,
)  # fmt: skip


def _odd(values: list[int], dtype: type[np.integer[Any]]) -> np.ndarray[Any, Any]:
    """`values` in an array of `dtype` at an odd address (a uint8 buffer's [1:] viewed so)."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.zeros(1 + itemsize * len(values), dtype=np.uint8)
    arr = raw[1:].view(dtype)
    arr[:] = values
    assert arr.ctypes.data % 2 == 1 and not arr.flags.aligned
    return arr


DTYPES_READ: list[type[np.integer[Any]]] = [
    np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
]  # fmt: skip


def _check_reads(submit: Callable[..., int]) -> None:
    """`submit` (the extension's) hands an engine function the ids of odd-address arrays of
    every width, unchanged; returns after the first mismatch with an AssertionError."""
    seen: list[tuple[list[int], list[int]]] = []

    def engine(*args: Any) -> int:
        blocks, nb, slots, ns = args[5], args[6], args[7], args[8]
        seen.append(([blocks[i] for i in range(nb)], [slots[i] for i in range(ns)]))
        return 0

    fn = _SubmitIds(engine)
    address = ctypes.cast(fn, ctypes.c_void_p).value
    for dtype in DTYPES_READ:
        blocks, slots = [3, 1, 4, 1, 5, 9, 2, 6], [7, 0]
        if np.dtype(dtype).kind == "i":
            blocks[0] = -3  # signed: extended as such (the engine refuses it, not the read)
        got = submit(address, 1, 1, 11, 0, 1, _odd(blocks, dtype), _odd(slots, dtype), 0)
        assert got == len(blocks), (dtype, got)
        assert seen[-1] == (blocks, slots), (dtype, seen[-1])


def test_the_extension_reads_ids_at_odd_addresses() -> None:
    """numpy exports such views (format "=q" and the like); the extension reads them."""
    if library() is None or (ext := submit_extension()) is None:
        pytest.skip("the submit extension cannot be built here")
    _check_reads(ext.submit)


_SANITIZED = """
import importlib.machinery, importlib.util, sys
sys.path[:0] = [{tests!r}, {root!r}]  # this file, and helpers.py it imports
from test_interrupt import _check_reads
loader = importlib.machinery.ExtensionFileLoader("_kvtier_submit", {path!r})
spec = importlib.util.spec_from_file_location("_kvtier_submit", {path!r}, loader=loader)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
_check_reads(module.submit)
print("ok")
"""


def test_the_extension_reads_odd_addresses_without_undefined_behaviour(tmp_path: Path) -> None:
    """The same reads with submitext.c built under UBSan's alignment check, which aborts at a
    load through a misaligned pointer (x86 forgives one, the C standard does not)."""
    include = sysconfig.get_paths().get("include")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    if library() is None or submit_extension() is None or not include or not suffix:
        pytest.skip("the submit extension cannot be built here")
    source = Path(kvtier.transfer.__file__).with_name("submitext.c")
    out = tmp_path / f"_kvtier_submit{suffix}"
    flags = ["-fsanitize=alignment", "-fno-sanitize-recover=alignment"]
    cc = ["gcc", "-O2", "-shared", "-fPIC", *flags, f"-I{include}", "-o", str(out), str(source)]
    try:
        subprocess.run(cc, check=True, capture_output=True, timeout=120)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"no gcc with UBSan here ({exc})")
    here = Path(__file__).parent
    script = _SANITIZED.format(tests=str(here), root=str(here.parent), path=str(out))
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
