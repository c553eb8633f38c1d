"""The compiled row copier: built on first use, byte-exact, and optional (memmove fallback)."""

from __future__ import annotations

import ctypes
import shutil
import sysconfig
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.transfer import CPUTransferWorker, HostPool, KVCacheRegistration, native
from kvtier.transfer.testing import NUM_BLOCKS, assert_block_equals, make_layout, snapshot

can_build = shutil.which("cc") is not None or shutil.which("gcc") is not None
needs_compiler = pytest.mark.skipif(not can_build, reason="needs a C compiler")


def _fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **env: str) -> ctypes.CDLL | None:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return native._load()


@needs_compiler
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("width", [64, 4096, 65536, 100, 4160])
@pytest.mark.parametrize("offset", [0, 8])
def test_compiled_copy_is_byte_exact(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, width: int, offset: int, portable: bool
) -> None:
    """Both copy loops: streaming stores (x86-64) and the memcpy one other machines build,
    which KVTIER_PORTABLE_COPY=1 builds here."""
    lib = _fresh(monkeypatch, tmp_path, KVTIER_PORTABLE_COPY="1" if portable else "0")
    assert lib is not None
    assert list((tmp_path / "cache").glob("kvtier-native-*.so")), "library not in the cache"
    copy = lib.kvtier_copy_indexed
    rng = np.random.default_rng(width + offset)
    rows = 12
    src = torch.from_numpy(rng.integers(0, 256, (rows, 2 * width + 64), dtype=np.uint8))
    dst = torch.zeros(rows, 2 * width + 128, dtype=torch.uint8)
    perm = rng.permutation(rows).astype(np.int64)
    order = np.arange(rows, dtype=np.int64)
    # Two segments (column ranges) per row: src columns [offset, offset + width) go to dst
    # columns [0, width), and src [offset + width, offset + 2 * width) to dst [width + 64, ...).
    sp, ss, dp, ds = src.data_ptr(), src.stride(0), dst.data_ptr(), dst.stride(0)
    table = np.array(
        [(dp, ds, sp + offset, ss, width), (dp + width + 64, ds, sp + offset + width, ss, width)],
        dtype=np.uint64,
    )
    copy(table.ctypes.data, 2, perm.ctypes.data, order.ctypes.data, rows)
    for i, j in enumerate(perm):
        assert torch.equal(dst[j, :width], src[i, offset : offset + width])
        assert torch.equal(
            dst[j, width + 64 : 2 * width + 64], src[i, offset + width : offset + 2 * width]
        )
        assert bool(torch.all(dst[j, width : width + 64] == 0)), "wrote between the segments"
        assert bool(torch.all(dst[j, 2 * width + 64 :] == 0)), "wrote past the row"


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
        pytest.skip("needs a C compiler")
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
    with CPUTransferWorker(reg, pool) as w:  # the Python copy thread, with either row copier
        w.submit_store(1, src, slots)
        w.wait([1])
        w.submit_load(2, slots, dst, skip_blocks=1)
        w.wait([2])
        assert all(r.success for r in w.get_finished())
    for s, d in zip(src[1:], dst, strict=True):
        assert_block_equals(kvs, int(d), before[int(s)])


@needs_compiler
def test_cuda_engine_refuses_to_start_and_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The library holds the CUDA engine on every machine. Without a driver (here) it cannot
    # open libcuda; with one, no context or a bad kernel image stops it. Never a crash or a
    # half-made engine.
    lib = _fresh(monkeypatch, tmp_path)
    assert lib is not None
    err = ctypes.create_string_buffer(256)
    streams = (ctypes.c_uint64 * 3)(0, 0, 0)
    image = ctypes.create_string_buffer(b"not a cubin")
    handle = lib.kvt_cuda_new(image, streams, None, 0, 0, 132, err, len(err))
    assert not handle
    assert any(
        reason in err.value.decode()
        for reason in ("cannot open libcuda.so.1", "no current CUDA context", "cuModuleLoadData")
    ), err.value


@needs_compiler
def test_threads_at_first_use_all_get_the_library(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Threads that first asked at once built into one temporary file; a loser cached None,
    and the process could keep the slow fallbacks for good."""
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_cached", native._UNSET)
    monkeypatch.setattr(native, "_cached_extension", native._UNSET)
    start = threading.Barrier(4)
    got: list[tuple[object, bool]] = []

    def first_use() -> None:
        start.wait(5)
        lib = native.library()
        got.append((lib, native.submit_extension() is not None))  # one append: no interleaving

    threads = [threading.Thread(target=first_use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    libs, exts = [lib for lib, _ in got], [ext for _, ext in got]
    assert len(libs) == 4 and all(lib is not None for lib in libs)
    assert native.library() is libs[0] and len(set(map(id, libs))) == 1
    assert len(set(exts)) == 1, "threads disagree on the submit extension"
    assert not list((tmp_path / "cache").glob("*.tmp")), "a temporary file was left behind"


@needs_compiler
def test_the_submit_extension_builds_into_the_cache_and_loads(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import sysconfig

    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        pytest.skip("no Python headers here")
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    ext = native._load_extension()
    assert ext is not None and callable(ext.submit)
    assert list((tmp_path / "cache").glob("kvtier-submit-*.so")), "extension not in the cache"


@needs_compiler
def test_the_submit_extension_is_optional(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without Python's headers, or with nowhere to build, submits go through ctypes."""
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    real = sysconfig.get_paths  # the module `native` finds Python's headers with

    def no_headers() -> dict[str, str]:
        return {**real(), "include": str(tmp_path / "no-include")}

    monkeypatch.setattr(sysconfig, "get_paths", no_headers)
    assert native._load_extension() is None
    monkeypatch.setattr(sysconfig, "get_paths", real)
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(blocker / "sub"))
    assert native._load_extension() is None


@needs_compiler
def test_the_portable_build_is_cached_apart_and_runs_the_worker(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The build Arm hosts get, through the whole compiled worker: byte-exact round trips."""
    from kvtier.transfer.native_worker import NativeCPUTransferWorker

    native_lib = _fresh(monkeypatch, tmp_path)
    portable = _fresh(monkeypatch, tmp_path, KVTIER_PORTABLE_COPY="1")
    assert native_lib is not None and portable is not None
    assert len(list((tmp_path / "cache").glob("kvtier-native-*.so"))) == 2
    monkeypatch.setattr("kvtier.transfer.native_worker.library", lambda: portable)
    rng = np.random.default_rng(8)
    kvs = make_layout("flash", torch.bfloat16, seed=9)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 2, num_slots=12, pin=False)
    before = snapshot(kvs)
    half = NUM_BLOCKS // 2
    src, dst = rng.permutation(half)[:16], half + rng.permutation(NUM_BLOCKS - half)[:15]
    slots = rng.permutation(12)[:8]
    with NativeCPUTransferWorker(reg, pool, copy_threads=2) as w:
        assert w._lib is portable
        w.submit_store(1, src, slots)
        w.wait([1])
        w.submit_load(2, slots, dst, skip_blocks=1)
        w.wait([2])
        assert [r.success for r in w.get_finished()] == [True, True]
    for s, d in zip(src[1:], dst, strict=True):
        assert_block_equals(kvs, int(d), before[int(s)])
