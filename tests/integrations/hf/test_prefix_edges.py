"""Edges of `generate_greedy` and the page copies (integrations.hf.prefix, kv_blocks): token ids
outside the vocabulary, an empty batch, held KV of another dtype or batch than the run, and
counts that are not ints, each refused with an error naming the value before the model runs."""

from __future__ import annotations

import re
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.integrations.hf.kv_blocks import (  # noqa: E402
    allocate_pages,
    build_cache_from_blocks,
    extract_blocks,
)
from kvtier.integrations.hf.models import make_demo_model  # noqa: E402
from kvtier.integrations.hf.prefix import generate_greedy  # noqa: E402

BS = 8


@pytest.fixture(scope="module")
def model() -> Any:
    return make_demo_model("llama", seed=2, hidden_size=64, num_hidden_layers=2)[0]


def _ids(batch: int, n: int, seed: int = 0) -> Any:
    return torch.randint(0, 2048, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_ids_outside_the_vocabulary_are_named(model: Any) -> None:
    # On the CPU the embedding raised a bare "index out of range in self"; on CUDA it is a
    # device-side assert that leaves the context unusable.
    ids = _ids(2, 5)
    ids[1, 3] = 2048
    with pytest.raises(IndexError, match=r"token id 2048 at row 1, position 3 .* 0\.\.2047"):
        generate_greedy(model, ids, 1)
    ids[1, 3] = -1
    with pytest.raises(IndexError, match="token id -1 at row 1, position 3"):
        generate_greedy(model, ids, 1)


def test_empty_batch_is_refused(model: Any) -> None:
    with pytest.raises(ValueError, match=r"input_ids is \(0, 4\).*batch >= 1"):
        generate_greedy(model, torch.zeros((0, 4), dtype=torch.int64), 1)


def test_pages_of_another_dtype_are_refused_not_promoted(model: Any) -> None:
    """bf16 pages under a float32 model used to run, the cache concatenating bf16 KV with
    float32 KV into float32: logits ~1e-2 off recompute with no sign of it."""
    ids = _ids(1, 20)
    first = generate_greedy(model, ids[:, :16], 1)
    pages = allocate_pages(model.config, 4, BS)
    extract_blocks(first.cache, 0, 0, 2, BS, pages, [0, 1])
    for dtype in (torch.bfloat16, torch.float64):
        cache = build_cache_from_blocks([p.to(dtype) for p in pages], [[0, 1]], 16, model.config)
        with pytest.raises(ValueError, match=re.escape(f"holds {dtype} KV but the model runs in")):
            generate_greedy(model, ids, 2, cache=cache)
        assert cache.get_seq_length() == 16  # refused before the model ran
    same = build_cache_from_blocks(pages, [[0, 1]], 16, model.config)
    ref = generate_greedy(model, ids, 2)
    assert torch.equal(generate_greedy(model, ids, 2, cache=same).tokens, ref.tokens)


def test_cache_of_another_batch_is_refused(model: Any) -> None:
    ids = _ids(1, 20)
    cache = generate_greedy(model, ids[:, :16], 1).cache
    with pytest.raises(ValueError, match="batch of 1 sequences but input_ids has 2 rows"):
        generate_greedy(model, torch.cat([ids, _ids(1, 20, seed=1)]), 2, cache=cache)
    assert cache.get_seq_length() == 16


def test_counts_that_are_not_ints_are_refused(model: Any) -> None:
    pages = allocate_pages(model.config, 4, BS)
    bad: Any
    for bad in (5.0, True):
        with pytest.raises(ValueError, match=re.escape(f"num_tokens={bad!r} is invalid")):
            build_cache_from_blocks(pages, [[0, 1]], bad)
    src = generate_greedy(model, _ids(1, 16), 1).cache
    args: dict[str, Any] = {"batch_index": 0, "token_start": 0, "num_blocks": 1}
    for name in args:
        with pytest.raises(ValueError, match=rf"{name}=0\.5 is invalid"):
            extract_blocks(
                src, **{**args, name: 0.5}, block_size=BS, out_pages=pages, out_block_ids=[0]
            )
    assert not any(p.any() for p in pages)
