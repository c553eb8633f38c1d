"""Block copies for caches whose shape is not the model config's plain one
(integrations.hf.kv_blocks): a decoder sized unlike its encoder, and V unlike K."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.cache_utils import DynamicCache  # noqa: E402

from kvtier.integrations.hf.kv_blocks import (  # noqa: E402
    allocate_pages,
    build_cache_from_blocks,
    extract_blocks,
)
from kvtier.integrations.hf.prefix import generate_greedy  # noqa: E402

V = 128
BS = 4


def _blenderbot(decoder_layers: int, encoder_layers: int) -> Any:
    config = transformers.BlenderbotConfig(
        vocab_size=V,
        d_model=32,
        decoder_layers=decoder_layers,
        encoder_layers=encoder_layers,
        decoder_attention_heads=2,
        encoder_attention_heads=4,
        decoder_ffn_dim=64,
        encoder_ffn_dim=64,
        max_position_embeddings=256,
        pad_token_id=0,
        decoder_start_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.BlenderbotForCausalLM(config)
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim >= 2:
                    p.normal_(0, 0.05)
    return model.eval()


@pytest.mark.parametrize(("decoder_layers", "encoder_layers"), [(4, 2), (2, 4)])
def test_build_with_the_config_of_a_decoder_sized_unlike_its_encoder(
    decoder_layers: int, encoder_layers: int
) -> None:
    """The config's num_hidden_layers names the encoder's: a cache built from it had 2 layers
    for a 4-layer decoder (IndexError while loading) or 4 for a 2-layer one (the generation
    ran, then `extract_blocks` refused its cache for the page count)."""
    model = _blenderbot(decoder_layers, encoder_layers)
    ids = torch.randint(3, V, (1, 20), generator=torch.Generator().manual_seed(0))
    pages = allocate_pages(model.config, 8, BS)
    assert len(pages) == decoder_layers
    first = generate_greedy(model, ids[:, :16], 1)
    extract_blocks(first.cache, 0, 0, 4, BS, pages, [0, 1, 2, 3])

    cache = build_cache_from_blocks(pages, [[0, 1, 2, 3]], 16, model.config)
    out = generate_greedy(model, ids, 4, cache=cache)
    ref = generate_greedy(model, ids, 4)
    assert out.prefill_tokens == 4
    assert torch.equal(out.tokens, ref.tokens)
    assert (out.logits - ref.logits).abs().max() <= 1e-4
    extract_blocks(out.cache, 0, 16, 1, BS, pages, [4])  # the new block goes back to pages

    empty = build_cache_from_blocks(pages, [[0]], 0, model.config)
    assert torch.equal(generate_greedy(model, ids, 4, cache=empty).tokens, ref.tokens)


@pytest.mark.parametrize(
    ("v_head_dim", "v_dtype"), [(4, torch.float32), (8, torch.float64)], ids=["size", "dtype"]
)
def test_v_unlike_k_is_refused_before_any_page_is_written(v_head_dim: int, v_dtype: Any) -> None:
    """Latent attention caches V of another head size than K. Only K was checked: K of
    layer 0 was written, then the copy failed with torch's bare index_copy_ error (or cast
    V of another dtype silently)."""
    cache = DynamicCache()
    for layer in range(2):
        cache.update(torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, v_head_dim).to(v_dtype), layer)
    pages = [torch.zeros(4, 2, BS, 2, 8) for _ in range(2)]
    with pytest.raises(
        ValueError, match=r"cache layer 0 holds K \(1, 2, 8, 8\) torch\.float32 but V"
    ):
        extract_blocks(cache, 0, 0, 2, BS, pages, [0, 1])
    assert all(int(p.count_nonzero()) == 0 for p in pages)
