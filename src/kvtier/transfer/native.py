"""The CPU backend's compiled code, built on first use with the system C compiler.

Three sources make one library (their shared types and prototypes are in `kvtier.h`):

- `rowcopy.c` copies a job's scattered rows in one call, with streaming stores that skip the
  read of each destination line that `memmove` pays at these sizes (docs/bench/transfer.md);
- `copyengine.c` is a copy thread that never takes the GIL (`native_worker`);
- `cudaengine.c` is the CUDA backend's submit path (`cuda_worker`): it reaches the driver
  with dlopen, so it builds without CUDA and does nothing where CUDA is absent.

The library is compiled once per source version and machine into `$KVTIER_CACHE_DIR` (default
`$XDG_CACHE_HOME/kvtier`, else `~/.cache/kvtier`) and loaded with ctypes. On x86-64 `rowcopy.c`
copies with SSE2 streaming stores; elsewhere (Arm servers such as Grace) it copies each row
with memcpy, as it does everywhere with `KVTIER_PORTABLE_COPY=1`. Where the library cannot be
built (no C compiler, a read-only cache, or `KVTIER_NATIVE_COPY=0`) `library()` returns None:
the CPU backend then runs its copies on a Python thread with libc `memmove` per row, and the
CUDA backend through torch ops, which is correct but slower.

A fourth source, `submitext.c`, is a CPython extension built beside the library where Python's
headers are installed (`submit_extension()`): the CPU backend's submit call without ctypes.
Without it submits go through ctypes, which cost 1.3-6 µs more each on the 2-core machine
(docs/bench/transfer.md).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Callable
from importlib.machinery import ExtensionFileLoader
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from kvtier.base import env_flag
from kvtier.transfer.plan import JobPlanner
from kvtier.transfer.registration import KVCacheRegistration

logger = logging.getLogger(__name__)

RowCopy = Callable[[int, int, int, int, int], None]
"""`f(segments_ptr, num_segments, dst_rows_ptr, src_rows_ptr, n)`: for each segment, a uint64
row `(dst_base, dst_stride, src_base, src_stride, width)`, copy `width` bytes from source row
`src_rows[i]` to destination row `dst_rows[i]` for `i < n`; the row arrays are int64. Releases
the GIL while it runs."""

BeforeHook = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64)
"""The engine's `before(job_id)` hook type: called on its thread before a copy; nonzero fails
the job."""


class EngineResult(ctypes.Structure):
    """One finished job, as `kvt_engine_poll` writes it."""

    _fields_ = [
        ("job_id", ctypes.c_int64),
        ("ok", ctypes.c_int32),
        ("lane", ctypes.c_int32),
        ("seconds", ctypes.c_double),
    ]


class SubmitContext(ctypes.Structure):
    """What every planned-in-C submit of one KV-cache group in one direction shares
    (`kvt_submit_ctx`): built once, passed by address, because each argument of a ctypes call
    costs about 0.13 µs on the 2-core machine."""

    _fields_ = [
        ("segs", ctypes.c_void_p),
        ("nseg", ctypes.c_uint64),
        ("store", ctypes.c_uint64),
        ("bpc", ctypes.c_uint64),
        ("num_blocks", ctypes.c_int64),
        ("num_slots", ctypes.c_int64),
        ("table", ctypes.c_uint64),
        ("page_bytes", ctypes.c_uint64),
    ]


_SOURCES = tuple(Path(__file__).with_name(n) for n in ("rowcopy.c", "copyengine.c", "cudaengine.c"))
_HEADER = Path(__file__).with_name("kvtier.h")
_EXTENSION = Path(__file__).with_name("submitext.c")
_UNSET = object()
_T = TypeVar("_T")
_cached: object = _UNSET
_cached_extension: object = _UNSET
_build_lock = threading.Lock()
_P, _SZ, _I64, _U64, _INT = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int64,
    ctypes.c_uint64,
    ctypes.c_int,
)
_SIGNATURES: dict[str, tuple[list[type], type | None]] = {
    "kvtier_copy_indexed": ([_P, _SZ, _P, _P, _SZ], None),
    "kvt_engine_new": ([BeforeHook, _INT, _SZ, _P, _SZ, _INT], _P),
    "kvt_engine_submit": ([_P, _I64, _INT, _U64, _P, _SZ, _P, _P, _SZ], _INT),
    "kvt_engine_submit_ids": ([_P, _P, _I64, _INT, _U64, _P, _SZ, _P, _SZ, _SZ], _INT),
    "kvt_engine_poll": ([_P, _P, _SZ], _SZ),
    "kvt_engine_peek": ([_P, _P, _SZ], _SZ),
    "kvt_engine_drop": ([_P, _SZ], None),
    "kvt_engine_wait": ([_P, _INT, _U64], None),
    "kvt_engine_wait_for": ([_P, _INT, _U64, _U64], _INT),
    "kvt_engine_accepted": ([_P, _INT], _U64),
    "kvt_engine_share_backlog": ([_P, _INT], None),
    "kvt_engine_shared_jobs": ([_P], _U64),
    "kvt_engine_stop": ([_P], None),
    "kvt_engine_free": ([_P], None),
    "kvt_cuda_new": ([_P, _P, _P, _INT, _U64, ctypes.c_uint, ctypes.c_char_p, _SZ], _P),
    "kvt_cuda_add_table": ([_P, _P, _SZ, _U64, _INT, _INT], _INT),
    "kvt_cuda_submit": ([_P, _INT, _U64, _I64, _INT, _INT, _U64, _P, _P, _SZ], _INT),
    "kvt_cuda_submit_ids": ([_P, _P, _INT, _U64, _I64, _P, _SZ, _P, _SZ, _SZ], _INT),
    "kvt_cuda_poll": ([_P, _P, _SZ], _SZ),
    "kvt_cuda_peek": ([_P, _P, _SZ], _SZ),
    "kvt_cuda_drop": ([_P, _P, _SZ], None),
    "kvt_cuda_coalesce": ([_P, _SZ], _INT),
    "kvt_cuda_last_error": ([_P], _INT),
    "kvt_cuda_accepted": ([_P, _INT], _U64),
    "kvt_cuda_wait": ([_P, _INT, _U64], _INT),
    "kvt_cuda_sync": ([_P], _INT),
    "kvt_cuda_free": ([_P], None),
}


SegmentTables = dict[int, tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]]
"""Per KV-cache group, the `RowCopy` segment tables for stores and for loads."""


def segment_tables(
    registration: KVCacheRegistration, host_address: int, row_bytes: int
) -> SegmentTables:
    """The segment tables of a registration and a host pool at `host_address` whose rows are
    `row_bytes` apart: a group's segments lie back to back in each host row."""
    tables = {}
    for g in registration.groups:
        rows = []
        col = 0
        for seg in registration.segments(g):
            rows.append((host_address + col, row_bytes, seg.address, seg.stride, seg.width))
            col += seg.width
        store = np.array(rows, dtype=np.uint64).reshape(-1, 5)
        tables[g] = (store, np.ascontiguousarray(store[:, [2, 3, 0, 1, 4]]))
    return tables


def submit_contexts(
    tables: SegmentTables, planner: JobPlanner, numbers: dict[int, tuple[int, int]] | None = None
) -> tuple[list[SubmitContext], dict[int, tuple[int, int]]]:
    """The `SubmitContext`s of every group's stores and loads over `tables` (kept alive by the
    caller, as are the structures, the first value), and per group the addresses of the store
    and the load context. `numbers`: the CUDA engine's table numbers per group."""
    keep: list[SubmitContext] = []
    addresses: dict[int, tuple[int, int]] = {}
    for g, pair in tables.items():
        made = []
        for i, table in enumerate(pair):
            ctx = SubmitContext(
                table.ctypes.data, table.shape[0], int(i == 0), planner.bpc, planner.num_blocks,
                planner.num_slots, numbers[g][i] if numbers else 0, planner.page_bytes[g],
            )  # fmt: skip
            keep.append(ctx)
            made.append(ctypes.addressof(ctx))
        addresses[g] = (made[0], made[1])
    return keep, addresses


def cache_dir() -> Path:
    """Where the compiled library is kept (an absolute path: `KVTIER_CACHE_DIR=.` named the
    library by a bare file name, which the loader looked for on the library path instead)."""
    env = os.environ.get("KVTIER_CACHE_DIR")
    if env:
        return Path(env).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return (Path(base) / "kvtier").absolute()


def library() -> ctypes.CDLL | None:
    """The compiled library with its functions' signatures set, or None where it is disabled
    or cannot be built (see above)."""
    global _cached
    if _cached is _UNSET:
        # One build per process: threads building at once wrote the same temporary file, and
        # a thread that lost the race cached None (the slow fallbacks) for the whole process.
        with _build_lock:
            if _cached is _UNSET:
                _cached = _load()
    return _cached  # type: ignore[return-value]


def row_copier() -> RowCopy | None:
    """The compiled row copier (`RowCopy`), or None where the library is unavailable."""
    lib = library()
    if lib is None:
        return None
    copy: RowCopy = lib.kvtier_copy_indexed
    return copy


EXT_STOPPED, EXT_REFUSED = -1, -2
"""The extension's `submit` results besides a block count (submitext.c): the engine is stopping
or out of memory, or it refused the arguments; nothing is queued. The third, -3, says it could
not read the ids: the worker then submits through ctypes."""


def submit_extension() -> ModuleType | None:
    """The CPython extension `_kvtier_submit` (`submitext.c`): the CPU engine's submit call
    without ctypes. None where the library is unavailable, Python's headers are not installed,
    the interpreter is not CPython or the build fails; the worker then submits through ctypes."""
    global _cached_extension
    if _cached_extension is _UNSET and library() is not None:
        with _build_lock:
            if _cached_extension is _UNSET:
                _cached_extension = _load_extension()
    return None if _cached_extension is _UNSET else _cached_extension  # type: ignore[return-value]


def _compiler() -> list[str] | None:
    """The compiler's command: `$CC` split as a shell would (`ccache gcc`, `gcc -m64`), else
    `cc` or `gcc` on the path."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        try:
            return shlex.split(cc)
        except ValueError:  # an unbalanced quote
            return None
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def _build(path: Path, cmd: list[str], *, again: bool = False) -> None:
    """Run `cmd` (which writes `{output}`) into the cache unless `path` is there already (or
    `again`: the file there could not be loaded)."""
    if path.exists() and not again:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    cmd = [str(tmp) if a == "{output}" else a for a in cmd]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        os.chmod(tmp, 0o755)  # whatever the umask: `_trusted` refuses a file others may write
        os.replace(tmp, path)  # atomic: concurrent first uses never load a partial file
    finally:
        tmp.unlink(missing_ok=True)


def _trusted(path: Path) -> bool:
    """Whether the cached `path` may be loaded: owned by this user and writable by no other.
    Loading runs the file's code (its constructors run even where its symbols are then found
    missing), so a file another user placed or could rewrite is built again instead."""
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _build_and_load(path: Path, cmd: list[str], load: Callable[[Path], _T]) -> _T:
    """`load(path)` after building it if absent. A cached file that does not load (truncated
    by a crash, or built against another host's C library in a shared home directory) is
    built again once: otherwise every process would keep the slow fallback for good."""
    built = not path.exists()
    if not built and not _trusted(path):
        logger.info(
            "kvtier: the cached %s is another user's or writable by others; building it again "
            "instead of loading it",
            path,
        )
        built = True
        _build(path, cmd, again=True)
    _build(path, cmd)
    try:
        return load(path)
    except (OSError, ImportError, AttributeError) as exc:
        if built:
            raise
        logger.info("kvtier: the cached %s does not load (%s); building it again", path, exc)
    _build(path, cmd, again=True)
    return load(path)


def _load_extension() -> ModuleType | None:
    include = sysconfig.get_paths().get("include")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    cc = _compiler()
    if platform.python_implementation() != "CPython" or not include or not suffix or cc is None:
        return None
    if not (Path(include) / "Python.h").exists():
        logger.info("kvtier: Python's headers are not installed; CPU submits go through ctypes")
        return None
    sources = (_EXTENSION, _HEADER)
    key = b"".join(p.read_bytes() for p in sources) + sys.version.encode() + suffix.encode()
    path = cache_dir() / f"kvtier-submit-{hashlib.sha256(key).hexdigest()[:16]}{suffix}"

    def load(path: Path) -> ModuleType:
        spec = spec_from_file_location(
            "_kvtier_submit", path, loader=ExtensionFileLoader("_kvtier_submit", str(path))
        )
        assert spec is not None and spec.loader is not None
        module = module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    try:
        module = _build_and_load(
            path, [*cc, "-O2", "-shared", "-fPIC", f"-I{include}", "-o", "{output}",
                   str(_EXTENSION)], load,
        )  # fmt: skip
    except (OSError, ImportError, subprocess.SubprocessError) as exc:
        logger.info("kvtier: could not build %s (%s); CPU submits go through ctypes", path, exc)
        return None
    return module


def _load() -> ctypes.CDLL | None:
    if not env_flag("KVTIER_NATIVE_COPY", True):
        return None
    cc = _compiler()
    if cc is None:
        logger.info("kvtier: no C compiler found; CPU copies run on a Python thread")
        return None
    # Streaming stores where the compiler targets SSE2 (x86-64); memcpy per row elsewhere,
    # or everywhere with KVTIER_PORTABLE_COPY=1 (rowcopy.c).
    flags = ["-DKVT_PORTABLE_COPY"] if env_flag("KVTIER_PORTABLE_COPY", False) else []
    # The machine is in the key: a home directory shared by x86-64 and Arm hosts must not
    # hand one the other's build.
    key = b"".join(p.read_bytes() for p in (*_SOURCES, _HEADER))
    key += " ".join([platform.machine(), *flags]).encode()
    path = cache_dir() / f"kvtier-native-{hashlib.sha256(key).hexdigest()[:16]}.so"

    def load(path: Path) -> ctypes.CDLL:
        lib = ctypes.CDLL(str(path))
        for name, (args, res) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        return lib

    try:
        lib = _build_and_load(
            path, [*cc, "-O2", "-shared", "-fPIC", "-pthread", *flags, "-o", "{output}",
                   *map(str, _SOURCES), "-ldl"], load,
        )  # fmt: skip
    except (OSError, AttributeError, subprocess.SubprocessError) as exc:
        logger.info("kvtier: could not build %s (%s); CPU copies run on a Python thread", path, exc)
        return None
    return lib
