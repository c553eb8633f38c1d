"""benchmarks/vs_vllm.py --kv-events: vLLM's KV events through both connectors, as vLLM's
scheduler drains them, with the settings side by side and the same decisions in each."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from helpers import refused_argv, vs_vllm_reuse_trace

SETTINGS = ["off", "on", "self-describing"]


def test_kv_events_are_translated_and_change_no_decision(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("vllm")
    import vs_vllm

    trace = vs_vllm_reuse_trace(tmp_path / "reuse.jsonl")
    out = tmp_path / "events.json"
    argv = ["--skip-manager", "--sched-policy=lru", "--sched-offsets=0", "--hash-seeds=0"]
    argv += [f"--trace={trace}", "--sched-requests=46", "--capacity=0.6", f"--json={out}"]
    assert vs_vllm.main([*argv, f"--kv-events={','.join(SETTINGS)}"]) == 0
    result = json.loads(out.read_text())
    by_events: dict[str, dict[str, Any]] = result["scheduler_by_kv_events"]["lru"]
    assert list(by_events) == SETTINGS
    # The top-level figures stay the first setting's, as without the option.
    assert result["scheduler"]["kv_events"] == "off"
    assert result["scheduler"]["runs"] == by_events["off"]["runs"]

    for side in ("vllm", "kvtier"):
        off, on, described = (by_events[s][f"{side}_events"] for s in SETTINGS)
        assert off["stored"] == off["removed"] == 0, side
        assert on["stored"] > 0 and on["removed"] > 0, side
        assert on["stored_with_tokens"] == 0, side
        assert described["stored_with_tokens"] == described["stored"] > 0, side
        # The same chunks are stored and evicted whatever the payload.
        assert (described["stored"], described["removed"]) == (on["stored"], on["removed"])

    # Events change no decision: every run's hit ratios are those of the run without them.
    hits = {s: (r["vllm_hit_ratio"], r["kvtier_hit_ratio"]) for s, r in by_events.items()}
    assert hits["off"][1] > 0, "the trace must reuse chunks from the host tier"
    assert hits["on"] == hits["self-describing"] == hits["off"]
    assert all(r["hits_as_baseline"] for r in by_events.values())
    assert by_events["off"]["kvtier_vs_baseline"] == by_events["off"]["vllm_vs_baseline"] == 1
    assert "KV events, policy lru" in capsys.readouterr().out


def test_a_scheduler_child_runs_the_setting_it_is_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The child reports its own setting, so the parent cannot file one run under another.
    pytest.importorskip("vllm")
    import vs_vllm

    trace = vs_vllm_reuse_trace(tmp_path / "reuse.jsonl")
    argv = ["--scheduler-child", f"--trace={trace}", "--sched-offsets=0", "--sched-requests=16"]
    assert vs_vllm.main([*argv, "--sched-policy=lru", "--kv-events=self-describing"]) == 0
    (run,) = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert run["kv_events"] == "self-describing"
    assert run["kvtier_events"]["stored_with_tokens"] == run["kvtier_events"]["stored"] > 0


@pytest.mark.parametrize(
    ("value", "extra", "message"),
    [
        (
            "on,sometimes",
            [],
            "argument --kv-events: 'on,sometimes': unknown setting ['sometimes']; expected "
            "off, on or self-describing, or a comma list of them",
        ),
        ("off,on,off", [], "--kv-events: ['off'] given twice; expected each setting once"),
        (
            "on",
            ["--skip-scheduler"],
            "--kv-events on: only the scheduler runs (c)/(d), which --skip-scheduler leaves "
            "out, have KV events; expected off or no --skip-scheduler",
        ),
    ],
    ids=["unknown", "twice", "without-scheduler"],
)
def test_bad_kv_events_are_refused_naming_the_value(
    value: str,
    extra: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import vs_vllm

    def must_not_run(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the benchmark started before refusing its arguments")

    monkeypatch.setattr(vs_vllm, "compare_kv_events", must_not_run)
    monkeypatch.setattr(vs_vllm, "compare_schedulers", must_not_run)
    trace = vs_vllm_reuse_trace(tmp_path / "reuse.jsonl")
    argv = ["vs_vllm.py", f"--trace={trace}", f"--kv-events={value}", *extra]

    def main() -> None:
        vs_vllm.main()  # it reads sys.argv

    last = refused_argv(main, argv, monkeypatch, capsys).strip().splitlines()[-1]
    assert last == f"vs_vllm.py: error: {message}"
