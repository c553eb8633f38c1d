"""The C library on its own, built by a C harness (c/engine_check.c): for this machine, and for
aarch64 (Arm servers such as Grace) run under qemu where the cross tools are installed
(Debian: `apt-get install gcc-aarch64-linux-gnu qemu-user`; skipped elsewhere).

On Arm `rowcopy.c` copies rows with memcpy (no SSE2); test_native.py runs that loop on this
machine too (KVTIER_PORTABLE_COPY=1), and this test runs it, with the engine's threads, on the
architecture itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import kvtier.transfer

SOURCES = Path(kvtier.transfer.__file__).parent
CHECK = Path(__file__).with_name("c") / "engine_check.c"
SYSROOT = Path("/usr/aarch64-linux-gnu")
HOST_CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
ARM_CC, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")


def _build_and_run(cc: str, tmp_path: Path, runner: list[str], env: dict[str, str]) -> str:
    exe = tmp_path / "engine_check"
    sources = [SOURCES / n for n in ("rowcopy.c", "copyengine.c", "cudaengine.c")]
    subprocess.run(
        [cc, "-O2", "-Wall", "-Werror", "-pthread", f"-I{SOURCES}", "-o", str(exe), str(CHECK),
         *map(str, sources), "-ldl"],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    out = subprocess.run(
        [*runner, str(exe)], capture_output=True, text=True, timeout=300, env={**os.environ, **env}
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.skipif(HOST_CC is None, reason="needs a C compiler")
def test_the_library_copies_byte_exact_without_python(tmp_path: Path) -> None:
    assert HOST_CC is not None
    assert _build_and_run(HOST_CC, tmp_path, [], {}).startswith("ok:")


@pytest.mark.skipif(
    ARM_CC is None or QEMU is None or not SYSROOT.is_dir(),
    reason="needs gcc-aarch64-linux-gnu and qemu-user",
)
def test_the_library_builds_and_copies_byte_exact_on_aarch64(tmp_path: Path) -> None:
    assert ARM_CC is not None and QEMU is not None
    out = _build_and_run(ARM_CC, tmp_path, [QEMU], {"QEMU_LD_PREFIX": str(SYSROOT)})
    assert out.startswith("ok:")
