"""Compiles the CUDA backend's copy kernel (`gather.cu`) for the device at hand, with NVRTC.

NVRTC is the runtime compiler that CUDA builds of torch ship and load (`libnvrtc.so.*`), so no
CUDA toolkit is needed. The cubin is kept in `native.cache_dir()`, keyed by the source, the
NVRTC version and the architecture, so later processes skip the compile (a few hundred ms).
Where NVRTC cannot be found or refuses the source, `cubin()` returns None and says why, and
the CUDA backend copies with torch ops instead.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import logging
import os
import sys
from pathlib import Path

from kvtier.transfer.native import cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gather.cu")


def _library() -> ctypes.CDLL | None:
    # By name first: torch has usually loaded it already. Then where pip puts it.
    for name in ("libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    for site in sys.path:
        for path in sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libnvrtc.so.*"))):
            if "builtins" in path or ".alt." in path:
                continue
            try:
                return ctypes.CDLL(path)
            except OSError:
                pass
    return None


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"{what}: {lib.nvrtcGetErrorString(rc).decode()}")


def _compile(lib: ctypes.CDLL, source: bytes, arch: int) -> bytes:
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source, b"gather.cu", 0, None, None),
           "nvrtcCreateProgram")  # fmt: skip
    try:
        opts = [f"--gpu-architecture=sm_{arch}".encode(), b"--std=c++17", b"-default-device"]
        argv = (ctypes.c_char_p * len(opts))(*opts)
        rc = lib.nvrtcCompileProgram(prog, len(opts), argv)
        if rc != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile gather.cu: {log.value.decode()[:2000]}")
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        out = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, out), "nvrtcGetCUBIN")
        return out.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _whole_elf(data: bytes) -> bool:
    """Whether `data` is a 64-bit little-endian ELF image (a cubin) that reaches the end of its
    section header table, which compilers put last."""
    if len(data) < 64 or data[:6] != b"\x7fELF\x02\x01":
        return False
    shoff = int.from_bytes(data[0x28:0x30], "little")
    shentsize = int.from_bytes(data[0x3A:0x3C], "little")
    shnum = int.from_bytes(data[0x3C:0x3E], "little")
    return len(data) >= shoff + shentsize * shnum


def cubin(capability: tuple[int, int]) -> bytes | None:
    """gather.cu compiled for a device of compute `capability`, or None (logged) where NVRTC
    is missing or fails."""
    lib = _library()
    if lib is None:
        logger.info("kvtier: NVRTC not found")
        return None
    major, minor = ctypes.c_int(), ctypes.c_int()
    if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) != 0:
        return None
    arch = 10 * capability[0] + capability[1]
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + f"{major.value}.{minor.value}".encode()).hexdigest()[:16]
    path = cache_dir() / f"kvtier-gather-{key}-sm{arch}.cubin"
    try:
        cached = path.read_bytes()
        # A file cut short or overwritten outside kvtier's own (atomic) writes is compiled
        # again, or the CUDA backend would fail to load it in every process.
        if _whole_elf(cached):
            return cached
        logger.info("kvtier: the cached %s is not a whole cubin; compiling it again", path)
    except OSError:
        pass
    try:
        image = _compile(lib, source, arch)
    except (RuntimeError, OSError, AttributeError) as exc:
        logger.warning("kvtier: %s", exc)
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(image)
        os.replace(tmp, path)  # atomic: a concurrent first use never reads a partial file
    except OSError as exc:
        logger.info("kvtier: could not cache %s (%s)", path, exc)
    return image
