"""`kvtier demo` refuses what it cannot run in one line and exit status 2, before the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.cli import main

TINY = ["--conversations", "1", "--turns", "1", "--system-tokens", "16", "--user-tokens", "8",
        "--new-tokens", "2", "--quiet"]  # fmt: skip


def _refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()  # what setting up wrote (save_pretrained's progress bars)
    assert main(["demo", *TINY, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("kvtier demo: error: --"), err
    return err


def test_json_path_that_is_a_folder_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_run(*args: object) -> None:
        raise AssertionError("the workload ran before --json was checked")

    monkeypatch.setattr("kvtier.demo.run_demo", no_run)
    assert "cannot write there" in _refused(["--json", str(tmp_path)], capsys)


def test_json_check_leaves_no_file_behind(tmp_path: Path) -> None:
    from kvtier import demo

    out = tmp_path / "demo.json"
    demo._check_writable(out)
    assert not out.exists()


def test_seed_torch_cannot_take_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--seed=" in _refused(["--seed", str(2**64)], capsys)


def test_checkpoint_without_config_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "has no config.json" in _refused(["--model", str(tmp_path)], capsys)


def test_non_causal_lm_checkpoint_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import T5Config, T5Model

    config = T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    T5Model(config).save_pretrained(tmp_path / "t5")
    err = _refused(["--model", str(tmp_path / "t5")], capsys)
    assert "cannot load it as a causal LM" in err and "T5Config" in err


def test_checkpoint_with_too_few_positions_is_refused_not_reported_as_different(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    model_cls: Any = GPT2LMHeadModel  # untyped upstream
    model_cls(config).save_pretrained(tmp_path / "gpt2")
    err = _refused(["--model", str(tmp_path / "gpt2"), "--user-tokens", "32"], capsys)
    assert "positions, the model has 16 (max_position_embeddings)" in err


def test_help_states_exit_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "2 on bad arguments" in " ".join(capsys.readouterr().out.split())
