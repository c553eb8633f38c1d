"""KVTierGenerator and generate_greedy with position limits and prompt lists.

A learned position embedding (GPT-2, OPT) has rows for `max_position_embeddings` positions
only; a position past them is refused before any work, not a bare IndexError inside the model
(on CUDA a device-side assert). RoPE that changes its frequencies with the sequence length
("dynamic", "longrope") makes KV depend on more than its prefix, so a request past the switch
is refused; below it, reuse matches recompute. A bare token id is not a prompt: generate([5,
7]) used to run each id as a one-token prompt.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from helpers import assert_generator_clean, random_ids

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtier.config import KVTierConfig  # noqa: E402
from kvtier.integrations.hf.generator import KVTierGenerator  # noqa: E402
from kvtier.integrations.hf.models import make_demo_model  # noqa: E402
from kvtier.integrations.hf.prefix import generate_greedy  # noqa: E402

BS = 8
VOCAB = 128


_ids = functools.partial(random_ids, vocab=VOCAB)


def _random_weights(model: Any) -> Any:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0, 0.05)
    return model.eval()


def _gpt2(positions: int) -> Any:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=positions,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return _random_weights(transformers.GPT2LMHeadModel(config))


def _opt(positions: int) -> Any:
    config = transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=positions, word_embed_proj_dim=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=1,
    )  # fmt: skip
    return _random_weights(transformers.OPTForCausalLM(config))


def _dynamic_llama(max_positions: int) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )  # fmt: skip
    return _random_weights(transformers.LlamaForCausalLM(config))


def _longrope_phi3(original_positions: int) -> Any:
    half = 8  # head_dim 16
    config = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        original_max_position_embeddings=original_positions, pad_token_id=0, bos_token_id=0,
        eos_token_id=0,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0] * half, "long_factor": [4.0] * half,
        },
    )  # fmt: skip
    return _random_weights(transformers.Phi3ForCausalLM(config))


@pytest.mark.parametrize("build", [_gpt2, _opt], ids=["gpt2", "opt"])
def test_positions_past_a_learned_position_embedding_are_refused_before_any_work(
    build: Any,
) -> None:
    model = build(48)
    prompt = _ids(41, 1)  # 41 + 8 new runs positions 0..47: exactly the 48 rows
    with KVTierGenerator(model, block_size=BS, max_blocks=16) as gen:
        first = gen.generate_one(prompt, 8)
        assert torch.equal(first.tokens, generate_greedy(model, prompt.unsqueeze(0), 8).tokens[0])
        gen.flush()
        stats = repr(gen.stats)
        with pytest.raises(ValueError, match=r"positions up to 48.*has 48"):
            gen.generate_one(prompt, 9)
        with pytest.raises(ValueError, match=r"positions up to 49.*has 48"):
            gen.generate_one(torch.cat([prompt, _ids(9, 2)]), 1)
        assert repr(gen.stats) == stats  # nothing ran
        assert_generator_clean(gen)
        again = gen.generate_one(prompt, 8)  # still works, and reuses the stored prefix
        assert again.hit_tokens == 40 and torch.equal(again.tokens, first.tokens)
    with pytest.raises(ValueError, match=r"positions up to 48.*has 48"):
        generate_greedy(model, prompt.unsqueeze(0), 9)  # the recompute path says so too


@pytest.mark.parametrize(
    ("build", "rope_type"), [(_dynamic_llama, "dynamic"), (_longrope_phi3, "longrope")]
)
def test_rope_past_its_switch_is_refused_and_below_it_matches_recompute(
    build: Any, rope_type: str
) -> None:
    model = build(40)
    base = _ids(24, 3)
    longer = torch.cat([base, _ids(10, 4)])  # 34 + 7 new: positions up to 39, the last plain
    with KVTierGenerator(model, block_size=BS, max_blocks=16) as gen:
        gen.generate_one(base, 4)
        gen.flush()
        result = gen.generate_one(longer, 7)
        ref = generate_greedy(model, longer.unsqueeze(0), 7)
        assert result.hit_tokens == 24
        assert torch.equal(result.tokens, ref.tokens[0])
        assert (result.logits - ref.logits[0]).abs().max() <= 1e-4
        # One more position rescales every K of the pass: the stored blocks of `base` are not
        # what recompute of this prompt computes.
        with pytest.raises(ValueError, match=rf"positions up to 40, past the 40 .*'{rope_type}'"):
            gen.generate_one(longer, 8)
        assert gen.stats.requests == 2
        assert_generator_clean(gen)


def test_a_flat_list_of_ids_is_not_a_list_of_prompts() -> None:
    model = make_demo_model("llama", seed=2, vocab_size=VOCAB, num_hidden_layers=1)[0]
    with KVTierGenerator(model, block_size=BS, max_blocks=8) as gen:
        with pytest.raises(ValueError, match=r"prompts\[0\]: prompt is the single token id 5"):
            gen.generate([5, 7], 2)  # type: ignore[list-item]
        with pytest.raises(ValueError, match=r"prompts is a tensor of shape \(2,\)"):
            gen.generate(torch.tensor([5, 7]), 2)
        with pytest.raises(ValueError, match=r"single token id tensor\(7\)"):
            gen.generate_one(torch.tensor(7), 2)
        # A bad prompt late in the list is refused before the first one runs.
        with pytest.raises(IndexError, match=r"prompts\[1\]: token id 999 at position 1"):
            gen.generate([_ids(20, 5), [3, 999]], 2)
        assert gen.stats.requests == 0
        assert_generator_clean(gen)
        # An iterator of prompts is checked and run, not used up by the check.
        results = gen.generate(iter([_ids(20, 5), _ids(9, 6)]), 2)
        assert [r.prefill_tokens for r in results] == [20, 9]
        rows = gen.generate(torch.stack([_ids(20, 5), _ids(20, 5)]), 2)
        assert [r.hit_tokens for r in rows] == [16, 16]


def test_offload_of_replies_with_a_learned_position_embedding() -> None:
    """Multi-turn on GPT-2 up to its last position: the next turn loads the earlier reply."""
    model = _gpt2(64)
    prompt = _ids(21, 7)
    config = KVTierConfig(offload_prompt_only=False)
    with KVTierGenerator(model, config, block_size=BS, max_blocks=16) as gen:
        first = gen.generate_one(prompt, 12)  # holds 32 tokens: 4 blocks
        gen.flush()
        turn = torch.cat([prompt, first.tokens, _ids(3, 8)])  # 36 tokens
        second = gen.generate_one(turn, 29)  # positions up to 63
        ref = generate_greedy(model, turn.unsqueeze(0), 29)
        assert second.hit_tokens == 32
        assert torch.equal(second.tokens, ref.tokens[0])
        assert (second.logits - ref.logits[0]).abs().max() <= 1e-4
