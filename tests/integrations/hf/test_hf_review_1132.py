"""HF integration fixes from a review on 2026-11-28: each test failed before its fix.

Before, a plain torch module failed on a bare AttributeError (no `config`) or StopIteration
(no parameters), and an encoder-decoder model (T5, `BartForConditionalGeneration`) was not
refused by name: T5 failed while the generator was built on transformers' bare "You must
specify exactly one of input_ids or inputs_embeds", and Bart was called "not causal", with a
hint (`is_decoder=True`) that does not apply to it. Switching on an MoE model's router logits
(an output switch) was taken for a change of its KV, and `allocate_pages` built integer pages
(refused only by a later copy) or failed on torch's bare message for a dtype string."""

from __future__ import annotations

from typing import Any

import pytest

from helpers import tiny_model_size

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtier.integrations.hf.generator import KVTierGenerator  # noqa: E402
from kvtier.integrations.hf.kv_blocks import allocate_pages  # noqa: E402
from kvtier.integrations.hf.prefix import generate_greedy  # noqa: E402

VOCAB = 256


def _llama_config() -> Any:
    return transformers.LlamaConfig(**tiny_model_size(VOCAB))


def _t5() -> Any:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4
    )
    return transformers.T5ForConditionalGeneration(config).eval()


def _bart() -> Any:
    config = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
    )
    return transformers.BartForConditionalGeneration(config).eval()


@pytest.mark.parametrize("build", [_t5, _bart], ids=["t5", "bart"])
def test_an_encoder_decoder_model_is_refused_by_name(build: Any) -> None:
    model = build()
    name = type(model).__name__
    expected = rf"{name} is an encoder-decoder model .*expected a decoder-only causal LM"
    with pytest.raises(ValueError, match=expected):
        KVTierGenerator(model, block_size=8, max_blocks=8)
    with pytest.raises(ValueError, match=expected):
        generate_greedy(model, torch.tensor([[5, 6, 7, 8]]), 2)


def test_a_plain_torch_module_is_refused_clearly() -> None:
    # Before: AttributeError "'Linear' object has no attribute 'config'".
    with pytest.raises(TypeError, match="model is a Linear without a config: it is not a"):
        KVTierGenerator(torch.nn.Linear(2, 2), block_size=8, max_blocks=8)


def test_a_module_without_parameters_is_refused_clearly() -> None:
    # Before: a bare StopIteration, from looking up the first parameter's device.
    config = _llama_config()
    weightless = torch.nn.Module()
    weightless.config = config
    with pytest.raises(ValueError, match="model is a Module without parameters"):
        KVTierGenerator(weightless, block_size=8, max_blocks=8)


def test_switching_on_router_logits_is_no_config_change() -> None:
    """An MoE model's `output_router_logits` is an output switch, like `output_attentions`:
    it changes what the forward returns, not the KV. Before, the next prompt was refused with
    "the model's config changed since this generator was built (output_router_logits False
    -> True)"."""
    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=2,
        num_experts_per_tok=1,
    )
    model = transformers.MixtralForCausalLM(config).eval()
    prompt = torch.arange(10, 30)
    with KVTierGenerator(model, block_size=8, max_blocks=8) as gen:
        first = gen.generate_one(prompt, 3)
        model.config.output_router_logits = True
        again = gen.generate_one(prompt, 3)
    assert again.hit_tokens == 16  # the stored prefix still serves
    assert torch.equal(again.tokens, first.tokens)
    assert float((again.logits - first.logits).abs().max()) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, "float16"])
def test_allocate_pages_refuses_a_dtype_kv_cannot_have(dtype: Any) -> None:
    config = _llama_config()
    with pytest.raises(TypeError, match=r"dtype=.* is invalid; expected a floating-point"):
        allocate_pages(config, 4, 8, dtype=dtype)
