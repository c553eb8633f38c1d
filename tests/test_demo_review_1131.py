"""`kvtier demo` refuses what cannot fit before it builds or loads any model.

Before, the workload's KV was checked only once the model was built (or a checkpoint loaded,
minutes for a large one), a checkpoint's own weights were not counted at all (one too large
for the machine loaded until it swapped or was killed), and a workload longer than a
checkpoint's positions was refused only after loading it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch

from kvtier.cli import main

TINY = ["--conversations", "1", "--turns", "1", "--system-tokens", "16", "--user-tokens", "8",
        "--new-tokens", "2", "--quiet"]  # fmt: skip


@pytest.fixture
def no_model_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the demo model or loading a checkpoint fails the test."""
    from transformers import AutoModelForCausalLM

    def built(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was built before the workload was checked")

    monkeypatch.setattr("kvtier.integrations.hf.models.make_demo_model", built)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", built)


def _refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()  # what setting up wrote (save_pretrained's progress bars)
    assert main(["demo", *TINY, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    last = err.splitlines()[-1]
    assert last.startswith("kvtier demo: error: --"), err
    return last


def _checkpoint(path: Path, dtype: torch.dtype = torch.float32, **fields: Any) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **{"vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 1, "num_attention_heads": 2, **fields}
    )  # fmt: skip
    torch.manual_seed(0)
    llama: Any = LlamaForCausalLM  # untyped upstream
    llama(config).to(dtype).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--user-tokens", 10**12), ("--system-tokens", 10**15), ("--new-tokens", 10**12),
     ("--conversations", 10**9), ("--turns", 10**9)],
)  # fmt: skip
def test_a_workload_past_memory_is_refused_before_the_demo_model_is_built(
    flag: str, value: int, capsys: pytest.CaptureFixture[str], no_model_build: None
) -> None:
    err = _refused([flag, str(value)], capsys)
    assert f"{flag} {value}" in err and "more than this machine's" in err, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_checkpoint_too_large_for_memory_is_refused_before_loading(
    dtype: torch.dtype,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """About 565k parameters: 2.2 MiB in float32 (as the demo loads them, also from a bfloat16
    checkpoint of half that size), on a machine of 1 MiB where the workload's KV fits."""
    ckpt = _checkpoint(tmp_path / "ckpt", dtype)
    from kvtier import demo

    monkeypatch.setattr(demo, "physical_memory", lambda: 2**20)
    from transformers import AutoModelForCausalLM

    def loaded(*args: object, **kwargs: object) -> None:
        raise AssertionError("the checkpoint was loaded before its size was checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", loaded)
    err = _refused(["--model", str(ckpt)], capsys)
    assert f"--model {ckpt}: its weights (2.2 MiB in float32)" in err, err
    assert "more than this machine's 1.0 MiB of memory" in err, err


def test_a_workload_past_a_checkpoints_positions_is_refused_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_model_build: None
) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt", max_position_embeddings=16)
    err = _refused(["--model", str(ckpt)], capsys)
    assert "positions, the model has 16 (max_position_embeddings)" in err, err
