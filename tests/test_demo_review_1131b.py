"""Second look at the 2026-11-28 demo changes: each test failed before its fix.

Before, `kvtier demo` counted every `*.safetensors` file of a checkpoint as its weights (a
Mistral download's `consolidated.safetensors` beside the shards doubled the model, and a model
that fits was refused), and `make_demo_model` refused `head_dim` for Qwen2 although Qwen2's
attention reads it. (A generator whose `close()` a Ctrl-C cut short: test_hf_review_1131.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.demo import DemoOptions, _model_config, _weight_bytes  # noqa: E402
from kvtier.integrations.hf.models import make_demo_model  # noqa: E402

_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 256}


@pytest.fixture(scope="module")
def tiny() -> Any:
    return make_demo_model("llama", 0, **_TINY)[0]


def _float32_bytes(model: Any) -> int:
    return 4 * int(sum(p.numel() for p in model.parameters()))


@pytest.mark.parametrize("shard", ["5GB", "100KB"])
def test_only_the_weight_files_transformers_loads_are_counted(
    tiny: Any, tmp_path: Path, shard: str
) -> None:
    """A Mistral download holds `consolidated.safetensors` (the same weights, for another
    loader) beside `model.safetensors` or its shards; a PEFT run leaves an adapter there."""
    tiny.save_pretrained(tmp_path, max_shard_size=shard)
    first = sorted(tmp_path.glob("model*.safetensors"))[0]
    shutil.copy(first, tmp_path / "consolidated.safetensors")
    shutil.copy(first, tmp_path / "adapter_model.safetensors")
    opts = DemoOptions(model=tmp_path)
    assert _weight_bytes(opts, _model_config(opts)) == _float32_bytes(tiny)


def test_a_bin_checkpoint_is_counted_from_its_index_and_in_float32(
    tiny: Any, tmp_path: Path
) -> None:
    """Shards listed by `pytorch_model.bin.index.json`, stored in bfloat16 as the config says:
    the demo loads them in float32, twice their size (give or take pickle's framing). A
    variant's file beside them was counted too."""
    tiny.config.save_pretrained(tmp_path)
    state = {k: v.to(torch.bfloat16) for k, v in tiny.state_dict().items()}
    names = sorted(state)
    half = len(names) // 2
    weight_map: dict[str, str] = {}
    for i, part in enumerate((names[:half], names[half:])):
        shard = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({k: state[k] for k in part}, tmp_path / shard)
        weight_map.update(dict.fromkeys(part, shard))
    (tmp_path / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    # A variant (`from_pretrained(..., variant="fp16")` loads it; the demo does not).
    torch.save(state, tmp_path / "pytorch_model.fp16.bin")
    config = (tmp_path / "config.json").read_text().replace('"float32"', '"bfloat16"')
    (tmp_path / "config.json").write_text(config)
    opts = DemoOptions(model=tmp_path)
    got = _weight_bytes(opts, _model_config(opts))
    assert _float32_bytes(tiny) <= got < 1.1 * _float32_bytes(tiny)


def test_qwen2_takes_head_dim_which_its_attention_reads() -> None:
    """Qwen2Config defines no `head_dim`, but Qwen2's attention takes `config.head_dim` where
    it is set: refusing it as a misspelling refused a size the model honours."""
    size = {**_TINY, "num_attention_heads": 4, "num_key_value_heads": 2}
    model, config = make_demo_model("qwen2", 0, head_dim=32, **size)
    assert config.head_dim == 32
    assert tuple(model.model.layers[0].self_attn.q_proj.weight.shape) == (4 * 32, 64)
    with pytest.raises(ValueError, match=r"head_dims=32 .* did you mean 'head_dim'"):
        make_demo_model("qwen2", 0, head_dims=32, **size)
