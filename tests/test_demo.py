"""`kvtier demo` through the CLI entry point, on a tiny workload (kvtier.demo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.cli import main

TINY = ["--conversations", "2", "--turns", "2", "--system-tokens", "32", "--user-tokens", "24",
        "--new-tokens", "4"]  # fmt: skip


def test_tiny_demo_reuses_prefixes_and_reports_identical_outputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo.json"
    assert main(["demo", *TINY, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["identical_outputs"] is True
    assert report["requests"] == 4
    # Conversation 1 reuses the 32-token system prompt; turn 2 reuses each conversation's turn 1.
    assert 0 < report["prefix_hit_ratio"] < 1
    assert report["prefill_tokens_saved"] > 0
    assert report["prefill_tokens"]["recompute"] == report["prompt_tokens"]
    saved = report["prefill_tokens"]["recompute"] - report["prefill_tokens"]["kvtier"]
    assert report["prefill_tokens_saved"] == saved
    assert report["max_logit_diff"] <= 1e-4
    assert report["bytes_loaded"] > 0 and report["bytes_stored"] > 0
    assert report["failed_loads"] == 0
    for key in ("ttft_median_s", "ttft_p90_s"):
        assert set(report[key]) == {"kvtier", "recompute"}
        assert all(v > 0 for v in report[key].values())
    printed = capsys.readouterr().out
    assert "prefix hit" in printed
    assert "identical with and without kvtier" in printed


def test_quiet_prints_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *TINY[:4], "--turns", "1", "--quiet"]) == 0
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--turns", "0"], "--turns=0"),
        (["--model", "/nonexistent/checkpoint"], "not a directory"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_error(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", *args]) == 2
    assert message in capsys.readouterr().err


def test_unwritable_json_path_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_run(*args: object) -> None:
        raise AssertionError("the workload ran before --json was checked")

    monkeypatch.setattr("kvtier.demo.run_demo", no_run)
    out = tmp_path / "missing" / "demo.json"
    assert main(["demo", *TINY, "--json", str(out), "--quiet"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_help_states_the_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "exit status: 0 when" in capsys.readouterr().out.replace("\n", " ")


def test_local_checkpoint_with_model_path(tmp_path: Path) -> None:
    from kvtier.integrations.hf.models import make_demo_model

    model, _ = make_demo_model("qwen2", seed=3, num_hidden_layers=2)
    model.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "demo.json"
    args = [*TINY, "--model", str(tmp_path / "ckpt"), "--json", str(out), "--quiet"]
    assert main(["demo", *args]) == 0
    report = json.loads(out.read_text())
    assert report["model"] == str(tmp_path / "ckpt")
    assert report["identical_outputs"] is True
    assert report["prefix_hit_ratio"] > 0
