"""The CPU backend's compiled row copier, built on first use with the system C compiler.

`rowcopy.c` copies a job's scattered rows in one call, with streaming stores that skip the
read of each destination line that `memmove` pays at these sizes (docs/bench/transfer.md). It
is compiled once per source version into `$KVTIER_CACHE_DIR` (default `~/.cache/kvtier`) and
loaded with ctypes. Where that cannot happen (not x86-64, no C compiler, a read-only cache, or
`KVTIER_NATIVE_COPY=0`) `row_copier()` returns None and the copier uses libc `memmove` per row,
which is correct but slower on 64-256 KiB rows.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

RowCopy = Callable[[int, int, int, int], None]
"""`f(dst_addresses_ptr, src_addresses_ptr, n, width)`: copy `n` rows of `width` bytes; the
address arrays are uint64. Releases the GIL while it runs."""

_SOURCE = Path(__file__).with_name("rowcopy.c")
_UNSET = object()
_cached: object = _UNSET


def cache_dir() -> Path:
    """Where the compiled library is kept."""
    env = os.environ.get("KVTIER_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier"


def row_copier() -> RowCopy | None:
    """The compiled copier, or None where it is disabled or cannot be built (see above)."""
    global _cached
    if _cached is _UNSET:
        _cached = _load()
    return _cached  # type: ignore[return-value]


def _load() -> RowCopy | None:
    if os.environ.get("KVTIER_NATIVE_COPY", "1") == "0":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None  # the source uses SSE2 intrinsics
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.info("kvtier: no C compiler found; CPU copies use memmove per row")
        return None
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    lib = cache_dir() / f"rowcopy-{digest}.so"
    try:
        if not lib.exists():
            lib.parent.mkdir(parents=True, exist_ok=True)
            tmp = lib.with_name(f"{lib.name}.{os.getpid()}.tmp")
            cmd = [cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(_SOURCE)]
            subprocess.run(cmd, check=True, capture_output=True, timeout=120)
            os.replace(tmp, lib)  # atomic: concurrent first uses never load a partial file
        fn = ctypes.CDLL(str(lib)).kvtier_copy_rows
    except (OSError, subprocess.SubprocessError) as exc:
        logger.info("kvtier: could not build %s (%s); CPU copies use memmove per row", lib, exc)
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    fn.restype = None
    copy: RowCopy = fn
    return copy
