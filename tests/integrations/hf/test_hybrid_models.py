"""Hybrid models (attention next to recurrent, convolution or linear-attention layers) are
refused when the generator or a paged buffer is built, not mid-generation.

Such a layer carries a state that sums up the whole prefix; a set of per-token KV blocks
cannot restore it. Before, `KVTierGenerator` built fine and the first `generate_one` failed
inside the model's forward with transformers' "has_previous_state ... is an Attention layer".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtier.config import KVTierConfig  # noqa: E402
from kvtier.integrations.hf.generator import KVTierGenerator  # noqa: E402
from kvtier.integrations.hf.kv_blocks import allocate_pages, kv_layout  # noqa: E402
from kvtier.integrations.hf.paged_cache import PagedKVBuffer  # noqa: E402

SMALL = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "max_position_embeddings": 256}  # fmt: skip


def _lfm2_conv() -> Any:
    # LFM2: short-convolution layers at 0 and 2, attention at 1 and 3.
    return transformers.Lfm2Config(**SMALL, num_key_value_heads=2, full_attn_idxs=[1, 3])


def _jamba() -> Any:
    return transformers.JambaConfig(
        **SMALL, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=100, num_experts=1,
    )  # fmt: skip


def _qwen3_next() -> Any:
    return transformers.Qwen3NextConfig(
        **SMALL, num_key_value_heads=2, head_dim=16, num_experts=2, num_experts_per_tok=1,
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16,
    )  # fmt: skip


HYBRIDS: dict[str, tuple[Callable[[], Any], Any, str]] = {
    "lfm2-conv": (_lfm2_conv, transformers.Lfm2ForCausalLM, "'conv'"),
    "jamba": (_jamba, transformers.JambaForCausalLM, "'linear_attention'"),
    "qwen3-next": (_qwen3_next, transformers.Qwen3NextForCausalLM, "'linear_attention'"),
}


def _model(name: str) -> Any:
    make_config, model_cls, _ = HYBRIDS[name]
    torch.manual_seed(0)
    return model_cls(make_config()).eval()


@pytest.mark.parametrize("name", list(HYBRIDS))
def test_generator_refuses_a_hybrid_model_when_built(name: str) -> None:
    model = _model(name)
    with pytest.raises(ValueError, match="per-token KV") as info:
        KVTierGenerator(model, KVTierConfig(num_slots=8), block_size=16, max_blocks=4)
    message = str(info.value)
    assert "layer 0" in message and HYBRIDS[name][2] in message, message


@pytest.mark.parametrize("name", list(HYBRIDS))
def test_paged_buffers_refuse_a_hybrid_config(name: str) -> None:
    config = HYBRIDS[name][0]()
    for build in (
        lambda: kv_layout(config),
        lambda: PagedKVBuffer(config, 4, 16),
        lambda: allocate_pages(config, 4, 16),
    ):
        with pytest.raises(ValueError, match="per-token KV"):
            build()


def test_an_all_attention_lfm2_still_reuses_its_prefix() -> None:
    """The check reads the layer types: LFM2 with attention in every layer is a plain LM."""
    from kvtier.integrations.hf.prefix import generate_greedy

    config = transformers.Lfm2Config(**SMALL, num_key_value_heads=2, full_attn_idxs=[0, 1, 2, 3])
    torch.manual_seed(0)
    model = transformers.Lfm2ForCausalLM(config).eval()
    prompt = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(0))
    with KVTierGenerator(model, KVTierConfig(num_slots=16), block_size=16, max_blocks=8) as gen:
        gen.generate_one(prompt, 4)
        gen.flush()
        again = gen.generate_one(torch.cat([prompt, torch.tensor([3, 4])]), 4)
    assert again.hit_tokens == 32
    ref = generate_greedy(model, torch.cat([prompt, torch.tensor([3, 4])]).unsqueeze(0), 4)
    assert torch.equal(again.tokens, ref.tokens[0])
    assert (again.logits - ref.logits[0]).abs().max() <= 1e-4
