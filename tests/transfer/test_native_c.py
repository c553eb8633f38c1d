"""The C library on its own, built by C harnesses: for this machine, and for aarch64 (Arm
servers such as Grace) run under qemu where the cross tools are installed (Debian:
`apt-get install gcc-aarch64-linux-gnu qemu-user`; skipped elsewhere).

- c/engine_check.c: the CPU engine. On Arm `rowcopy.c` copies rows with memcpy (no SSE2);
  test_native.py runs that loop on this machine too (KVTIER_PORTABLE_COPY=1), and this test
  runs it, with the engine's threads, on the architecture itself.
- c/results_check.c: the CPU engine's result buffer stays bounded however the caller polls.
- c/plan_check.c: kvt_plan_rows's edge cases (counts whose products wrap included), row
  copies at odd addresses and widths, and the CPU engine submitted to, polled, waited on and
  stopped from several threads.
- c/cuda_check.c: the CUDA submit path (`cudaengine.c`) against c/fake_cuda.c, a stand-in
  for the driver on host memory (the one thing here that needs a GPU), built as the
  `libcuda.so.1` that cudaengine.c opens: jobs launched by the submitter, and by launch
  threads that coalesce them. The same paths run on a GPU in test_cuda_worker.py.
- c/ext_check.py: the same engine over the same fake, called from Python the way the CUDA
  worker calls it (the submit extension, the ctypes signatures); c/worker_check.py:
  CUDATransferWorker itself on it, with torch's CUDA calls stood in.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvtier.transfer
from kvtier.transfer import native

SOURCES = Path(kvtier.transfer.__file__).parent
HARNESSES = Path(__file__).with_name("c")
SYSROOT = Path("/usr/aarch64-linux-gnu")
HOST_CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
ARM_CC, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")


def _cc(cc: str, *args: str | Path) -> None:
    flags = ["-O2", "-Wall", "-Werror", "-pthread", f"-I{SOURCES}"]
    out = subprocess.run([cc, *flags, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def _build_and_run(
    cc: str, tmp_path: Path, runner: list[str], env: dict[str, str], harness: str = "engine_check"
) -> str:
    """Build `harness` with the library's sources (and, for cuda_check, the fake driver as
    tmp_path/libcuda.so.1, found first by its run path) and run it."""
    exe = tmp_path / harness
    sources = [SOURCES / n for n in ("rowcopy.c", "copyengine.c", "cudaengine.c")]
    link: list[str | Path] = []
    if harness == "cuda_check":
        _cc(cc, "-fPIC", "-shared", "-Wl,-soname,libcuda.so.1", "-o", tmp_path / "libcuda.so.1",
            HARNESSES / "fake_cuda.c")  # fmt: skip
        link = [f"-L{tmp_path}", "-l:libcuda.so.1", f"-Wl,-rpath,{tmp_path}"]
    _cc(cc, "-o", exe, HARNESSES / f"{harness}.c", *sources, *link, "-ldl")
    out = subprocess.run(
        [*runner, str(exe)], capture_output=True, text=True, timeout=300, env={**os.environ, **env}
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.skipif(HOST_CC is None, reason="needs a C compiler")
def test_the_library_copies_byte_exact_without_python(tmp_path: Path) -> None:
    assert HOST_CC is not None
    assert _build_and_run(HOST_CC, tmp_path, [], {}).startswith("ok:")


@pytest.mark.skipif(HOST_CC is None, reason="needs a C compiler")
def test_the_result_buffer_stays_bounded_when_a_result_is_always_pending(tmp_path: Path) -> None:
    """c/results_check.c (which includes copyengine.c to read the buffer's size): 100,000+
    jobs, each poll leaving the newest results unpolled; the buffer once grew by one result
    a job."""
    assert HOST_CC is not None
    exe = tmp_path / "results_check"
    _cc(HOST_CC, "-o", exe, HARNESSES / "results_check.c", SOURCES / "rowcopy.c")
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("ok:"), out.stdout + out.stderr


@pytest.mark.skipif(HOST_CC is None, reason="needs a C compiler")
def test_plans_edge_cases_odd_rows_and_threaded_engine_use(tmp_path: Path) -> None:
    """c/plan_check.c: no blocks or slots, skip at the chunk's end, repeats, and products that
    wrap (2 slots of 2^63 blocks once planned a store of no blocks; host rows past INT64_MAX
    wrapped negative); unaligned rows of any width; submits, polls, waits and a stop with
    jobs queued from several threads, results polled late or never."""
    assert HOST_CC is not None
    assert _build_and_run(HOST_CC, tmp_path, [], {}, "plan_check").startswith("ok")


@pytest.mark.skipif(HOST_CC is None, reason="needs a C compiler")
def test_the_cuda_submit_path_against_a_fake_driver(tmp_path: Path) -> None:
    """Kernels and batched copies byte-exact (also at 2-byte alignment), loads mid-chunk, the
    wait for compute before stores and loads, each lane's order and borrowed start events
    across the ring's growth, refused launches and arguments, no event leaked; coalescing's
    merges, waits and shutdown; random interleavings of submits, polls, waits and held
    streams, with and without launch threads."""
    assert HOST_CC is not None
    out = _build_and_run(HOST_CC, tmp_path, [], {}, "cuda_check")
    assert out.startswith("ok:"), out


@pytest.mark.skipif(HOST_CC is None, reason="needs a C compiler")
@pytest.mark.parametrize("script", ["ext_check", "worker_check"])
@pytest.mark.parametrize("depth", [0, 2])
def test_the_cuda_engine_from_python_against_a_fake_driver(
    tmp_path: Path, script: str, depth: int
) -> None:
    """c/ext_check.py: the submit extension and the ctypes calls, into the library's CUDA
    engine; c/worker_check.py: CUDATransferWorker itself on that engine, torch's CUDA calls
    stood in. Both over the fake driver, found first on LD_LIBRARY_PATH."""
    if native.library() is None or native.submit_extension() is None:
        pytest.skip("the library or the submit extension does not build here")
    assert HOST_CC is not None
    _cc(HOST_CC, "-fPIC", "-shared", "-Wl,-soname,libcuda.so.1", "-o", tmp_path / "libcuda.so.1",
        HARNESSES / "fake_cuda.c")  # fmt: skip
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, str(HARNESSES / f"{script}.py"), str(depth)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr


def _arm_tools_work(tmp_path: Path) -> bool:
    """Whether the cross compiler and qemu build and run a trivial threaded program: a broken
    or half-installed toolchain is a reason to skip, not a failure of kvtier's code."""
    if ARM_CC is None or QEMU is None or not SYSROOT.is_dir():
        return False
    src, exe = tmp_path / "hello.c", tmp_path / "hello"
    src.write_text("#include <pthread.h>\nint main(void) { return pthread_self() == 0; }\n")
    try:
        subprocess.run([ARM_CC, "-pthread", "-o", str(exe), str(src)], check=True,
                       capture_output=True, timeout=120)  # fmt: skip
        run = subprocess.run([QEMU, str(exe)], capture_output=True, timeout=120,
                             env={**os.environ, "QEMU_LD_PREFIX": str(SYSROOT)})  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return False
    return run.returncode == 0


def test_the_library_builds_and_copies_byte_exact_on_aarch64(tmp_path: Path) -> None:
    if not _arm_tools_work(tmp_path):
        pytest.skip("needs a working gcc-aarch64-linux-gnu and qemu-user")
    assert ARM_CC is not None and QEMU is not None
    out = _build_and_run(ARM_CC, tmp_path, [QEMU], {"QEMU_LD_PREFIX": str(SYSROOT)})
    assert out.startswith("ok:")


def test_the_cuda_submit_path_on_aarch64(tmp_path: Path) -> None:
    if not _arm_tools_work(tmp_path):
        pytest.skip("needs a working gcc-aarch64-linux-gnu and qemu-user")
    assert ARM_CC is not None and QEMU is not None
    env = {"QEMU_LD_PREFIX": str(SYSROOT)}
    assert _build_and_run(ARM_CC, tmp_path, [QEMU], env, "cuda_check").startswith("ok:")
