"""A second look at `HostPool.close()` refusing while its workers may copy (2026-11-31).

Before, a worker whose construction passed its pool check while another thread closed the pool
was still recorded on it and built: its copies went to and from a closed pool (unpinned under
them on a GPU), which `close()` exists to prevent. The other thread's `close()` is simulated
here by closing the pool from inside the worker's construction, after its check."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvtier.transfer import (
    CPUTransferWorker,
    HostPool,
    KVCacheRegistration,
    KVTensor,
    NativeCPUTransferWorker,
    native_worker,
)


def _registration() -> KVCacheRegistration:
    return KVCacheRegistration([KVTensor(torch.zeros(8, 256, dtype=torch.uint8), 0)])


def _copy_threads() -> int:
    return sum(t.name.startswith("kvtier-transfer") for t in threading.enumerate())


@pytest.mark.parametrize("native", [False, True], ids=["python", "compiled"])
def test_a_worker_whose_pool_is_closed_while_it_is_built_is_refused(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    reg = _registration()
    pool = HostPool(reg, 1, num_slots=8)
    threads = _copy_threads()
    # A step of the construction after `check_pool`, where the other thread's close() lands.
    if native:
        library: Callable[[], Any] = getattr(native_worker, "library")  # noqa: B009 (not exported)

        def closing_library() -> Any:
            pool.close()
            return library()

        monkeypatch.setattr(native_worker, "library", closing_library)
    else:
        make_copier = CPUTransferWorker._make_copier

        def closing_make_copier(self: CPUTransferWorker, stage_bytes: int) -> Any:
            pool.close()
            return make_copier(self, stage_bytes)

        monkeypatch.setattr(CPUTransferWorker, "_make_copier", closing_make_copier)
    cls = NativeCPUTransferWorker if native else CPUTransferWorker
    with pytest.raises(ValueError, match="host pool was closed while a transfer worker was built"):
        cls(reg, pool)
    assert pool.closed
    assert not pool._users, "the refused worker is still recorded on the pool"
    gc.collect()
    assert _copy_threads() == threads, "the refused worker's copy thread runs on"
