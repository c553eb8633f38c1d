"""Models `KVTierGenerator` refuses, or accepts, when it is built: the probes of behaviour the
config cannot tell (causality, writing the cache) and the config checks (recurrent models,
layers of different head sizes).

Each refused model here used to build: OpenAI-GPT and XLNet decoded without context (they
ignore `past_key_values`), BERT-style heads left bidirectional were served KV computed with
other tokens after it, RecurrentGemma stored nothing, and RWKV, xLSTM and Gemma 4 failed with
transformers' own errors. Decoders with an (unused) cross-attention, refused before, work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.cache_utils import DynamicCache  # noqa: E402

from kvtier.config import KVTierConfig  # noqa: E402
from kvtier.integrations.hf.generator import KVTierGenerator  # noqa: E402
from kvtier.integrations.hf.models import make_demo_model  # noqa: E402
from kvtier.integrations.hf.prefix import generate_greedy  # noqa: E402

T = transformers
V = 128
# The tiny sizes every architecture here is built with (an encoder-decoder's in SEQ2SEQ).
TINY = {
    "vocab_size": V,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
}
SEQ2SEQ = {
    "vocab_size": V,
    "d_model": 32,
    "decoder_layers": 2,
    "encoder_layers": 2,
    "decoder_attention_heads": 2,
    "encoder_attention_heads": 2,
    "decoder_ffn_dim": 64,
    "encoder_ffn_dim": 64,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "decoder_start_token_id": 0,
}


def _build(config: Any, cls: Any, std: float = 0.05) -> Any:
    """A seeded random-weight model in eval mode; weights N(0, std^2) so greedy tokens depend
    on the context (transformers' 0.02 init gives nearly flat logits)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(config)
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim >= 2:
                    p.normal_(0, std)
    return model.eval()


def _gen(model: Any) -> KVTierGenerator:
    return KVTierGenerator(model, KVTierConfig(num_slots=16), block_size=8, max_blocks=8)


def _ids(n: int, seed: int) -> Any:
    return torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(seed))


# -- models that ignore past_key_values -----------------------------------------------------


def _openai_gpt() -> Any:
    config = T.OpenAIGPTConfig(vocab_size=V, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    return _build(config, T.OpenAIGPTLMHeadModel)


def test_a_model_that_ignores_its_cache_is_refused_when_built() -> None:
    with pytest.raises(ValueError, match=r"^OpenAIGPTLMHeadModel did not write the KV of 2 "):
        _gen(_openai_gpt())


def test_generate_greedy_refuses_a_model_that_ignores_its_cache() -> None:
    """The recompute path decoded each new token without its context, silently."""
    with pytest.raises(ValueError, match=r"ignores past_key_values"):
        generate_greedy(_openai_gpt(), _ids(12, 1).unsqueeze(0), 3)


def test_a_model_that_stops_writing_its_cache_stores_nothing() -> None:
    """The guard on every forward: a model that writes its KV elsewhere after the generator
    was built fails the request before any of its blocks is offered to kvtier."""
    model = make_demo_model(
        "llama", seed=2, vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2
    )[0]
    with _gen(model) as gen:
        forward = model.forward
        model.forward = lambda *a, **kw: forward(*a, **{**kw, "past_key_values": DynamicCache()})
        with pytest.raises(ValueError, match=r"LlamaForCausalLM did not write the KV"):
            gen.generate_one(_ids(40, 2), 4)
        gen.flush()
        assert gen.stats.bytes_stored == 0 and gen.stats.requests == 0
        del model.forward
        first = gen.generate_one(_ids(40, 2), 4)
        assert first.hit_tokens == 0  # nothing of the failed run was stored
        gen.flush()
        assert gen.generate_one(_ids(40, 2), 4).hit_tokens > 0  # stored by the sound run


# -- causality ----------------------------------------------------------------------------

NON_CAUSAL: dict[str, Callable[[], Any]] = {
    "roformer": lambda: _build(T.RoFormerConfig(**TINY, embedding_size=32), T.RoFormerForCausalLM),
    "rembert": lambda: _build(
        T.RemBertConfig(**TINY, input_embedding_size=32, output_embedding_size=32),
        T.RemBertForCausalLM,
    ),
    "megatron-bert": lambda: _build(T.MegatronBertConfig(**TINY), T.MegatronBertForCausalLM),
    "big_bird": lambda: _build(
        T.BigBirdConfig(**TINY, attention_type="original_full"), T.BigBirdForCausalLM
    ),
    "xlm-causal-false": lambda: _build(
        T.XLMConfig(vocab_size=V, emb_dim=32, n_layers=2, n_heads=2, causal=False),
        T.XLMWithLMHeadModel,
    ),
}


@pytest.mark.parametrize("name", list(NON_CAUSAL))
def test_a_bidirectional_head_is_refused_when_built(name: str) -> None:
    """None of these marks its attention is_causal=False: only running it tells."""
    model = NON_CAUSAL[name]()
    with pytest.raises(ValueError, match=rf"^{type(model).__name__} is not causal: changing"):
        _gen(model)


def test_the_marked_attention_is_named_in_the_refusal() -> None:
    config = T.BertConfig(**TINY, is_decoder=False)
    with pytest.raises(ValueError, match=r"attention encoder\.layer\.0\.attention\.self \(Bert"):
        _gen(_build(config, T.BertLMHeadModel))


CROSS_ATTENTION_DECODERS = {
    "bart": (T.BartConfig, T.BartForCausalLM),
    "mbart": (T.MBartConfig, T.MBartForCausalLM),
    "pegasus": (T.PegasusConfig, T.PegasusForCausalLM),
    "bigbird_pegasus": (T.BigBirdPegasusConfig, T.BigBirdPegasusForCausalLM),
    "marian": (T.MarianConfig, T.MarianForCausalLM),
    "blenderbot": (T.BlenderbotConfig, T.BlenderbotForCausalLM),
}


@pytest.mark.parametrize("name", list(CROSS_ATTENTION_DECODERS))
def test_a_decoder_with_cross_attention_reuses_its_prefix_exactly(name: str) -> None:
    """Their cross-attention (never run without an encoder) is marked is_causal=False, and
    BigBirdPegasus's self-attention too; all were refused as not causal, and are causal."""
    config_cls, model_cls = CROSS_ATTENTION_DECODERS[name]
    extra = {"attention_type": "original_full"} if name == "bigbird_pegasus" else {}
    model = _build(config_cls(**SEQ2SEQ, **extra), model_cls)
    prefix = _ids(24, 3)
    second = torch.cat([prefix, _ids(5, 4)])
    with _gen(model) as gen:
        gen.generate_one(torch.cat([prefix, _ids(9, 5)]), 4)
        gen.flush()
        got = gen.generate_one(second, 4)
    ref = generate_greedy(model, second.unsqueeze(0), 4)
    assert got.hit_tokens == 24
    assert torch.equal(got.tokens, ref.tokens[0])
    assert (got.logits - ref.logits[0]).abs().max() < 1e-4


@pytest.mark.parametrize("model_cls", [T.BartForCausalLM, T.BlenderbotForCausalLM])
def test_a_decoder_sized_unlike_its_encoder_gets_the_decoders_layout(model_cls: Any) -> None:
    """Its config's num_hidden_layers and num_attention_heads read the encoder's fields: the
    buffer had the encoder's layers and heads, and generate_greedy's recompute cache too few
    layers (IndexError inside transformers)."""
    sizes = {**SEQ2SEQ, "encoder_layers": 1, "encoder_attention_heads": 4}
    config_cls = T.BartConfig if model_cls is T.BartForCausalLM else T.BlenderbotConfig
    model = _build(config_cls(**sizes), model_cls)
    prompt = _ids(27, 6)
    ref = generate_greedy(model, prompt.unsqueeze(0), 3)
    with _gen(model) as gen:
        assert (gen.kv.layout.num_layers, gen.kv.layout.kv_heads) == (2, 2)
        gen.generate_one(prompt, 3)
        gen.flush()
        got = gen.generate_one(prompt, 3)
    assert got.hit_tokens == 24 and torch.equal(got.tokens, ref.tokens[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_causal_models_pass_the_probe_in_every_dtype(dtype: Any) -> None:
    """Including an MoE, whose expert matmuls change shape with the changed token's route."""
    from kvtier.integrations.hf.prefix import check_causal

    for arch in ("llama", "qwen2", "mistral"):
        model = make_demo_model(
            arch, seed=1, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2
        )[0]
        check_causal(model.to(dtype))
    mixtral = T.MixtralConfig(
        **TINY, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2
    )
    check_causal(_build(mixtral, T.MixtralForCausalLM).to(dtype))


def test_the_tolerance_follows_the_dtype() -> None:
    from kvtier.integrations.hf.prefix import causality_tolerance

    assert causality_tolerance(torch.float32) == 1e-4
    assert causality_tolerance(torch.float16) == 32 * 2**-10
    assert causality_tolerance(torch.bfloat16) == 32 * 2**-7


def test_the_probes_leave_the_model_rng_and_buffer_as_they_were() -> None:
    model = make_demo_model(
        "llama", seed=3, vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2
    )[0]
    model.train()
    model.model.layers[0].eval()  # a mix of flags, each kept
    flags = [m.training for m in model.modules()]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    with _gen(model) as gen:
        assert all(int(t.count_nonzero()) == 0 for t in gen.pages)
    assert [m.training for m in model.modules()] == flags
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert torch.is_grad_enabled()


# -- refused by their config ----------------------------------------------------------------


def _gemma4(global_head_dim: int) -> Any:
    config = T.Gemma4TextConfig(
        **TINY,
        num_key_value_heads=1,
        head_dim=16,
        global_head_dim=global_head_dim,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256,
    )
    return _build(config, T.Gemma4ForCausalLM)


def test_gemma4_with_a_global_head_dim_is_refused_by_kvtier() -> None:
    with pytest.raises(ValueError, match=r"^Gemma4TextConfig gives its layers different head_dim"):
        _gen(_gemma4(32))


RECURRENT: dict[str, Callable[[], Any]] = {
    "rwkv": lambda: _build(
        T.RwkvConfig(
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=2,
            attention_hidden_size=32,
            intermediate_size=64,
        ),
        T.RwkvForCausalLM,
    ),
    "xlstm": lambda: _build(
        T.xLSTMConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_heads=2),
        T.xLSTMForCausalLM,
    ),
    "recurrent_gemma": lambda: _build(
        T.RecurrentGemmaConfig(
            **TINY,
            num_key_value_heads=1,
            lru_width=32,
            attention_window_size=16,
            block_types=["recurrent", "attention"],
        ),
        T.RecurrentGemmaForCausalLM,
    ),
}


@pytest.mark.parametrize("name", list(RECURRENT))
def test_a_recurrent_model_is_refused_when_built(name: str) -> None:
    with pytest.raises(ValueError, match=r"Config describes a model with .*no plain per-token KV"):
        _gen(RECURRENT[name]())


def test_latent_attention_is_refused_when_built() -> None:
    """DeepSeek's latent attention caches K and V of other head sizes than the config's
    head_dim: the write probe meets it at construction, not at the first prompt."""
    config = T.DeepseekV3Config(
        **{**TINY, "num_hidden_layers": 1},
        moe_intermediate_size=16,
        num_key_value_heads=2,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=2,
        num_experts_per_tok=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        max_position_embeddings=256,
    )
    with pytest.raises(ValueError, match=r"^DeepseekV3ForCausalLM: cannot cache K "):
        _gen(_build(config, T.DeepseekV3ForCausalLM))
