"""`kvtier demo` refuses a workload too large for the machine in one line (exit 2), before
drawing it: before, a large --user-tokens failed allocating its token ids with a traceback,
and a large --conversations or --turns ran (allocating a host pool) for hours."""

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
    capsys.readouterr()
    assert main(["demo", *TINY, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    last = err.splitlines()[-1]  # loading a checkpoint may draw a progress bar first
    assert last.startswith("kvtier demo: error: --"), err
    return last


@pytest.mark.parametrize(
    "args",
    [
        ["--user-tokens", str(10**12)],
        ["--system-tokens", str(10**12)],
        ["--new-tokens", str(10**12)],
        ["--user-tokens", str(10**40)],
    ],
)
def test_a_workload_past_the_machines_memory_is_one_line(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(args, capsys)
    assert f"{args[0]} {args[1]}" in err and "more than this machine's" in err, err


@pytest.mark.parametrize("flag", ["--conversations", "--turns"])
def test_many_conversations_or_turns_are_refused_before_any_request(
    flag: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier import demo

    # A machine of 64 MiB: 2,000 conversations or turns of the tiny workload need more.
    monkeypatch.setattr(demo, "physical_memory", lambda: 64 * 2**20)

    def no_request(*args: object, **kwargs: object) -> None:
        raise AssertionError("the workload started before its size was checked")

    monkeypatch.setattr("kvtier.integrations.hf.generator.KVTierGenerator", no_request)
    err = _refused([flag, "2000"], capsys)
    assert f"{flag} 2000" in err and "64.0 MiB of memory" in err, err


def test_the_default_workload_fits_a_small_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier import demo
    from kvtier.integrations.hf.models import make_demo_model

    monkeypatch.setattr(demo, "physical_memory", lambda: 256 * 2**20)
    _, config = make_demo_model("llama", 0)
    demo._check_memory(demo.DemoOptions(), config)  # about 27 MiB of KV


def test_a_hybrid_checkpoint_is_refused_in_one_line_naming_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model with recurrent (here convolution) layers: its KV blocks cannot restore a prefix.
    Before, the demo failed inside the model's first forward pass with a traceback."""
    import torch
    from transformers import Lfm2Config, Lfm2ForCausalLM

    config = Lfm2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, full_attn_idxs=[1],
        max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    lfm2: Any = Lfm2ForCausalLM  # untyped upstream
    lfm2(config).save_pretrained(tmp_path)
    err = _refused(["--model", str(tmp_path)], capsys)
    assert f"--model {tmp_path}: the model's layer 0 (a 'conv' layer" in err, err
