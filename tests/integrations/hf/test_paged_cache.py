"""The paged cache (kvtier.integrations.hf.paged_cache): a transformers cache whose K and V are
views of kvtier's registered buffer, written in place by the model.

Checked against transformers' own `DynamicCache`: the same tokens and logits, and after the run
the buffer's blocks hold bit for bit the K and V the `DynamicCache` ended with, so what kvtier
stores from the buffer is exactly the model's KV. Also: a cache that starts from loaded blocks,
`crop`, the host-row layout the transfer engine sees, and bad input.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.cache_utils import CacheLayerMixin  # noqa: E402

from kvtier.config import KVTierConfig  # noqa: E402
from kvtier.integrations.hf.generator import KVTierGenerator  # noqa: E402
from kvtier.integrations.hf.models import make_demo_model  # noqa: E402
from kvtier.integrations.hf.paged_cache import PagedKVBuffer, PagedKVLayer  # noqa: E402
from kvtier.integrations.hf.prefix import generate_greedy  # noqa: E402

BS = 16


@pytest.fixture(scope="module")
def model() -> Any:
    return make_demo_model("llama", seed=3)[0]


def _ids(n: int, seed: int) -> Any:
    return torch.randint(0, 2048, (1, n), generator=torch.Generator().manual_seed(seed))


def _blocks_hold(buf: PagedKVBuffer, first: int, cache: Any, tokens: int) -> bool:
    """Whether blocks `first..` hold `cache`'s first `tokens` tokens of K and V, bit for bit."""
    for t, layer in zip(buf.tensors, cache.layers, strict=True):
        n = -(-tokens // BS)
        run = t[:, :, first : first + n].reshape(2, t.shape[1], n * BS, -1)[:, :, :tokens]
        if not (
            torch.equal(run[0], layer.keys[0, :, :tokens])
            and torch.equal(run[1], layer.values[0, :, :tokens])
        ):
            return False
    return True


def test_generation_on_the_buffer_equals_dynamic_cache(model: Any) -> None:
    ids = _ids(70, 1)
    buf = PagedKVBuffer(model.config, 16, BS)
    ref = generate_greedy(model, ids, 12)
    out = generate_greedy(model, ids, 12, buf.cache(5, 6, 0))
    assert torch.equal(out.tokens, ref.tokens)
    assert (out.logits - ref.logits).abs().max().item() <= 1e-5
    held = ref.cache.get_seq_length()
    assert out.cache.get_seq_length() == held == 70 + 12 - 1
    # The model wrote its KV into blocks 5.. in place; the other blocks are untouched.
    assert _blocks_hold(buf, 5, ref.cache, held)
    assert all(t[:, :, :5].count_nonzero() == 0 and t[:, :, 11:].count_nonzero() == 0
               for t in buf.tensors)  # fmt: skip


def test_cache_starting_from_held_blocks_prefills_only_the_rest(model: Any) -> None:
    ids = _ids(90, 2)
    buf = PagedKVBuffer(model.config, 8, BS)
    first = generate_greedy(model, ids[:, :64], 1, buf.cache(1, 7, 0))
    assert first.prefill_tokens == 64
    # Blocks 1..4 now hold 64 tokens of KV: a new cache over them continues from there.
    out = generate_greedy(model, ids, 6, buf.cache(1, 7, 64))
    ref = generate_greedy(model, ids, 6)
    assert out.prefill_tokens == 26
    assert torch.equal(out.tokens, ref.tokens)
    assert (out.logits - ref.logits).abs().max().item() <= 1e-4


def test_crop_then_update_rewrites_the_dropped_position(model: Any) -> None:
    ids = _ids(48, 4)
    buf = PagedKVBuffer(model.config, 4, BS)
    generate_greedy(model, ids, 1, buf.cache(0, 4, 0))
    # The cache holds the whole prompt: prefill drops its last token and recomputes it.
    out = generate_greedy(model, ids, 3, buf.cache(0, 4, 48))
    ref = generate_greedy(model, ids, 3)
    assert out.prefill_tokens == 1
    assert torch.equal(out.tokens, ref.tokens)
    assert out.cache.get_seq_length() == ref.cache.get_seq_length() == 50
    # The 47 tokens before the dropped one are untouched; from token 47 on the KV was written
    # again where it belongs (a one-token forward sums in another order than the prefill, so
    # close, not bit-identical).
    assert _blocks_hold(buf, 0, ref.cache, 47)
    for t, layer in zip(buf.tensors, ref.cache.layers, strict=True):
        assert isinstance(layer, CacheLayerMixin) and layer.keys is not None  # full attention
        k = t[0, :, :4].reshape(t.shape[1], 64, -1)[:, 47:50]
        assert (k - layer.keys[0, :, 47:50]).abs().max().item() <= 1e-4


def test_host_rows_are_each_layers_k_then_v_block_head_by_head(model: Any) -> None:
    buf = PagedKVBuffer(model.config, 4, BS)
    for i, t in enumerate(buf.tensors):
        t.copy_(torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape) + 1000 * i)
    reg = buf.registration()
    block = 2
    expected = torch.cat([t[:, :, block].reshape(-1).view(torch.uint8) for t in buf.tensors])
    got = torch.cat([seg.rows[block] for seg in reg.segments(0)])
    assert torch.equal(got, expected)
    assert reg.page_bytes() == expected.numel()


def test_sliding_window_model_through_the_generator_matches_recompute() -> None:
    """A sliding-window layer held in full: transformers' mask still applies the window."""
    model, _ = make_demo_model("mistral", seed=1, sliding_window=32)
    rng = torch.Generator().manual_seed(5)
    history = torch.randint(0, 2048, (50,), generator=rng)
    config = KVTierConfig(offload_prompt_only=False)
    with KVTierGenerator(model, config, block_size=BS, max_blocks=32) as gen:
        for turn in range(3):
            result = gen.generate_one(history, 6)
            ref = generate_greedy(model, history.unsqueeze(0), 6)
            assert torch.equal(result.tokens, ref.tokens[0])
            assert (result.logits - ref.logits[0]).abs().max().item() <= 1e-4
            assert (result.hit_tokens > 0) == (turn > 0)
            history = torch.cat(
                [history, result.tokens, torch.randint(0, 2048, (20,), generator=rng)]
            )


def test_bad_input_is_refused(model: Any) -> None:
    with pytest.raises(ValueError, match="num_blocks=0"):
        PagedKVBuffer(model.config, 0, BS)
    buf = PagedKVBuffer(model.config, 4, BS)
    with pytest.raises(ValueError, match=r"blocks 3\.\.4 are out of range"):
        buf.cache(3, 2, 0)
    with pytest.raises(ValueError, match="held_tokens=33"):
        buf.cache(0, 2, 33)
    layer = buf.cache(0, 1, 10).layers[0]
    assert isinstance(layer, PagedKVLayer) and layer.get_seq_length() == 10
    k = torch.zeros(1, 2, 7, 64)
    with pytest.raises(ValueError, match="at most 16 tokens"):
        layer.update(k, k)
    with pytest.raises(ValueError, match="at most 16 tokens"):
        layer.update(torch.zeros(2, 2, 1, 64), torch.zeros(2, 2, 1, 64))
    assert layer.get_seq_length() == 10  # unchanged by the refusals
    with pytest.raises(ValueError, match="must both be"):
        PagedKVLayer(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 5, 8), 0)
    with pytest.raises(NotImplementedError):
        layer.batch_repeat_interleave(2)
