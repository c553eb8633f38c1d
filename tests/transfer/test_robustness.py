"""The planner does not keep lent id buffers; split copies run in a forked child; the native
library's cache copes with a corrupt file, a relative KVTIER_CACHE_DIR and a CC with arguments.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from helpers import in_child
from kvtier.transfer import CPUTransferWorker, HostPool, KVCacheRegistration, KVTensor, native
from kvtier.transfer import copier as copier_module
from kvtier.transfer.copier import BlockCopier
from kvtier.transfer.plan import JobPlanner

needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler"
)


class _LentIds:
    """Ids whose `__array__` hands out the object's own buffer (an array with no base)."""

    def __init__(self, ids: list[int]) -> None:
        self.values = np.array(ids, dtype=np.int64)

    def __array__(self, dtype: Any = None, copy: Any = None) -> npt.NDArray[np.int64]:
        return self.values

    def __len__(self) -> int:
        return len(self.values)


def test_planned_rows_do_not_share_a_lent_buffer() -> None:
    planner = JobPlanner(16, 4, 2, {0: 8})
    blocks, slots = _LentIds([3, 4]), _LentIds([1])
    store = planner.store(1, blocks, slots, 0)  # type: ignore[arg-type]
    load = planner.load(2, slots, blocks, 0, 0, False)  # type: ignore[arg-type]
    blocks.values[:] = [7, 8]
    slots.values[:] = [2]
    assert store.dev_rows.tolist() == [3, 4] and store.host_rows.tolist() == [2, 3]
    assert load.dev_rows.tolist() == [3, 4] and load.host_rows.tolist() == [2, 3]


def test_a_store_copies_the_blocks_it_was_given_not_the_ids_reused_after_submit() -> None:
    """The documented contract: the caller may reuse its arrays as soon as submit returns."""
    t = torch.arange(16 * 2 * 4, dtype=torch.float32).view(16, 2, 4)
    reg = KVCacheRegistration([KVTensor(t, "mla")])
    pool = HostPool(reg, 1, num_slots=4, pin=False)
    gate = threading.Event()
    with CPUTransferWorker(reg, pool, fault_injector=lambda j, d: gate.wait(10)) as w:
        blocks = _LentIds([5])
        w.submit_store(1, blocks, [0])  # type: ignore[arg-type]
        blocks.values[0] = 9  # reused before the copy ran
        gate.set()
        w.wait([1])
        assert [r.success for r in w.get_finished()] == [True]
    assert torch.equal(pool.rows[0].view(torch.float32), t[5].reshape(-1))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_split_copies_still_run_in_a_forked_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that split a copy over the helper threads, then forked: the child's helper
    executor must not be the parent's, whose threads the child does not have."""
    monkeypatch.setattr(copier_module, "_THREADS", 2)
    monkeypatch.setattr(copier_module, "_PARALLEL_BYTES", 1)
    monkeypatch.setattr(copier_module, "_pool", None)
    monkeypatch.setattr(copier_module, "row_copier", lambda: None)  # memmove, split in two
    t = torch.randn(16, 4, 8)
    reg = KVCacheRegistration([KVTensor(t, "mla")])
    pool = HostPool(reg, 1, num_slots=8, pin=False)
    copier = BlockCopier(reg, pool.rows, torch.empty(pool.row_bytes, dtype=torch.uint8))
    planner = JobPlanner(16, 8, 1, {0: reg.page_bytes(0)})

    def store(job_id: int, blocks: list[int], slots: list[int]) -> None:
        job = planner.store(job_id, blocks, slots, 0)
        copier.run(job, torch.from_numpy(job.dev_rows), torch.from_numpy(job.host_rows))

    store(1, [3, 1, 7, 5], [6, 0, 4, 2])  # scattered on both sides: split over two threads
    assert copier_module._pool is not None

    def child() -> bool:  # the same kind of copy runs in the forked child
        store(2, [2, 0, 6, 4], [7, 1, 5, 3])
        # numpy, not torch ops: a forked child should not start torch's thread pools.
        want = t[2].reshape(-1).view(torch.uint8).numpy()
        return bool(np.array_equal(pool.rows[7].numpy(), want))

    in_child(child, "the forked child's copy")


def _fresh_build(monkeypatch: pytest.MonkeyPatch, cache: str) -> None:
    monkeypatch.setenv("KVTIER_CACHE_DIR", cache)
    monkeypatch.delenv("KVTIER_NATIVE_COPY", raising=False)
    monkeypatch.delenv("KVTIER_PORTABLE_COPY", raising=False)


# A library this process has loaded must never be overwritten in place (its mapping would
# fault): each test corrupts a copy under another cache directory, as a crash of another
# process, or another host's build in a shared home directory, would leave it.


@needs_compiler
def test_a_corrupt_cached_library_is_built_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fresh_build(monkeypatch, str(tmp_path / "first"))
    assert native._load() is not None
    (so,) = (tmp_path / "first").glob("kvtier-native-*.so")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / so.name).write_bytes(b"garbage: a crash left the file short")
    _fresh_build(monkeypatch, str(tmp_path / "cache"))
    lib = native._load()
    assert lib is not None and hasattr(lib, "kvtier_copy_indexed")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [so.name]  # no temporary left


@needs_compiler
def test_a_corrupt_cached_extension_is_built_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fresh_build(monkeypatch, str(tmp_path / "first"))
    if native._load_extension() is None:
        pytest.skip("the submit extension cannot be built here (no Python headers?)")
    (ext,) = (tmp_path / "first").glob("kvtier-submit-*")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / ext.name).write_bytes(b"")
    _fresh_build(monkeypatch, str(tmp_path / "cache"))
    assert native._load_extension() is not None


@needs_compiler
def test_a_relative_cache_dir_is_loaded_from_where_it_was_built(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    _fresh_build(monkeypatch, ".")  # the library's path was a bare file name
    assert native._load() is not None
    assert list(tmp_path.glob("kvtier-native-*.so"))


@needs_compiler
def test_cc_may_carry_arguments(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None
    _fresh_build(monkeypatch, str(tmp_path))
    monkeypatch.setenv("CC", f"{cc} -O1")  # as make takes it: `CC="ccache gcc"`, `gcc -m64`
    assert native._load() is not None


def test_an_unusable_cc_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fresh_build(monkeypatch, str(tmp_path))
    monkeypatch.setenv("CC", "'unbalanced quote")
    assert native._load() is None
