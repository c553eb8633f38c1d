"""Small helpers shared by kvtier's tests (importable because pytest puts tests/ on the path)."""

from __future__ import annotations

import dis
import functools
import gc
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import pytest

from kvtier.base import OffloadingEvent, OffloadKey, ReqContext, TransferResult, make_offload_key

if TYPE_CHECKING:
    from kvtier.cpu import CPUOffloadingManager
    from kvtier.transfer import HostPool, KVCacheRegistration, TransferWorker
    from kvtier.transfer.cuda_worker import CUDATransferWorker


def key(i: int, group: int = 0) -> OffloadKey:
    """A deterministic test key: 8 bytes of `i` plus the group index."""
    return make_offload_key(i.to_bytes(8, "big"), group)


def keys(*ids: int) -> list[OffloadKey]:
    """Several test keys."""
    return [key(i) for i in ids]


def fill(m: CPUOffloadingManager, ctx: ReqContext, *ids: int) -> None:
    """Store the test keys `ids` in `m` (all of them admitted and written)."""
    out = m.prepare_store(keys(*ids), ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)


def all_evictable(m: CPUOffloadingManager) -> bool:
    """Every slot of `m` can be reclaimed: a store of as many new keys as slots finds room."""
    out = m.prepare_store(keys(*range(100, 100 + m.num_slots)), ReqContext("later"))
    return out is not None and len(out.keys_to_store) == m.num_slots


def refused_argv(
    main: Callable[[], None],
    argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> str:
    """Run a benchmark's `main()` with `argv`, expect argparse to refuse it; its stderr."""
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit):
        main()
    return capsys.readouterr().err


@contextmanager
def pool_closes() -> Iterator[list[Any]]:
    """Inside: every `HostPool.close()` call is recorded (the pools, in order) and still runs."""
    from unittest.mock import patch

    from kvtier.transfer import HostPool

    closed: list[Any] = []
    real_close = HostPool.close

    def close(pool: HostPool) -> None:
        closed.append(pool)
        real_close(pool)

    with patch.object(HostPool, "close", close):
        yield closed


def kvtier_with_reader_gone(argv: Sequence[str]) -> tuple[int, str]:
    """Run `python -m kvtier argv` with its stdout a pipe whose reader is gone before the
    command writes anything (`| head` ended); its exit status and stderr."""
    import subprocess

    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    return proc.wait(timeout=120), err


def brute_force_hits(stream: Sequence[Hashable], capacity: int) -> int:
    """Most hits any cache of `capacity` can get over `stream`: every store, bypass and victim
    choice tried (exponential; for OPT's tests on short streams)."""

    @functools.cache
    def best(t: int, cache: frozenset[Hashable]) -> int:
        if t == len(stream):
            return 0
        k = stream[t]
        if k in cache:
            return 1 + best(t + 1, cache)
        options = [best(t + 1, cache)]  # bypass
        if len(cache) < capacity:
            options.append(best(t + 1, cache | {k}))
        else:
            options.extend(best(t + 1, (cache - {v}) | {k}) for v in cache)
        return max(options)

    return best(0, frozenset())


def assert_generator_clean(gen: Any) -> None:
    """A `KVTierGenerator` after `flush()` holds nothing: no job, request, pin or block."""
    gen.flush()
    assert gen.scheduler.num_jobs_in_flight() == 0
    assert gen.scheduler.num_requests() == 0
    assert gen.manager.get_stats().pinned == 0
    assert bool(gen._free.all())


def interrupt_once(
    fn: Callable[..., Any], when: str, armed: list[bool] | None = None
) -> Callable[..., Any]:
    """`fn`, whose first call raises KeyboardInterrupt before (`when="before"`) or after it
    runs `fn`, as a signal can arrive on either side of a call; later calls just run it.
    `armed` ([True]) may be shared by several, so that only the first of them fires."""
    armed = [True] if armed is None else armed

    def call(*args: Any) -> Any:
        if armed.pop() if armed else False:
            if when == "before":
                raise KeyboardInterrupt
            fn(*args)
            raise KeyboardInterrupt
        return fn(*args)

    return call


# Where CPython can raise an asynchronous exception (a signal handler's KeyboardInterrupt): as a
# function is entered, just after a call returns, and at a loop's back edge.
INTERRUPT_CHECKS = {"CALL", "CALL_KW", "CALL_FUNCTION_EX", "JUMP_BACKWARD"}


@contextmanager
def interrupt_at(n: int, fired: list[str], filename: str) -> Iterator[None]:
    """Raise KeyboardInterrupt at the `n`-th point where CPython can deliver one in the frames
    of the source file `filename` (`sys.settrace` with opcode events); `fired` gets where it
    was raised, and stays empty when the code ran past fewer than `n + 1` such points."""
    count = [0]
    prev: dict[FrameType, tuple[str, int]] = {}

    def fire(frame: FrameType, where: str) -> None:
        if not fired:
            if count[0] == n:
                fired.append(f"{where} in {frame.f_code.co_name}:{frame.f_lineno}")
                raise KeyboardInterrupt
            count[0] += 1

    def local(frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        if event == "opcode":
            code, i = frame.f_code, frame.f_lasti
            previous = prev.get(frame)
            prev[frame] = (dis.opname[code.co_code[i]], frame.f_lineno)
            if previous is not None and previous[0] in INTERRUPT_CHECKS:
                fire(frame, f"after {previous[0]} of line {previous[1]}:")
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        if frame.f_code.co_filename != filename:
            return None
        frame.f_trace_opcodes = True
        fire(frame, "entry")
        return local

    old_trace = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(old_trace)


class LibWith:
    """A compiled (ctypes) library with some functions replaced."""

    def __init__(self, real: Any, **replaced: Callable[..., Any]) -> None:
        self.real = real
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def random_ids(n: int, seed: int, vocab: int) -> Any:
    """`n` seeded random token ids below `vocab`, as a 1-D int64 tensor."""
    import torch

    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


class FakeTransfer:
    """A transfer backend for the worker half's tests: `submit_store` and `submit_load` call
    `_submit(job_id)`, which a test subclass defines; results are what it puts in `done`."""

    def __init__(self) -> None:
        self.done: list[TransferResult] = []

    def _submit(self, job_id: int) -> None:
        raise NotImplementedError

    def submit_store(self, job_id: int, device_blocks: Any, slots: Any, group: int = 0) -> None:
        self._submit(job_id)

    def submit_load(
        self, job_id: int, slots: Any, device_blocks: Any, group: int = 0, skip_blocks: int = 0
    ) -> None:
        self._submit(job_id)

    def get_finished(self) -> list[TransferResult]:
        done, self.done = self.done, []
        return done

    def wait(self, job_ids: Iterable[int]) -> None:
        pass

    def holds(self, job_id: int) -> bool:
        return any(r.job_id == job_id for r in self.done)


def run_reports(name: str, ops: list[tuple[str, list[int], int]], repeat: bool) -> list[object]:
    """Drive a policy as the manager does; with `repeat`, each use is reported again by the
    same request right after (the connector's second report). Returns what it evicted."""
    from kvtier.policies import make_policy

    policy = make_policy(name, 6)
    held: set[object] = set()
    out: list[object] = []
    for op, ids, r in ops:
        keys = [key(i) for i in ids]
        ctx = ReqContext(f"r{r}")
        if op == "store":
            new = [k for k in dict.fromkeys(keys) if k not in held]
            need = len(held) + len(new) - 6
            victims = policy.evict(need, keys) if need > 0 else []
            out.append(victims)
            if victims is None:
                continue
            held.difference_update(victims)
            policy.insert(new, ctx)
            held.update(new)
        elif op == "touch":
            policy.touch(keys, ctx)
            if repeat:
                policy.touch(keys, ctx)
        elif op == "load":
            loaded = [k for k in dict.fromkeys(keys) if k in held]
            policy.pin(loaded)
            policy.unpin(loaded, ctx)
            if repeat:
                policy.touch(loaded, ctx)
        else:
            victims = policy.evict(min(len(ids), len(held)), ())
            out.append(victims)
            held.difference_update(victims or ())
    out.append(policy.evict(len(held), ()))
    return out


def apply_events(view: set[OffloadKey], events: Iterable[OffloadingEvent]) -> None:
    """Replay a manager's `OffloadingEvent`s into `view`, the keys a consumer holds, checking
    that each makes sense to it: CPU medium, no key twice in one event, no removal of a key
    never announced, no key announced twice without a removal between."""
    for event in events:
        assert event.medium == "CPU", event.medium
        assert len(set(event.keys)) == len(event.keys), "a key named twice in one event"
        if event.removed:
            assert set(event.keys) <= view, "removal of a key never announced"
            view.difference_update(event.keys)
        else:
            assert not set(event.keys) & view, "a key announced twice"
            view.update(event.keys)


HARNESSES = Path(__file__).parent / "transfer" / "c"
"""The C harnesses, the stand-in CUDA driver (fake_cuda.c) and worker_check.py among them."""


FORK_WITH_A_STORE_IN_FLIGHT = """
w, _ = fake_cuda_worker(2, 12, coalesce_depth=int(sys.argv[1]))
w.submit_store(1, [0, 1, 2, 3], [0, 1])
w.wait([1])
w.submit_store(2, [4, 5], [2])  # in flight (or done, not yet reported) at the fork
pid = os.fork()
if pid == 0:
    signal.alarm(20)  # a hang ends the child with SIGALRM
"""
"""The start of a script for `run_over_fake_cuda` (after importing os, signal, sys and
`worker_check.fake_cuda_worker`; argv[1] the coalesce depth): a worker forks with store 2 in
flight; the script goes on with the child's body, indented, then the parent's."""


def run_over_fake_cuda(
    tmp_path: Path,
    child: str,
    *args: str,
    wrapper: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    needs_extension: bool = True,
) -> str:
    """Run `child`, a Python script's text, with `args` in a process whose `libcuda.so.1` is the
    stand-in driver (or `wrapper`, C source that includes fake_cuda.c), with the harnesses and
    this folder on its path (`from worker_check import fake_cuda_worker`). It must exit 0 in
    `timeout` seconds; returns its stdout. Skips where no C compiler, or kvtier's library (and
    its submit extension, if `needs_extension`), builds here."""
    import os
    import shutil
    import subprocess

    from kvtier.transfer import native

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler")
    if native.library() is None or (needs_extension and native.submit_extension() is None):
        pytest.skip("the library or the submit extension does not build here")
    source = HARNESSES / "fake_cuda.c"
    if wrapper is not None:
        source = tmp_path / "wrapper.c"
        source.write_text(wrapper)
    build_fake_libcuda(cc, tmp_path, source, HARNESSES)
    script = tmp_path / "child.py"
    script.write_text(child)
    path = [str(HARNESSES), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    full_env = {**os.environ, **(env or {}), "LD_LIBRARY_PATH": str(tmp_path),
                "PYTHONPATH": os.pathsep.join(filter(None, path))}  # fmt: skip
    try:
        run = subprocess.run(
            [sys.executable, str(script), *args],
            capture_output=True, text=True, timeout=timeout, env=full_env,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the child ran past {timeout} s: {exc.stdout!r}") from exc
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def build_fake_libcuda(cc: str, out_dir: Path, source: Path, harnesses: Path) -> None:
    """Compile the stand-in CUDA driver (`source`: tests/transfer/c/fake_cuda.c, or a wrapper
    that includes it from `harnesses`) as `out_dir/libcuda.so.1`, for a child process run with
    `LD_LIBRARY_PATH=out_dir`."""
    import subprocess

    import kvtier.transfer

    include = Path(kvtier.transfer.__file__).parent
    build = [cc, "-O2", "-Wall", "-Werror", "-pthread", f"-I{include}", f"-I{harnesses}",
             "-fPIC", "-shared", "-Wl,-soname,libcuda.so.1", "-o",
             str(out_dir / "libcuda.so.1"), str(source)]  # fmt: skip
    out = subprocess.run(build, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def in_child(check: Callable[[], bool], what: str) -> None:
    """Run `check` in a forked child and assert it returned True; the child is killed after
    10 s of it (a hang), and the test fails naming `what` if it never ends."""
    pid = os.fork()
    if pid == 0:
        ok = False
        try:
            signal.alarm(10)
            ok = check()
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            hung = -int(signal.SIGALRM)
            assert code == 0, f"{what}: the child failed (exit {code}; {hung}: it hung)"
            return
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"{what}: the child never ended")


def small_worker(
    native: bool, fault_injector: Callable[[int, str], object] | None = None
) -> TransferWorker:
    """A CPU transfer worker (the compiled one if `native`) over one 8-block layer of 256-byte
    blocks, with 8 host slots."""
    import torch

    from kvtier.transfer import (
        CPUTransferWorker,
        HostPool,
        KVCacheRegistration,
        KVTensor,
        NativeCPUTransferWorker,
    )

    reg = KVCacheRegistration([KVTensor(torch.zeros(8, 256, dtype=torch.uint8), 0)])
    cls = NativeCPUTransferWorker if native else CPUTransferWorker
    return cls(reg, HostPool(reg, 1, num_slots=8), fault_injector=fault_injector)


def gpu_cuda_worker(
    reg: KVCacheRegistration, compiled: bool
) -> tuple[CUDATransferWorker, HostPool]:
    """A CUDA worker over `reg` (tensors on the GPU) and a pinned pool of 8 one-block slots,
    on the compiled path or on torch ops (`copy_mode="kernel"`); skips the test where the
    compiled engine does not build."""
    from kvtier.transfer import HostPool
    from kvtier.transfer.cuda_worker import CUDATransferWorker

    pool = HostPool(reg, 1, num_slots=8, pin=True)
    w = CUDATransferWorker(reg, pool, compiled=None if compiled else False, copy_mode="kernel")
    if w.copy_path != ("compiled" if compiled else "torch"):
        w.shutdown()
        pool.close()
        pytest.skip("the compiled engine does not build here")
    return w, pool


MANAGER_KEY_CALLS: dict[str, Callable[[Any, Any], object]] = {
    "touch": lambda m, k: m.touch(k, ReqContext("r1")),
    "prepare_load": lambda m, k: m.prepare_load(k, ReqContext("r1")),
    "complete_load": lambda m, k: m.complete_load(k, ReqContext("r1")),
    "prepare_store": lambda m, k: m.prepare_store(k, ReqContext("r1")),
    "complete_store": lambda m, k: m.complete_store(k, ReqContext("r1")),
}
"""The manager's five calls that take keys, each given `k` as its keys, for input checks."""


def get_finished_interrupted(
    w: Any, n: int, filename: str, jobs: Iterable[int]
) -> tuple[list[TransferResult], list[str]]:
    """`w.get_finished()` with a KeyboardInterrupt at the `n`-th point of `filename` where
    Python can raise one (`interrupt_at`), then once more: every result of both calls, and
    where the interrupt fired (empty: the call ran past fewer points). Each of `jobs` that the
    interrupted call did not return must still be held. Earlier workers are collected first,
    not inside the traced call: an exit-hook callback would take the interrupt, which Python
    then ignores."""
    fired: list[str] = []
    got: list[TransferResult] = []
    gc.collect()
    try:
        with interrupt_at(n, fired, filename):
            got += w.get_finished()
    except KeyboardInterrupt:
        assert fired
        seen = {r.job_id for r in got}
        unheld = [j for j in jobs if j not in seen and not w.holds(j)]
        assert not unheld, f"jobs {unheld} neither reported nor held (interrupted {fired[0]})"
    got += w.get_finished()
    return got, fired


class FakeCudaEvent:
    """The part of a torch.cuda.Event that the CUDA worker's torch-ops path reads, without a
    GPU: done or not, or (`done` None) raising as torch does on a CUDA error."""

    def __init__(self, done: bool | None) -> None:
        self.done = done

    def query(self) -> bool:
        if self.done is None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.done

    def elapsed_time(self, end: Any) -> float:
        return 2.0


def outputs_under_hash_seeds(code: str, seeds: Iterable[str]) -> set[str]:
    """The distinct stdouts of `python -c code` run once per PYTHONHASHSEED in `seeds`: one
    output means nothing it prints depends on Python's per-process str and bytes hashes."""
    import subprocess

    return {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in seeds
    }


class HeldJob:
    """A fault injector that holds job `job_id` in its copy until `gate` is set; `running` is
    set once that copy has started."""

    def __init__(self, job_id: int = 1) -> None:
        self.job_id = job_id
        self.gate, self.running = threading.Event(), threading.Event()

    def __call__(self, job_id: int, direction: str) -> None:
        if job_id == self.job_id:
            self.running.set()
            self.gate.wait(30)


def tiny_model_size(vocab: int) -> dict[str, int]:
    """`make_demo_model` size overrides for a model small enough to build in milliseconds."""
    return {
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }


class FakeCudart:
    """The CUDA runtime's register calls, so that a pool pins without a GPU."""

    def __init__(self) -> None:
        self.registered: list[int] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.registered.append(address)
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        self.unregistered.append(address)
        return 0


def vs_vllm_reuse_trace(path: Path, second_window: bool = False) -> Path:
    """A Mooncake-format trace for benchmarks/vs_vllm.py's scheduler runs (--sched-requests 46,
    --capacity 0.6): request 0's 20 blocks come back after every 14 requests of 20 new blocks,
    more than the 256 device blocks in between (the device's prefix cache has lost them) and
    fewer than the host tier's slots (it still holds them, so they load from it), while the
    new blocks overflow it (chunks are evicted). `second_window` adds one more request of new
    blocks, so that a window at offset 1 holds as many requests."""
    shared = list(range(20))
    rows, fresh = [], 20
    for _ in range(3):
        rows.append(shared)
        for _ in range(14):
            rows.append(list(range(fresh, fresh + 20)))
            fresh += 20
    rows.append(shared)
    if second_window:
        rows.append(list(range(fresh, fresh + 20)))
    path.write_text("".join(json.dumps({"hash_ids": r}) + "\n" for r in rows))
    return path
