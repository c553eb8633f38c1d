"""benchmarks/vs_vllm.py: the two connectors take turns going first in the scheduler runs
(c)/(d), `--job-delay` has the stub workers report each job some steps late, and
`--kvtier-extra` adds keys to kvtier's extra config."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from helpers import refused_argv, vs_vllm_reuse_trace

# What the source before `--job-delay` and the alternation gave on windows 0 and 1 of
# `vs_vllm_reuse_trace(..., second_window=True)` (46 requests each, LRU, --capacity 0.6): the
# same for PYTHONHASHSEED 0 to 4, and for both connectors (steps, external hit ratio), with
# every job done in its step.
BEFORE = {0: (10, 0.0443029212238682), 1: (9, 0.0221514606119341)}


def _child(trace: Path, capsys: pytest.CaptureFixture[str], *options: str) -> list[dict[str, Any]]:
    """The runs of a scheduler child, in this process (its hash seed is this process's)."""
    import vs_vllm

    argv = ["--scheduler-child", f"--trace={trace}", "--sched-requests=46", "--capacity=0.6"]
    assert vs_vllm.main([*argv, "--sched-policy=lru", *options]) == 0
    runs: list[dict[str, Any]] = json.loads(capsys.readouterr().out.splitlines()[-1])
    return runs


def test_connectors_take_turns_going_first_window_by_window_and_seed_by_seed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("vllm")
    import vs_vllm

    trace = vs_vllm_reuse_trace(tmp_path / "reuse.jsonl", second_window=True)
    out = tmp_path / "order.json"
    argv = ["--skip-manager", "--sched-policy=lru", "--sched-offsets=0,1", "--hash-seeds=0,1"]
    argv += [f"--trace={trace}", "--sched-requests=46", "--capacity=0.6", f"--json={out}"]
    assert vs_vllm.main(argv) == 0
    sched = json.loads(out.read_text())["scheduler"]
    order = [(r["hash_seed"], r["offset"], r["first"]) for r in sched["runs"]]
    assert order == [(0, 0, "vllm"), (0, 1, "kvtier"), (1, 0, "kvtier"), (1, 1, "vllm")]
    assert sched["runs_by_first"] == {"vllm": 2, "kvtier": 2}
    by_first = sched["speedup_by_first"]
    assert set(by_first) == {"vllm", "kvtier"} and all(x > 0 for x in by_first.values())
    # Whichever went first, every run gives what the runs gave before the alternation.
    for r in sched["runs"]:
        steps, hit = BEFORE[r["offset"]]
        assert (r["vllm_steps"], r["kvtier_steps"], r["job_delay"]) == (steps, steps, 0), r
        assert r["vllm_hit_ratio"] == r["kvtier_hit_ratio"] == hit, r
    assert "vllm first: " in capsys.readouterr().out


def test_hit_ratios_and_steps_do_not_depend_on_which_connector_goes_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("vllm")
    trace = vs_vllm_reuse_trace(tmp_path / "reuse.jsonl", second_window=True)
    runs = {
        first: _child(trace, capsys, "--sched-offsets=0,1", f"--first-connector={first}")
        for first in ("vllm", "kvtier")
    }
    # A child takes turns window by window, from the connector it is told.
    assert [r["first"] for r in runs["vllm"]] == ["vllm", "kvtier"]
    assert [r["first"] for r in runs["kvtier"]] == ["kvtier", "vllm"]
    keys = [f"{side}_{what}" for side in ("vllm", "kvtier") for what in ("steps", "hit_ratio")]
    for a, b in zip(runs["vllm"], runs["kvtier"], strict=True):
        assert a["offset"] == b["offset"]
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}


def test_job_delay_0_is_the_old_instant_completion(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("vllm")
    trace = vs_vllm_reuse_trace(tmp_path / "reuse.jsonl", second_window=True)
    (run,) = _child(trace, capsys, "--sched-offsets=0", "--job-delay=0")
    steps, hit = BEFORE[0]
    assert run["job_delay"] == 0
    assert (run["vllm_steps"], run["kvtier_steps"]) == (steps, steps)
    assert run["vllm_hit_ratio"] == run["kvtier_hit_ratio"] == hit > 0


def test_job_delay_2_reports_every_load_two_steps_late_to_both_connectors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("vllm")
    import vs_vllm
    from kvtier.integrations.vllm.metadata import KVTierConnectorMetadata

    # Per connector: (step issued, step reported) of each request's load, from the metadata
    # vLLM's scheduler hands the workers and the `finished_recving` it gets back.
    loads: dict[str, dict[str, list[int]]] = {"vllm": {}, "kvtier": {}}
    output = vs_vllm._StubWorkers.output

    def record(workers: Any, meta: Any) -> Any:
        step = workers.step
        if isinstance(meta, KVTierConnectorMetadata):
            side, issued = "kvtier", [j.req_id for j in meta.step.loads]
        else:
            side, issued = "vllm", [j.req_id for j in meta.load_jobs.values() if not j.sync]
        for req_id in issued:
            loads[side].setdefault(req_id, []).append(step)
        out = output(workers, meta)
        for req_id in out.finished_recving or ():
            loads[side][req_id].append(step)
        return out

    monkeypatch.setattr(vs_vllm._StubWorkers, "output", record)
    trace = vs_vllm_reuse_trace(tmp_path / "reuse.jsonl", second_window=True)
    (run,) = _child(trace, capsys, "--sched-offsets=0", "--job-delay=2")
    assert run["job_delay"] == 2
    for side in ("vllm", "kvtier"):
        assert loads[side], f"{side}: the trace must load from the host tier"
        assert all(len(s) == 2 and s[1] - s[0] == 2 for s in loads[side].values()), loads
        assert run[f"{side}_hit_ratio"] > 0
        # The replay ended, no sooner than with every job done in its step.
        assert run[f"{side}_steps"] >= BEFORE[0][0]
    assert run["vllm_jobs_waited"] == run["kvtier_jobs_waited"] == 0  # nothing was preempted


def test_a_replay_that_stops_making_progress_is_stopped_with_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Workers that lose every load: its request waits for it forever, and the replay looped.
    pytest.importorskip("vllm")
    import vs_vllm

    class LosesLoads(vs_vllm._StubWorkers):
        def _issue(self, job_id: int, req_id: str, recv: bool) -> None:
            if not recv:
                super()._issue(job_id, req_id, recv)

    monkeypatch.setattr(vs_vllm, "_StubWorkers", LosesLoads)
    trace = vs_vllm_reuse_trace(tmp_path / "reuse.jsonl", second_window=True)
    with pytest.raises(RuntimeError, match=r"the replay made no progress for 9 steps \(step"):
        _child(trace, capsys, "--sched-offsets=0")


@pytest.mark.parametrize(
    ("option", "extra", "message"),
    [
        ("--job-delay=-1", [], "argument --job-delay: '-1' is invalid; expected an integer >= 0"),
        ("--job-delay=1.5", [], "argument --job-delay: '1.5' is invalid; expected an integer >= 0"),
        ("--job-delay=two", [], "argument --job-delay: 'two' is invalid; expected an integer >= 0"),
        (
            "--job-delay=2",
            ["--skip-scheduler"],
            "--job-delay 2: only the scheduler runs (c)/(d) have stub workers, which "
            "--skip-scheduler leaves out; expected 0 or no --skip-scheduler",
        ),
        (
            "--kvtier-extra=x",
            [],
            "argument --kvtier-extra: 'x' is not JSON (Expecting value); expected an object",
        ),
        (
            "--kvtier-extra=[1]",
            [],
            "argument --kvtier-extra: '[1]' is a JSON list; expected an object",
        ),
        (
            "--max-batched-tokens=8",
            [],
            "argument --max-batched-tokens: '8' is invalid; expected an integer >= 16",
        ),
    ],
    ids=[
        "negative",
        "fraction",
        "word",
        "without-scheduler",
        "extra-not-json",
        "extra-list",
        "batch-below-a-block",
    ],
)
def test_bad_job_delay_or_extra_config_is_refused_naming_the_value(
    option: str,
    extra: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import vs_vllm

    def must_not_run(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the benchmark started before refusing its arguments")

    for name in ("compare_managers", "compare_schedulers", "compare_kv_events"):
        monkeypatch.setattr(vs_vllm, name, must_not_run)
    trace = vs_vllm_reuse_trace(tmp_path / "reuse.jsonl", second_window=True)
    argv = ["vs_vllm.py", f"--trace={trace}", option, *extra]

    def main() -> None:
        vs_vllm.main()  # it reads sys.argv

    last = refused_argv(main, argv, monkeypatch, capsys).strip().splitlines()[-1]
    assert last == f"vs_vllm.py: error: {message}"


# --kvtier-extra: keys added to kvtier's kv_connector_extra_config in (d), to compare kvtier's
# settings (release_finished_blocks) under the same stub workers.


def test_the_extra_config_reaches_kvtiers_connector_and_the_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("vllm")
    from kvtier.integrations.vllm.scheduler_side import KVTierSchedulerSide

    seen: list[bool] = []
    init = KVTierSchedulerSide.__init__

    def spy(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        seen.append(self._release)

    monkeypatch.setattr(KVTierSchedulerSide, "__init__", spy)
    trace = vs_vllm_reuse_trace(tmp_path / "reuse.jsonl", second_window=True)
    extra = '--kvtier-extra={"release_finished_blocks": false}'
    (held,) = _child(trace, capsys, "--sched-offsets=0", "--job-delay=2", extra)
    (released,) = _child(trace, capsys, "--sched-offsets=0", "--job-delay=2")
    assert seen == [False, True]
    assert held["kvtier_extra"] == {"release_finished_blocks": False}
    assert released["kvtier_extra"] == {}
    # vLLM's side is not given the keys: its figures are the same either way.
    assert held["vllm_steps"] == released["vllm_steps"]
    assert held["vllm_hit_ratio"] == released["vllm_hit_ratio"]


def test_a_key_kvtier_refuses_fails_the_run_with_kvtiers_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("vllm")
    from kvtier.config import ConfigError

    trace = vs_vllm_reuse_trace(tmp_path / "reuse.jsonl", second_window=True)
    bad = '--kvtier-extra={"release_finished_blocks": "maybe"}'
    with pytest.raises(ConfigError, match="release_finished_blocks='maybe'"):
        _child(trace, capsys, "--sched-offsets=0", bad)
