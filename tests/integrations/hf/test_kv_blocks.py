"""Cache <-> paged block copies are exact and refuse bad input (integrations.hf.kv_blocks)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.cache_utils import CacheLayerMixin, StaticCache  # noqa: E402

from kvtier.integrations.hf.kv_blocks import (  # noqa: E402
    allocate_pages,
    build_cache_from_blocks,
    extract_blocks,
    kv_layout,
)
from kvtier.integrations.hf.models import make_demo_model  # noqa: E402
from kvtier.integrations.hf.prefix import prefill  # noqa: E402

BS = 8


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def model(request: pytest.FixtureRequest) -> Any:
    # Tiny: these tests check copies, not numerics.
    return make_demo_model(str(request.param), seed=1, hidden_size=64, num_hidden_layers=2)[0]


def _cache(model: Any, batch: int, tokens: int, seed: int = 0) -> Any:
    ids = torch.randint(0, 2048, (batch, tokens), generator=torch.Generator().manual_seed(seed))
    return prefill(model, ids)[1]


def test_layout_and_page_shape(model: Any) -> None:
    layout = kv_layout(model.config)
    assert (layout.num_layers, layout.kv_heads, layout.head_dim) == (2, 2, 16)
    pages = allocate_pages(model.config, 5, BS)
    assert [p.shape for p in pages] == [(5, 2, BS, 2, 16)] * 2


def test_extract_then_build_is_bit_identical(model: Any) -> None:
    src = _cache(model, batch=2, tokens=40)  # 5 blocks a row
    pages = allocate_pages(model.config, 12, BS)
    rows = [[9, 0, 4, 11, 2], [1, 3, 10, 5, 7]]  # scattered, not in order
    for b, ids in enumerate(rows):
        extract_blocks(src, b, 0, 5, BS, pages, ids)
    rebuilt = build_cache_from_blocks(pages, rows, 40, model.config)
    assert rebuilt.get_seq_length() == 40
    for (k0, v0, _), (k1, v1, _) in zip(src, rebuilt, strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_partial_extract_and_partial_last_block(model: Any) -> None:
    src = _cache(model, batch=1, tokens=37)
    pages = allocate_pages(model.config, 6, BS)
    extract_blocks(src, 0, 16, 2, BS, pages, torch.tensor([3, 1]))  # tokens 16..31
    layer = src.layers[1]
    assert torch.equal(pages[1][3, 0], layer.keys[0, :, 16:24].transpose(0, 1))
    assert torch.equal(pages[1][1, 1], layer.values[0, :, 24:32].transpose(0, 1))
    assert not pages[1][[0, 2, 4, 5]].any()  # no other page touched
    # 12 tokens from blocks [3, 1]: the second block is used for 4 of its 8 tokens.
    rebuilt = build_cache_from_blocks(pages, [[3, 1, 0]], 12)
    first = rebuilt.layers[0]
    assert isinstance(first, CacheLayerMixin)  # a full-attention layer: it has keys
    assert torch.equal(first.keys, src.layers[0].keys[:, :, 16:28])


def test_extract_from_static_cache(model: Any) -> None:
    ids = torch.randint(0, 2048, (1, 24), generator=torch.Generator().manual_seed(2))
    static = StaticCache(config=model.config, max_cache_len=64)
    prefill(model, ids, static)
    pages = allocate_pages(model.config, 3, BS)
    extract_blocks(static, 0, 0, 3, BS, pages, [0, 1, 2])
    dynamic = _cache(model, batch=1, tokens=24, seed=2)
    rebuilt = build_cache_from_blocks(pages, [[0, 1, 2]], 24)
    for (k0, v0, _), (k1, v1, _) in zip(dynamic, rebuilt, strict=True):
        assert torch.allclose(k0, k1, atol=1e-5) and torch.allclose(v0, v1, atol=1e-5)


def test_sliding_window_layer_serves_only_what_it_holds() -> None:
    model = make_demo_model(
        "mistral", seed=1, hidden_size=64, num_hidden_layers=2, sliding_window=16
    )[0]
    src = _cache(model, batch=1, tokens=40)  # the layers keep tokens 25..39
    pages = allocate_pages(model.config, 4, BS)
    with pytest.raises(ValueError, match=r"tokens 16\.\.24 are not in cache layer 0.*25\.\.40"):
        extract_blocks(src, 0, 16, 1, BS, pages, [0])
    extract_blocks(src, 0, 32, 1, BS, pages, [0])
    assert torch.equal(pages[0][0, 0], src.layers[0].keys[0, :, 7:15].transpose(0, 1))


def test_empty_build_and_extract(model: Any) -> None:
    pages = allocate_pages(model.config, 2, BS)
    assert build_cache_from_blocks(pages, [[]], 0, model.config).get_seq_length() == 0
    extract_blocks(_cache(model, 1, 8), 0, 0, 0, BS, pages, [])
    assert not pages[0].any()


def test_bad_extract_leaves_pages_unchanged(model: Any) -> None:
    src = _cache(model, batch=1, tokens=16)
    pages = allocate_pages(model.config, 4, BS)
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"out_block_ids": [0, 4]}, ValueError, r"out of range; expected 0\.\.3"),
        ({"out_block_ids": [1, 1]}, ValueError, "repeats a page"),
        ({"out_block_ids": [0]}, ValueError, "expected num_blocks=2"),
        ({"token_start": 8}, ValueError, r"tokens 8\.\.24 are not in cache layer 0"),
        ({"batch_index": 1}, ValueError, "batch_index=1 out of range"),
        ({"block_size": 4}, ValueError, "block_size=4"),
        ({"out_pages": [p.double() for p in pages]}, ValueError, "float64"),
        ({"out_pages": pages[:1]}, ValueError, "cache has 2 layers, out_pages 1"),
        ({"out_block_ids": [0.0, 1.0]}, TypeError, "expected 1-D ints"),
    ]
    for override, exc, msg in cases:
        args: dict[str, Any] = {
            "cache": src,
            "batch_index": 0,
            "token_start": 0,
            "num_blocks": 2,
            "block_size": BS,
            "out_pages": pages,
            "out_block_ids": [2, 3],
        }
        args.update(override)
        with pytest.raises(exc, match=msg):
            extract_blocks(**args)
        assert not any(p.any() for p in pages), override


def test_bad_build_is_rejected(model: Any) -> None:
    pages = allocate_pages(model.config, 4, BS)
    with pytest.raises(ValueError, match="needs 3 blocks of 8"):
        build_cache_from_blocks(pages, [[0, 1]], 20)
    with pytest.raises(ValueError, match=r"out of range; expected 0\.\.3"):
        build_cache_from_blocks(pages, [[0, 7]], 16)
    with pytest.raises(ValueError, match="one row per sequence"):
        build_cache_from_blocks(pages, [], 0)
    with pytest.raises(ValueError, match="expected every layer like pages"):
        build_cache_from_blocks([pages[0], pages[1][:2]], [[0]], 8)
    with pytest.raises(ValueError, match=r"expected \(num_blocks, 2, block_size"):
        build_cache_from_blocks([pages[0][:, 0]], [[0]], 8)


def test_pages_of_another_layer_count_are_refused(model: Any) -> None:
    """With the model's config, pages for fewer layers than its cache (here 1 of 2) were
    accepted and failed inside the model's forward as a bare size mismatch; more layers
    indexed past the cache's."""
    pages = allocate_pages(model.config, 4, BS)
    for wrong in ([pages[0]], [*pages, pages[0].clone()]):
        with pytest.raises(ValueError, match=rf"pages holds {len(wrong)} layers; the model's"):
            build_cache_from_blocks(wrong, [[0, 1]], 16, model.config)
    assert build_cache_from_blocks(pages, [[0, 1]], 16, model.config).get_seq_length() == 16
