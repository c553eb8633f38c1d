"""The compiled row copier: built on first use, byte-exact, and optional (memmove fallback)."""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.transfer import HostPool, KVCacheRegistration, make_transfer_worker, native
from kvtier.transfer.testing import NUM_BLOCKS, assert_block_equals, make_layout, snapshot

can_build = platform.machine().lower() in ("x86_64", "amd64") and (
    shutil.which("cc") is not None or shutil.which("gcc") is not None
)
needs_compiler = pytest.mark.skipif(not can_build, reason="needs x86-64 and a C compiler")


def _fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **env: str) -> native.RowCopy | None:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return native._load()


@needs_compiler
@pytest.mark.parametrize("width", [64, 4096, 65536, 100, 4160])
@pytest.mark.parametrize("offset", [0, 8])
def test_compiled_copy_is_byte_exact(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, width: int, offset: int
) -> None:
    copy = _fresh(monkeypatch, tmp_path)
    assert copy is not None
    assert list((tmp_path / "cache").glob("rowcopy-*.so")), "library not written to the cache"
    rng = np.random.default_rng(width + offset)
    rows = 12
    src = torch.from_numpy(rng.integers(0, 256, (rows, width + 64), dtype=np.uint8))
    dst = torch.zeros(rows, width + 64, dtype=torch.uint8)
    perm = rng.permutation(rows)
    # Rows of `src` (possibly misaligned by `offset`) to permuted rows of `dst`.
    s = (src.data_ptr() + offset + np.arange(rows) * src.stride(0)).astype(np.uint64)
    d = (dst.data_ptr() + perm * dst.stride(0)).astype(np.uint64)
    copy(d.ctypes.data, s.ctypes.data, rows, width)
    for i, j in enumerate(perm):
        assert torch.equal(dst[j, :width], src[i, offset : offset + width])
        assert bool(torch.all(dst[j, width:] == 0)), "wrote past the row"


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert _fresh(monkeypatch, tmp_path, KVTIER_NATIVE_COPY="0") is None
    assert not (tmp_path / "cache").exists()


@needs_compiler
def test_unwritable_cache_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(blocker / "sub"))
    assert native._load() is None


def test_missing_compiler_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    assert native._load() is None


@pytest.mark.parametrize("use_native", [True, False], ids=["compiled", "memmove"])
@pytest.mark.parametrize("layout", ["flash", "cross_layer", "aliased"])
def test_scattered_jobs_round_trip_on_both_paths(
    monkeypatch: pytest.MonkeyPatch, layout: str, use_native: bool
) -> None:
    if use_native and not can_build:
        pytest.skip("needs x86-64 and a C compiler")
    if not use_native:
        monkeypatch.setattr("kvtier.transfer.copier.row_copier", lambda: None)
    else:
        assert native.row_copier() is not None
    rng = np.random.default_rng(3)
    kvs = make_layout(layout, torch.float32, seed=4)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 2, num_slots=10, pin=False)
    before = snapshot(kvs)
    half = NUM_BLOCKS // 2
    src = rng.permutation(half)[:16]
    dst = half + rng.permutation(NUM_BLOCKS - half)[:15]
    slots = rng.permutation(10)[:8]
    with make_transfer_worker(reg, pool, "cpu") as w:
        w.submit_store(1, src, slots)
        w.wait([1])
        w.submit_load(2, slots, dst, skip_blocks=1)
        w.wait([2])
        assert all(r.success for r in w.get_finished())
    for s, d in zip(src[1:], dst, strict=True):
        assert_block_equals(kvs, int(d), before[int(s)])
