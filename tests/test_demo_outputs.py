"""Where `kvtier demo` writes, and what it says when it cannot: `--json` into the checkpoint
it reads, `--json -`, a full disk, a reader of stdout that goes away, and `--quiet` with a
checkpoint (transformers' own progress bar)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers import kvtier_with_reader_gone
from kvtier.cli import main

TINY = ["--conversations", "1", "--turns", "1", "--system-tokens", "16", "--user-tokens", "8",
        "--new-tokens", "2"]  # fmt: skip
FULL = pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvtier.integrations.hf.models import make_demo_model

    model, _ = make_demo_model("qwen2", seed=3, num_hidden_layers=1)
    path = tmp_path_factory.mktemp("ckpt") / "model"
    model.save_pretrained(path)
    return path


def _no_run(*args: object) -> None:
    raise AssertionError("the workload ran before --json was checked")


@pytest.mark.parametrize("through_link", [False, True])
def test_json_into_the_checkpoint_is_refused_before_the_run(
    checkpoint: Path,
    through_link: bool,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--json CKPT/config.json` replaced the checkpoint's config with the results."""
    config = checkpoint / "config.json"
    before = config.read_bytes()
    target = config
    if through_link:
        target = tmp_path / "results.json"
        target.symlink_to(config)
    monkeypatch.setattr("kvtier.demo.run_demo", _no_run)
    args = ["demo", *TINY, "--quiet", "--model", str(checkpoint), "--json", str(target)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err == (
        f"kvtier demo: error: --json {target} is the checkpoint's config.json (--model "
        f"{checkpoint}); expected a file outside the checkpoint for the results\n"
    )
    assert config.read_bytes() == before


@FULL
def test_a_json_file_that_cannot_be_written_is_named_after_the_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It said only `error: [Errno 28] No space left on device`, and the table, printed after
    the JSON, was lost."""
    assert main(["demo", *TINY, "--json", "/dev/full"]) == 2
    captured = capsys.readouterr()
    assert "prefix hit" in captured.out and "identical with and without kvtier" in captured.out
    assert captured.err.endswith(
        "kvtier demo: error: cannot write to --json file '/dev/full': [Errno 28] No space left "
        "on device\n"
    )


def _demo_in_shell(args: list[str], redirect: str) -> subprocess.CompletedProcess[str]:
    line = shlex.join([sys.executable, "-m", "kvtier", "demo", *TINY, *args]) + " " + redirect
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        ["bash", "-c", line], capture_output=True, text=True, env=env, timeout=300
    )


@FULL
def test_a_full_stdout_is_named_and_the_json_file_still_written(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    done = _demo_in_shell(["--json", str(out)], ">/dev/full")
    assert done.returncode == 2
    assert done.stderr.endswith(
        "kvtier demo: error: cannot write to standard output: [Errno 28] No space left on device\n"
    ), done.stderr
    assert json.loads(out.read_text())["identical_outputs"] is True


def test_a_reader_that_goes_away_is_not_reported_as_different_tokens() -> None:
    """`kvtier demo | head -1` exited 1, the status README gives to "tokens differ"."""
    assert kvtier_with_reader_gone(["demo", *TINY]) == (141, "")


def test_json_dash_writes_the_json_to_stdout_instead_of_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As `kvtier simulate --json -`; it wrote a file named '-'."""
    monkeypatch.chdir(tmp_path)
    assert main(["demo", *TINY, "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identical_outputs"] is True and report["requests"] == 1
    assert not (tmp_path / "-").exists()


def test_quiet_hides_transformers_progress_bar_and_restores_it(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    capsys.readouterr()
    assert main(["demo", *TINY, "--quiet", "--model", str(checkpoint)]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "Loading weights" not in captured.err, captured.err
    assert hf_logging.is_progress_bar_enabled()
