"""HF integration fixes from the 2026-11-29 review: each test failed before its fix."""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import pytest

from helpers import assert_generator_clean, pool_closes, random_ids, tiny_model_size
from kvtier.policies.lru import LRUPolicy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtier.config import KVTierConfig  # noqa: E402
from kvtier.integrations.hf.generator import KVTierGenerator  # noqa: E402
from kvtier.integrations.hf.models import make_demo_model  # noqa: E402
from kvtier.integrations.hf.prefix import generate_greedy  # noqa: E402

BS = 4
VOCAB = 256
_ids = functools.partial(random_ids, vocab=VOCAB)
_SMALL = tiny_model_size(VOCAB)


@pytest.fixture(scope="module")
def model() -> Any:
    return make_demo_model("llama", seed=5, **_SMALL)[0]


def _same_as_recompute(gen: KVTierGenerator, model: Any, prompt: Any) -> bool:
    result = gen.generate_one(prompt, 3)
    return bool(
        torch.equal(result.tokens, generate_greedy(model, prompt.unsqueeze(0), 3).tokens[0])
    )


@pytest.mark.parametrize(
    "config",
    [
        # Mixtral scales its MoE input by uniform noise in training mode (0.0 by default).
        transformers.MixtralConfig(num_local_experts=4, router_jitter_noise=0.1, **_SMALL),
        # PhiMoE's router also samples its experts then (router_jitter_noise=0.01 by default).
        transformers.PhimoeConfig(num_local_experts=4, **_SMALL),
    ],
    ids=lambda c: c.model_type,
)
def test_moe_router_jitter_in_training_mode_is_refused(config: Any) -> None:
    """A model built from a config is in training mode. Before: accepted, though its routers
    jitter at random with no dropout anywhere; on Mixtral the same prompt's logits moved by
    ~8e-3 between two calls, the second loading the first's noisy KV."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert model.training
    prompt = _ids(20, 1)
    with KVTierGenerator(model, block_size=BS, max_blocks=16) as gen:
        with pytest.raises(
            ValueError, match=r"training mode and .*jitter_noise=0\.\d+.*model\.eval"
        ):
            gen.generate_one(prompt, 3)
        assert gen.stats.requests == 0
        assert_generator_clean(gen)
        model.eval()
        assert _same_as_recompute(gen, model, prompt)


def test_gradient_checkpointing_in_training_mode_is_named() -> None:
    """Before: refused only by the model's own forward, as a model that "ignores
    past_key_values" and needs "a model that supports transformers' KV cache": a Llama does;
    its checkpointed layers drop the cache in training mode."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SMALL))
    model.gradient_checkpointing_enable()
    prompt = _ids(20, 2)
    with KVTierGenerator(model, block_size=BS, max_blocks=16) as gen:
        for call in (gen.generate_one, lambda p, n: gen.generate([p], n)):
            with pytest.raises(ValueError, match=r"gradient checkpointing.*expected model\.eval"):
                call(prompt, 3)
        assert gen.stats.requests == 0
        assert_generator_clean(gen)
        model.eval()
        assert _same_as_recompute(gen, model, prompt)


@pytest.mark.parametrize("bad", [None, "meta-llama/Llama-3.2-1B", "config"])
def test_a_model_that_is_not_a_module_is_refused_naming_it(bad: Any) -> None:
    """Before: AttributeError "'str' object has no attribute 'parameters'"."""
    shown = repr(bad)
    if bad == "config":
        bad = transformers.LlamaConfig(**_SMALL)
        shown = "a LlamaConfig"
    with pytest.raises(TypeError, match=r"model is .*expected a transformers causal LM") as err:
        KVTierGenerator(bad)
    assert shown in str(err.value)
    assert "\n" not in str(err.value)


def test_a_model_without_a_language_model_head_is_refused(model: Any) -> None:
    """`AutoModel` instead of `AutoModelForCausalLM`. Before: AttributeError
    "'BaseModelOutputWithPast' object has no attribute 'logits'", in the generator's probe
    and in `generate_greedy`."""
    message = r"LlamaModel returned a BaseModelOutputWithPast without logits.*AutoModelForCausalLM"
    with pytest.raises(ValueError, match=message):
        KVTierGenerator(model.model, block_size=BS, max_blocks=16)
    with pytest.raises(ValueError, match=message):
        generate_greedy(model.model, _ids(5, 3).unsqueeze(0), 2)


def test_prompts_that_are_not_a_list_of_prompts_are_named(model: Any) -> None:
    """Before: `generate(None, n)` raised "'NoneType' object is not iterable", and a
    tokenizer's output (a mapping) ran its keys as prompts: "prompt 'input_ids' is not a
    list or tensor of token ids"."""
    ids = _ids(6, 4).unsqueeze(0)
    encoding = transformers.BatchEncoding(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    )
    with KVTierGenerator(model, block_size=BS, max_blocks=8) as gen:
        for prompts in (None, 5):
            with pytest.raises(TypeError, match=rf"prompts is {prompts} .*expected a list of"):
                gen.generate(prompts, 2)  # type: ignore[arg-type]
        hint = r"expected a list of prompts .*pass its \['input_ids'\]"
        with pytest.raises(TypeError, match=rf"prompts is .*BatchEncoding.*{hint}"):
            gen.generate(encoding, 2)
        with pytest.raises(TypeError, match=r"not a list or tensor .*pass its \['input_ids'\]"):
            gen.generate_one(encoding, 2)
        assert gen.stats.requests == 0
        assert_generator_clean(gen)
        assert gen.generate_one(encoding["input_ids"], 2).tokens.shape == (2,)


def test_a_logit_scale_that_is_not_a_positive_finite_number_is_refused() -> None:
    """Before: True ran as 1.0, "4" failed on a bare comparison error, and inf built a model
    whose logits are all inf or NaN."""
    bad: tuple[Any, ...] = (True, "4", math.inf)
    for scale in bad:
        with pytest.raises(ValueError, match=rf"logit_scale={scale!r} is invalid; expected a "):
            make_demo_model("llama", logit_scale=scale, **_SMALL)
    numpy_scale: Any = np.float32(2.0)  # a real number too
    model, _ = make_demo_model("llama", logit_scale=numpy_scale, **_SMALL)
    assert bool(model(torch.tensor([[1, 2, 3]])).logits.isfinite().all())


class RefusingPolicy(LRUPolicy):
    """A cache policy plugin whose constructor raises (a setting it lacks, say)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("RefusingPolicy needs a setting")


def test_a_cache_policy_failing_as_it_is_built_closes_the_host_pool(model: Any) -> None:
    """Before: the host pool, allocated (and pinned, on a GPU machine) just before the
    manager, stayed so until the collector freed it, which a notebook's kept traceback
    delays for good; only a failing transfer worker closed it."""
    config = KVTierConfig(cache_policy=f"{__name__}:RefusingPolicy")
    with pool_closes() as closed, pytest.raises(RuntimeError, match="needs a setting"):
        KVTierGenerator(model, config, block_size=BS, max_blocks=8)
    assert len(closed) == 1


@pytest.mark.parametrize(("encoder_heads", "decoder_heads"), [(2, 4), (4, 2)])
def test_whisper_decoder_with_other_heads_than_its_encoder_gets_the_decoders(
    encoder_heads: int, decoder_heads: int
) -> None:
    """`WhisperForCausalLM` (a speculative-decoding assistant) run alone. Its config's
    `num_key_value_heads` maps to `encoder_attention_heads`: the buffer took the encoder's KV
    head count and the model was refused as writing KV of another shape."""
    sizes = {"vocab_size": 128, "d_model": 64, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128}
    sizes |= {"encoder_layers": 2, "decoder_layers": 2, "max_target_positions": 64}
    tokens = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1}
    config = transformers.WhisperConfig(
        encoder_attention_heads=encoder_heads,
        decoder_attention_heads=decoder_heads,
        **sizes,
        **tokens,
    )
    torch.manual_seed(0)
    whisper = transformers.WhisperForCausalLM(config).eval()
    prompt = random_ids(22, 6, vocab=128)
    with KVTierGenerator(whisper, block_size=BS, max_blocks=16) as gen:
        assert gen.kv.layout.kv_heads == decoder_heads
        gen.generate_one(prompt, 3)
        gen.flush()
        result = gen.generate_one(prompt, 3)
    ref = generate_greedy(whisper, prompt.unsqueeze(0), 3)
    assert result.hit_tokens == 20
    assert torch.equal(result.tokens, ref.tokens[0])
    assert (result.logits - ref.logits[0]).abs().max() < 1e-4


def test_a_model_converted_after_the_generator_was_built_is_named() -> None:
    """`model.double()` after the generator was built: its KV no longer fits the buffer and pool
    sized for float32. The error named a buffer the user never built; it now says what changed
    and what to do, before any work, and converted back the model runs again."""
    model = make_demo_model("llama", seed=5, **_SMALL)[0]
    prompt = _ids(20, 1)
    with KVTierGenerator(model, block_size=BS, max_blocks=16) as gen:
        assert _same_as_recompute(gen, model, prompt)
        model.double()
        with pytest.raises(
            ValueError, match=r"now runs in torch.float64 on cpu.*hold torch.float32"
        ):
            gen.generate_one(prompt, 3)
        assert_generator_clean(gen)
        model.float()
        assert _same_as_recompute(gen, model, prompt)
        assert_generator_clean(gen)
