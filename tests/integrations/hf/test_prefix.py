"""Greedy generation on a loaded prefix matches full recompute (kvtier.integrations.hf.prefix).

Tolerance: reused-prefix logits must agree with recompute within `LOGIT_ATOL = 1e-4`.
Why not exact: the KV a reused block holds for a previous reply's tokens was computed by
one-token decode steps, while recompute computes the same tokens in one prefill matmul; the
two sum in different orders, so K/V differ by float32 rounding (a few ulps), which 4 layers
carry into the logits. Measured on the demo models (logit std ~3, |logit| up to ~12): the max
abs difference over every step of these chats is 0.9e-5..1.2e-5 for Llama, Qwen2 and
Mistral, seeds 0-2, about 7 ulps of the largest logit. 1e-4 leaves ~10x margin. A real bug
(a block of other tokens, a position off by one) moves logits by O(1):
`test_wrong_block_is_caught` checks that it lands far outside the tolerance.
"""

from __future__ import annotations

import time
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
from kvtier.integrations.hf.prefix import generate_greedy, prefill  # noqa: E402

LOGIT_ATOL = 1e-4
BS = 16

ARCHS = [
    pytest.param("llama", {}, id="llama"),
    pytest.param("qwen2", {}, id="qwen2"),
    # A window shorter than the chat: the loaded cache keeps only the window, as the model does.
    pytest.param("mistral", {"sliding_window": 128}, id="mistral-sliding128"),
]


@pytest.fixture(scope="module")
def llama() -> Any:
    return make_demo_model("llama", seed=0)[0]


@pytest.mark.parametrize(("arch", "size"), ARCHS)
def test_multi_turn_chat_reuses_blocks_and_matches_recompute(
    arch: str, size: dict[str, Any], chat: Any
) -> None:
    model, _ = make_demo_model(arch, seed=0, **size)
    run = chat(model, turns=4, user_tokens=48, new_tokens=10)
    assert run.reused_tokens[1:] == [48, 112, 160]  # later turns really start from stored blocks
    assert run.rebuild_bit_identical
    assert run.tokens_equal
    assert run.max_logit_diff <= LOGIT_ATOL


def _prefill_cache(model: Any, ids: Any) -> Any:
    return prefill(model, ids)[1]


def test_batch_of_prompts_with_a_shared_cached_prefix(llama: Any) -> None:
    """Three prompts share a 64-token system prompt (stored once) and differ after it."""
    gen = torch.Generator().manual_seed(3)
    system = torch.randint(0, 2048, (1, 64), generator=gen)
    tails = torch.randint(0, 2048, (3, 40), generator=gen)
    ids = torch.cat([system.expand(3, -1), tails], dim=1)
    pages = allocate_pages(llama.config, 8, BS)
    extract_blocks(_prefill_cache(llama, system), 0, 0, 4, BS, pages, [5, 1, 7, 2])
    cache = build_cache_from_blocks(pages, [[5, 1, 7, 2]] * 3, 64, llama.config)
    out = generate_greedy(llama, ids, 10, cache=cache)
    ref = generate_greedy(llama, ids, 10)
    assert out.prefill_tokens == 40
    assert torch.equal(out.tokens, ref.tokens)
    assert (out.logits - ref.logits).abs().max().item() <= LOGIT_ATOL
    # Each row of the batch equals that prompt generated on its own.
    for row in range(3):
        alone = generate_greedy(llama, ids[row : row + 1], 10)
        assert torch.equal(alone.tokens[0], out.tokens[row])


def test_batch_rows_with_different_cached_blocks(llama: Any) -> None:
    """Rows load different pages (different prefixes) of one common length."""
    ids = torch.randint(0, 2048, (2, 70), generator=torch.Generator().manual_seed(4))
    pages = allocate_pages(llama.config, 8, BS)
    for row, page_ids in enumerate(([0, 1, 2], [6, 4, 3])):
        src = _prefill_cache(llama, ids[row : row + 1, :48])
        extract_blocks(src, 0, 0, 3, BS, pages, page_ids)
    cache = build_cache_from_blocks(pages, [[0, 1, 2], [6, 4, 3]], 48, llama.config)
    out = generate_greedy(llama, ids, 8, cache=cache)
    ref = generate_greedy(llama, ids, 8)
    assert torch.equal(out.tokens, ref.tokens)
    assert (out.logits - ref.logits).abs().max().item() <= LOGIT_ATOL


def test_whole_prompt_cached_recomputes_its_last_token(llama: Any) -> None:
    ids = torch.randint(0, 2048, (1, 64), generator=torch.Generator().manual_seed(5))
    pages = allocate_pages(llama.config, 4, BS)
    extract_blocks(_prefill_cache(llama, ids), 0, 0, 4, BS, pages, [0, 1, 2, 3])
    cache = build_cache_from_blocks(pages, [[0, 1, 2, 3]], 64, llama.config)
    out = generate_greedy(llama, ids, 6, cache=cache)
    ref = generate_greedy(llama, ids, 6)
    assert out.prefill_tokens == 1
    assert torch.equal(out.tokens, ref.tokens)
    assert (out.logits - ref.logits).abs().max().item() <= LOGIT_ATOL


def test_whole_prompt_in_a_full_sliding_window_is_refused_clearly() -> None:
    """A sliding layer holding a full window cannot drop its last token: a clear error before
    any layer is cropped, and loading all but the last token works."""
    from transformers import DynamicCache

    model, config = make_demo_model("mistral", seed=1, sliding_window=24, num_hidden_layers=2)
    ids = torch.randint(0, config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(5))
    pages = allocate_pages(config, num_blocks=4, block_size=BS)
    full = generate_greedy(model, ids, 1, cache=DynamicCache())  # full layers hold every token
    extract_blocks(full.cache, 0, 0, 4, BS, pages, [0, 1, 2, 3])
    cache = build_cache_from_blocks(pages, [[0, 1, 2, 3]], 64, config)
    with pytest.raises(ValueError, match="load at most 63 tokens"):
        generate_greedy(model, ids, 4, cache=cache)
    assert cache.get_seq_length() == 64  # nothing was cropped
    ref = generate_greedy(model, ids, 4)
    loaded = build_cache_from_blocks(pages, [[0, 1, 2, 3]], 63, config)
    out = generate_greedy(model, ids, 4, cache=loaded)
    assert out.prefill_tokens == 1 and torch.equal(out.tokens, ref.tokens)
    assert (out.logits - ref.logits).abs().max().item() <= LOGIT_ATOL


def test_wrong_block_is_caught(llama: Any) -> None:
    """Negative control: one block of another prompt's KV moves logits far beyond the tolerance.

    (Swapping two blocks of the right prompt would not: keys carry their rotary position and
    attention is order-free over (key, value) pairs. The bit-exact block tests catch that.)
    """
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 2048, (1, 80), generator=gen)
    other = torch.randint(0, 2048, (1, 64), generator=gen)
    pages = allocate_pages(llama.config, 5, BS)
    extract_blocks(_prefill_cache(llama, ids[:, :64]), 0, 0, 4, BS, pages, [0, 1, 2, 3])
    extract_blocks(_prefill_cache(llama, other), 0, 32, 1, BS, pages, [4])
    cache = build_cache_from_blocks(pages, [[0, 1, 4, 3]], 64, llama.config)
    out = generate_greedy(llama, ids, 4, cache=cache)
    ref = generate_greedy(llama, ids, 4)
    assert (out.logits - ref.logits).abs().max().item() > 1000 * LOGIT_ATOL


def test_output_shapes_and_cache_length(llama: Any) -> None:
    ids = torch.randint(0, 2048, (2, 20), generator=torch.Generator().manual_seed(7))
    out = generate_greedy(llama, ids, 5)
    assert out.tokens.shape == (2, 5)
    assert out.logits.shape == (2, 5, 2048)
    assert out.logits.dtype == torch.float32
    assert out.cache.get_seq_length() == 24  # the last new token's KV is never computed
    assert out.prefill_tokens == 20
    assert torch.equal(out.tokens, out.logits.argmax(dim=-1))


def test_bad_input_is_rejected(llama: Any) -> None:
    ids = torch.randint(0, 2048, (1, 20), generator=torch.Generator().manual_seed(8))
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        generate_greedy(llama, ids, 0)
    with pytest.raises(ValueError, match=r"expected a \(batch, seq_len >= 1\)"):
        generate_greedy(llama, ids[0], 3)
    with pytest.raises(TypeError, match=r"dtype torch\.float32"):
        generate_greedy(llama, ids.float(), 3)
    longer = _prefill_cache(llama, torch.cat([ids, ids], dim=1))
    with pytest.raises(ValueError, match="cache holds 40 tokens but the prompt has 20"):
        generate_greedy(llama, ids, 3, cache=longer)
    assert longer.get_seq_length() == 40  # unchanged by the refused call


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_first_token_time_waits_for_the_gpu() -> None:
    """TTFT on a GPU is when the logits exist, not when the prefill was queued: a busy kernel
    queued first delays the first token by its length."""
    model = make_demo_model("llama", seed=0)[0].to("cuda")
    ids = torch.randint(0, 2048, (1, 32), generator=torch.Generator().manual_seed(3)).cuda()
    generate_greedy(model, ids, 1)  # warm-up: kernels loaded, allocator primed
    cycles = 200_000_000
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    busy = begin.elapsed_time(end) / 1e3
    assert busy > 0.02  # long enough to tell apart from queueing a few kernels
    t0 = time.perf_counter()
    torch.cuda._sleep(cycles)
    out = generate_greedy(model, ids, 1)
    assert out.first_token_time - t0 >= 0.8 * busy
