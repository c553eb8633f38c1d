"""KVTierGenerator and its paged cache: a closed generator, token ids past the
model's vocabulary, a model whose KV does not have the shape its config implies, and block
ids given as a tensor that are not integers.
"""

from __future__ import annotations

from typing import Any

import pytest

from helpers import assert_generator_clean

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.integrations.hf.generator import KVTierGenerator  # noqa: E402
from kvtier.integrations.hf.kv_blocks import (  # noqa: E402
    allocate_pages,
    build_cache_from_blocks,
    kv_layout,
)
from kvtier.integrations.hf.models import make_demo_model  # noqa: E402
from kvtier.integrations.hf.paged_cache import PagedKVBuffer, PagedKVLayer  # noqa: E402
from kvtier.integrations.hf.prefix import generate_greedy  # noqa: E402

BS = 16
SMALL = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}


@pytest.fixture(scope="module")
def model() -> Any:
    return make_demo_model("llama", seed=6, **SMALL)[0]


def _ids(n: int, seed: int, vocab: int = 512) -> Any:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_a_closed_generator_refuses_to_generate(model: Any) -> None:
    """After close() the transfer worker is gone: every load and store would fail (each logged
    as an error) and the generator would silently recompute everything. It says so instead."""
    prompt = _ids(40, 1)
    gen = KVTierGenerator(model, block_size=BS, max_blocks=8)
    with gen:
        gen.generate_one(prompt, 2)
    with pytest.raises(RuntimeError, match="closed"):
        gen.generate_one(prompt, 2)
    with pytest.raises(RuntimeError, match="closed"):
        gen.generate([prompt], 2)
    assert gen.stats.requests == 1 and gen.stats.failed_loads == 0
    assert gen.scheduler.num_requests() == 0
    gen.close()  # a second close is harmless
    gen.flush()


def test_token_ids_past_the_vocabulary_are_refused_before_any_work(model: Any) -> None:
    """On CUDA the embedding lookup of such an id is a device-side assert that leaves the
    context unusable; on the CPU an IndexError that names neither the id nor the vocabulary."""
    vocab = model.get_input_embeddings().num_embeddings
    prompt = _ids(40, 2)
    prompt[17] = vocab
    with KVTierGenerator(model, block_size=BS, max_blocks=8) as gen:
        expected = rf"token id {vocab} at position 17 .*expected 0\.\.{vocab - 1}"
        with pytest.raises(IndexError, match=expected):
            gen.generate_one(prompt, 2)
        prompt[17] = -1
        with pytest.raises(IndexError, match=r"token id -1 at position 17 "):
            gen.generate_one(prompt, 2)
        assert gen.stats.requests == 0
        assert_generator_clean(gen)
        good = _ids(40, 3)
        result = gen.generate_one(good, 3)
        assert torch.equal(result.tokens, generate_greedy(model, good.unsqueeze(0), 3).tokens[0])


def test_a_model_failing_in_its_forward_frees_its_blocks_and_request(model: Any) -> None:
    """The model path fails after the prefix loaded (an out-of-memory, say): nothing leaks."""
    prompt = _ids(70, 4)
    with KVTierGenerator(model, block_size=BS, max_blocks=8) as gen:
        gen.generate_one(prompt, 2)
        gen.flush()

        def failing(*args: object, **kwargs: object) -> None:
            raise RuntimeError("out of memory")

        with pytest.raises(RuntimeError, match="out of memory"), pytest.MonkeyPatch.context() as mp:
            mp.setattr(model, "forward", failing)
            gen.generate_one(prompt, 2)
        assert_generator_clean(gen)
        result = gen.generate_one(prompt, 3)
        assert result.hit_tokens == 64
        assert torch.equal(result.tokens, generate_greedy(model, prompt.unsqueeze(0), 3).tokens[0])


def test_kv_of_another_shape_than_the_buffer_is_a_clear_error(model: Any) -> None:
    """`copy_` broadcasts: one KV head written into a buffer laid out for two would be stored
    twice over (host bytes included), silently; a wrong head size failed with a bare torch
    shape error from inside the model."""
    kv = PagedKVBuffer(model.config, 4, BS)  # 2 KV heads of 16
    layer = kv.cache(0, 2, 0).layers[0]
    assert isinstance(layer, PagedKVLayer)
    with pytest.raises(ValueError, match=r"\(1, 1, 3, 16\).*\(1, 2, tokens, 16\)"):
        layer.update(torch.ones(1, 1, 3, 16), torch.ones(1, 1, 3, 16))
    with pytest.raises(ValueError, match=r"\(1, 2, 3, 8\).*\(1, 2, tokens, 16\)"):
        layer.update(torch.ones(1, 2, 3, 16), torch.ones(1, 2, 3, 8))
    assert layer.get_seq_length() == 0 and not kv.tensors[0].any()


def test_falcon_multi_query_gets_one_kv_head() -> None:
    """Falcon-7B's layout (multi_query, the old decoder) caches one KV head for all of its
    query heads; its config has no num_key_value_heads, so the buffer had a head per query
    head (71 times the memory, and as many host bytes per block)."""
    from transformers import AutoModelForCausalLM, FalconConfig

    config = FalconConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        multi_query=True,
        new_decoder_architecture=False,
    )
    assert kv_layout(config).kv_heads == 1
    new = FalconConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_kv_heads=2, new_decoder_architecture=True,
    )  # fmt: skip
    assert kv_layout(new).kv_heads == 4  # the new decoder caches every query head's KV
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        auto: Any = AutoModelForCausalLM  # untyped upstream
        falcon = auto.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():
            for p in falcon.parameters():
                p.normal_(0, 0.05)
    prompt = _ids(70, 5)
    with KVTierGenerator(falcon, block_size=BS, max_blocks=12) as gen:
        assert gen.pages[0].shape == (2, 1, 12, BS, 16)
        for hit in (0, 64):
            result = gen.generate_one(prompt, 4)
            ref = generate_greedy(falcon, prompt.unsqueeze(0), 4)
            assert result.hit_tokens == hit
            assert torch.equal(result.tokens, ref.tokens[0])
            assert (result.logits - ref.logits[0]).abs().max().item() <= 1e-4
            gen.flush()


def test_block_ids_in_a_float_tensor_are_refused(model: Any) -> None:
    """A list of floats is refused; the same ids as a tensor were truncated to other pages."""
    pages = allocate_pages(model.config, 4, BS)
    for ids in (torch.tensor([[0.0, 1.7]]), torch.tensor([[True, False]])):
        with pytest.raises(TypeError, match=r"expected .*int"):
            build_cache_from_blocks(pages, ids, 2 * BS, model.config)
    cache = build_cache_from_blocks(pages, torch.tensor([[2, 3]], dtype=torch.int32), 20)
    assert cache.get_seq_length() == 20


def test_a_model_whose_attention_is_not_causal_is_refused() -> None:
    """A BERT-style model loads as a causal LM without `is_decoder=True`, and attends both
    ways: a block's KV then depends on later tokens, so serving it by prefix is wrong."""
    from transformers import AutoModelForCausalLM, BertConfig

    auto: Any = AutoModelForCausalLM  # untyped upstream

    def bert(is_decoder: bool) -> Any:
        config = BertConfig(
            num_hidden_layers=1,
            hidden_size=32,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=100,
            is_decoder=is_decoder,
        )
        return auto.from_config(config)

    with pytest.raises(ValueError, match=r"attention encoder\.layer\.0\.attention\.self \(Bert"):
        KVTierGenerator(bert(is_decoder=False), block_size=BS, max_blocks=8)
    causal = bert(is_decoder=True)
    KVTierGenerator(causal, block_size=BS, max_blocks=8).close()


@pytest.mark.parametrize("bad", [2.5, True, "4"])
def test_allocate_pages_refuses_counts_that_are_not_ints(model: Any, bad: Any) -> None:
    with pytest.raises(ValueError, match=rf"num_blocks={bad!r} is invalid"):
        allocate_pages(model.config, bad, BS)
    with pytest.raises(ValueError, match=rf"block_size={bad!r} is invalid"):
        allocate_pages(model.config, 2, bad)
