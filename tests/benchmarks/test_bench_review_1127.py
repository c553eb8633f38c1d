"""Benchmark review: a cold first registration timed, progress lines that came all at once at
the end, refusals that did not name their flag, and a flag silently ignored."""

from __future__ import annotations

import importlib
import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from helpers import refused_argv


def _trace(path: Path) -> Path:
    rows = [{"timestamp": t, "input_length": 1024, "hash_ids": [1, t + 2]} for t in range(20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _must_not_run(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the benchmark started its run before refusing its arguments")


def test_registration_speed_does_not_time_the_first_cold_registration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The process's first registration took 86 ms against 6 ms warm (1,024 parts): with
    # --repeats 1 or 2 the reported median was that cold run, or half of it.
    import registration_speed

    clock = [0.0]
    made: list[str] = []

    class Registration:
        def __init__(self, kvs: list[Any]) -> None:
            clock[0] += 1.0 if not made else 0.001  # the first is cold
            made.append("c" if kvs[0].tensor.is_contiguous() else "i")

        def page_bytes(self) -> int:
            return 4 * registration_speed.WIDTH

    monkeypatch.setattr(registration_speed, "KVCacheRegistration", Registration)
    monkeypatch.setattr(registration_speed, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    times = registration_speed.both_arrangements(4, 3)
    assert [len(t) for t in times.values()] == [3, 3]
    assert max(max(t) for t in times.values()) == pytest.approx(0.001)
    # One untimed of each, then the timed ones alternated, each arrangement first in turn.
    assert "".join(made) == "ci" + "ci" + "ic" + "ci"


def test_manager_ops_reports_each_replay_as_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    # The lines of a workload all came after its last replay (20 s and more on Mooncake).
    import manager_ops

    events: list[str] = []

    def replay(workload: Any, policy: str, num_slots: int) -> tuple[int, int, float, float]:
        events.append(policy)
        return 10, 20, 0.5, 0.25

    monkeypatch.setattr(manager_ops, "replay_kvtier", replay)
    workload = [[manager_ops._key(i) for i in range(4)]]
    rows = manager_ops.run({"w": workload}, ["lru", "arc"], 2, events.append)
    assert events == [
        "lru", "w lru: 1 of 2", "arc", "w arc: 1 of 2",
        "arc", "w arc: done", "lru", "w lru: done",
    ]  # fmt: skip
    assert [r["policy"] for r in rows] == ["lru", "arc"]


def test_vs_vllm_reports_each_pair_of_manager_replays(monkeypatch: pytest.MonkeyPatch) -> None:
    # One line per policy came after all its repeats: 15-30 s for vLLM's LRU on Mooncake.
    pytest.importorskip("vllm")
    import vs_vllm

    events: list[str] = []

    def replay(
        workload: Any, manager: Any, make_ctx: Any, hit: object
    ) -> tuple[int, int, float, float]:
        events.append(type(manager).__module__.split(".")[0])
        return 10, 20, 0.5, 0.25

    monkeypatch.setattr(vs_vllm, "replay", replay)
    out = vs_vllm.compare_managers([[]], ["lru"], 4, 3, events.append)
    assert events == [
        "vllm", "kvtier", "manager, lru: 1 of 3",
        "kvtier", "vllm", "manager, lru: 2 of 3",  # each goes first in turn
        "vllm", "kvtier", "manager, lru: done",
    ]  # fmt: skip
    assert out["lru"]["speedup"] == 1.0


@pytest.mark.parametrize("flag", ["--capacity", "--device"])
def test_policy_phases_names_the_size_flag_it_refuses(
    flag: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Both said "capacity '0' is less than one block", whichever flag held the 0.
    import policy_phases

    monkeypatch.setattr(policy_phases, "hits", _must_not_run)
    argv = ["policy_phases.py", str(_trace(tmp_path / "t.jsonl")), flag, "0"]
    last = refused_argv(policy_phases.main, argv, monkeypatch, capsys).strip().splitlines()[-1]
    assert last.startswith(f"policy_phases.py: error: {flag}: capacity '0' is less than one")


def test_sim_speed_names_the_capacities_flag_it_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sim_speed

    monkeypatch.setattr(sim_speed, "run_grid", _must_not_run)
    argv = ["sim_speed.py", "--trace", str(_trace(tmp_path / "t.jsonl")), "--capacities", "1%,x"]

    def main() -> None:
        sim_speed.main()

    last = refused_argv(main, argv, monkeypatch, capsys).strip().splitlines()[-1]
    assert last.startswith("sim_speed.py: error: --capacities: capacity 'x' is invalid")


@pytest.mark.parametrize(
    ("argv", "cuda"),
    [(["--backend", "cpu", "--cpu-worker", "python"], False), (["--backend", "cuda"], True)],
)
def test_transfer_bw_refuses_copy_threads_where_nothing_takes_them(
    argv: list[str],
    cuda: bool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # They were ignored: the rows of one Python copy thread (or of the CUDA worker) passed for
    # a run with the copy threads asked for.
    last = _transfer_bw_refusal([*argv, "--copy-threads", "4"], cuda, monkeypatch, capsys)
    assert last.startswith("transfer_bw.py: error: --copy-threads sets"), last


def _transfer_bw_refusal(
    argv: list[str],
    cuda: bool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> str:
    """The last error line of `transfer_bw.py argv`, which must refuse before measuring."""
    pytest.importorskip("torch")
    transfer_bw = importlib.import_module("transfer_bw")
    monkeypatch.setattr(transfer_bw, "bench_page", _must_not_run)
    monkeypatch.setattr(transfer_bw.torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(sys, "argv", ["transfer_bw.py"])  # argparse's program name
    with pytest.raises(SystemExit):
        transfer_bw.main(argv)
    return str(capsys.readouterr().err.strip().splitlines()[-1])


class _Stdout(io.StringIO):
    """sys.stdout that remembers what had been flushed, as a pipe's reader would see it."""

    def __init__(self) -> None:
        super().__init__()
        self.flushed = ""

    def flush(self) -> None:
        super().flush()
        self.flushed = self.getvalue()


def test_policy_stress_flushes_each_row_as_it_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    # Piped (`| tee`), the rows of a 3-minute run appeared only at its end, or never if it
    # was stopped.
    import policy_stress

    stdout, seen = _Stdout(), []

    def replay(policy: str, trace: Any, capacity: int) -> float:
        seen.append(stdout.flushed)
        return 50.0

    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(sys, "argv", ["policy_stress.py", "--policies", "lru"])
    monkeypatch.setattr(policy_stress, "replay", replay)
    monkeypatch.setattr(
        policy_stress, "workloads", lambda: iter([("a", [[1, 2]], [4]), ("b", [[3]], [4])])
    )
    policy_stress.main()
    assert "a                         4    50.00" in seen[1]  # before b's replay


def test_policy_windows_flushes_each_row_as_it_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import policy_windows

    stdout, seen = _Stdout(), []

    def hit_pct(trace: Any, policy: str, share: float) -> float:
        seen.append(stdout.flushed)
        return 10.0

    trace = str(_trace(tmp_path / "t.jsonl"))
    argv = ["policy_windows.py", trace, "--policies", "arc", "--sizes", "5", "--starts", "2"]
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(policy_windows, "hit_pct", hit_pct)
    policy_windows.main()
    per_window = 2 * len(policy_windows.SHARES)  # lru's and arc's
    assert "t.jsonl[0:5]" in seen[per_window]  # before the second window's first replay


_FAKE_CHILD = """
import json, sys
print("INFO vLLM says something", file=sys.stderr, flush=True)
print("vs_vllm progress: window 0: done (1 of 2)", file=sys.stderr, flush=True)
if "--fail" in sys.argv[0]:
    sys.exit(1)
run = {"vllm_steps_per_s": 1.0, "kvtier_steps_per_s": 2.0, "vllm_hit_ratio": 0.1,
       "kvtier_hit_ratio": 0.2, "num_slots": 16, "num_requests": 3}
print(json.dumps([{"offset": 0, **run}, {"offset": 5, **run}]))
"""


def test_vs_vllm_passes_on_each_scheduler_childs_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A child replays five windows of 10 s or more; its one line came at its end.
    import vs_vllm

    child = tmp_path / "child.py"
    child.write_text(_FAKE_CHILD)
    monkeypatch.setattr(vs_vllm, "__file__", str(child))
    lines: list[str] = []
    out = vs_vllm.compare_schedulers(child, [0, 5], 3, "lru", 0.5, [7], log=lines.append)
    assert lines == [
        "scheduler, lru, PYTHONHASHSEED 7: window 0: done (1 of 2)",
        "scheduler, lru, PYTHONHASHSEED 7: done (1 of 1)",
    ]
    assert out["speedup"] == 2.0 and [w["offset"] for w in out["windows"]] == [0, 5]
    # A failing child's error keeps what it wrote, less its progress lines.
    failing = tmp_path / "child--fail.py"
    failing.write_text(_FAKE_CHILD)
    monkeypatch.setattr(vs_vllm, "__file__", str(failing))
    with pytest.raises(RuntimeError, match="vLLM says something") as error:
        vs_vllm.compare_schedulers(failing, [0, 5], 3, "lru", 0.5, [7])
    assert "vs_vllm progress" not in str(error.value)


def test_a_vs_vllm_scheduler_child_reports_each_window_but_the_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("vllm")
    import vs_vllm

    def scheduler_run(trace: Path, offset: int, *args: Any) -> dict[str, Any]:
        return {"offset": offset}

    monkeypatch.setattr(vs_vllm, "scheduler_run", scheduler_run)
    trace = str(_trace(tmp_path / "t.jsonl"))
    argv = ["--scheduler-child", f"--trace={trace}", "--sched-offsets=0,4,8"]
    assert vs_vllm.main([*argv, "--sched-requests=2", "--sched-policy=lru"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.splitlines()[-1]) == [{"offset": o} for o in (0, 4, 8)]
    progress = [x for x in captured.err.splitlines() if x.startswith("vs_vllm progress: ")]
    assert progress == [
        "vs_vllm progress: window 0: done (1 of 3)",
        "vs_vllm progress: window 4: done (2 of 3)",
    ]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--pageable"], "--pageable"),  # the rows were named "cpu-pageable" for a plain run
        (["--copy-mode", "dma", "--cuda-path", "torch"], "--copy-mode, --cuda-path"),
    ],
)
def test_transfer_bw_refuses_cuda_options_on_cpu(
    argv: list[str],
    named: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    last = _transfer_bw_refusal(["--backend", "cpu", *argv], False, monkeypatch, capsys)
    assert (
        last == f"transfer_bw.py: error: {named}: only with --backend cuda; the backend here is cpu"
    )


@pytest.mark.parametrize("argv", [["--copy-mode", "kernel"], ["--cuda-path", "torch"]])
def test_worker_side_refuses_cuda_options_on_cpu(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    worker_side = importlib.import_module("worker_side")
    monkeypatch.setattr(worker_side, "Rig", _must_not_run)
    monkeypatch.setattr(worker_side.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["worker_side.py"])
    with pytest.raises(SystemExit):
        worker_side.main(argv)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        last == f"worker_side.py: error: {argv[0]}: only with --device cuda; the device here is cpu"
    )


def test_cpu_submit_labels_the_share_range_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    # The column of "82-82%" (the share's range over the rounds) was headed "rounds".
    pytest.importorskip("torch")
    cpu_submit = importlib.import_module("cpu_submit")
    row = {"path": "extension", "direction": "store", "page_bytes": 65536, "blocks_per_job": 1,
           "share_of_ceiling": 0.9, "share_min": 0.8, "share_max": 1.0, "submit_us": 2.0,
           "copy_us": 3.0, "wall_us": 4.0}  # fmt: skip
    shown: list[Any] = []
    monkeypatch.setattr(cpu_submit, "library", lambda: object())
    monkeypatch.setattr(cpu_submit, "submit_extension", lambda: object())
    monkeypatch.setattr(cpu_submit, "bench_case", lambda *args: [row])
    monkeypatch.setattr(cpu_submit, "show_and_save", lambda table, *args: shown.append(table))
    cpu_submit.main(["--cases", "64x1", "--region-mib", "1"])
    (table,) = shown
    headers = [str(c.header) for c in table.columns]
    cells = {h: next(iter(c.cells)) for h, c in zip(headers, table.columns, strict=True)}
    assert "rounds" not in headers and cells["share range"] == "80-100%"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--sizes", "5,x"], "argument --sizes: '5,x' is invalid; expected comma-separated"),
        (["--starts", "0"], "argument --starts: '0' is invalid; expected an integer >= 1"),
    ],
)
def test_policy_windows_names_the_flag_and_what_it_takes(
    argv: list[str],
    expected: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # "invalid _ints value: '5,x'", and "--starts and every --sizes value must be at least 1".
    import policy_windows

    monkeypatch.setattr(policy_windows, "hit_pct", _must_not_run)
    full = ["policy_windows.py", str(_trace(tmp_path / "t.jsonl")), *argv]
    last = refused_argv(policy_windows.main, full, monkeypatch, capsys).strip().splitlines()[-1]
    assert last.startswith(f"policy_windows.py: error: {expected}"), last


def test_e2e_hf_gives_the_cpu_rows_unit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its values are in ms, as the rows above it, but it alone had no unit.
    pytest.importorskip("transformers")
    import e2e_hf

    class Model:
        def to(self, **kwargs: Any) -> Model:
            return self

    def bench_fresh(*args: Any) -> dict[str, float]:
        out = {"kvtier_outside_model_s": 0.001, "bytes_stored_per_request": 1.0}
        for key in ("request", "ttft", "cpu"):
            for name in ("kvtier", "plain", "paged"):
                out[f"{key}_{name}_s"] = 0.0125
            for name in ("overhead", "overhead_paired", "own_work", "own_work_paired"):
                out[f"{key}_{name}"] = 0.0
        return out

    monkeypatch.setattr(e2e_hf, "make_demo_model", lambda *a, **k: (Model(), None))
    monkeypatch.setattr(e2e_hf, "bench_fresh", bench_fresh)
    monkeypatch.setattr(sys, "argv", ["e2e_hf.py", "--prefixes", ""])
    e2e_hf.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if "12.5" in line]
    assert len(rows) == 3 and all("(ms)" in line for line in rows), rows


@pytest.mark.parametrize(
    ("script", "argv"),
    [
        ("manager_ops", ["--policies", "lru,arc,lru"]),
        ("sim_speed", ["--policies", "opt,lru,opt"]),
        ("vs_vllm", ["--policies", "lru,arc,lru", "--skip-scheduler"]),
    ],
)
def test_a_policy_named_twice_is_refused(
    script: str,
    argv: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Accepted before, and its rows printed twice, each with twice the samples."""
    module = importlib.import_module(script)
    trace = str(_trace(tmp_path / "t.jsonl"))

    def main() -> None:
        if script == "sim_speed":
            module.main()  # it reads sys.argv
        else:
            module.main([*argv, "--trace", trace])

    full = [f"{script}.py", *argv, "--trace", trace]
    last = refused_argv(main, full, monkeypatch, capsys).strip().splitlines()[-1]
    twice = "['opt']" if script == "sim_speed" else "['lru']"
    assert last == f"{script}.py: error: --policies: {twice} given twice; expected each name once"


@pytest.mark.parametrize("script", ["policy_windows", "policy_stress", "policy_fuzz"])
def test_the_policy_labs_refuse_a_policy_named_twice(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Accepted before: each of its rows (or cells) was replayed and printed twice."""
    module = importlib.import_module(script)
    argv = [f"{script}.py", "--policies", "lru,kvaware,lru"]
    if script == "policy_windows":
        argv.append(str(_trace(tmp_path / "t.jsonl")))
    last = refused_argv(module.main, argv, monkeypatch, capsys).strip().splitlines()[-1]
    assert last == f"{script}.py: error: --policies: ['lru'] given twice; expected each name once"
