"""`kvtier demo` counts a checkpoint's weights before loading it: a tied `lm_head` stored beside
its embedding is one matrix once loaded, and counting it twice refused a model that fits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from kvtier.demo import DemoOptions, _model_config, _weight_bytes  # noqa: E402
from kvtier.integrations.hf.models import make_demo_model  # noqa: E402

_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 512}


def _save_with_head(model: Any, path: Path) -> None:
    """Every parameter, the head stored as its own tensor (as some exporters write it)."""
    model.config.save_pretrained(path)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = model.get_input_embeddings().weight.detach().clone()
    safetensors_torch.save_file(state, str(path / "model.safetensors"))


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_head_stored_twice_is_counted_once(tmp_path: Path, tied: bool) -> None:
    model, _ = make_demo_model("llama", 0, tie_word_embeddings=tied, **_TINY)
    _save_with_head(model, tmp_path)
    opts = DemoOptions(model=tmp_path)
    # parameters() yields a tied matrix once: what loading the checkpoint takes.
    expected = 4 * sum(p.numel() for p in model.parameters())
    assert _weight_bytes(opts, _model_config(opts)) == expected
    if tied:  # and the figure is what loading the file really keeps
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
        assert 4 * sum(p.numel() for p in loaded.parameters()) == expected
