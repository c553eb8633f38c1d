"""Edges of the paged cache (integrations.hf.paged_cache): KV of another dtype or device than
the buffer, and counts that are not ints, refused with an error naming them before any byte
of the buffer is written."""

from __future__ import annotations

import re
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.integrations.hf.models import make_demo_model  # noqa: E402
from kvtier.integrations.hf.paged_cache import PagedKVBuffer, PagedKVLayer  # noqa: E402
from kvtier.integrations.hf.prefix import generate_greedy  # noqa: E402

BS = 8


@pytest.fixture(scope="module")
def model() -> Any:
    return make_demo_model("llama", seed=4, hidden_size=64, num_hidden_layers=2)[0]


def _ids(n: int) -> Any:
    return torch.randint(0, 2048, (1, n), generator=torch.Generator().manual_seed(n))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_buffer_of_another_dtype_is_refused_before_it_is_written(model: Any, dtype: Any) -> None:
    """`copy_` cast the model's KV into the buffer, then attention failed on K/V of another
    dtype than its queries with a bare RuntimeError; the buffer was already overwritten."""
    buf = PagedKVBuffer(model.config, 4, BS, dtype=dtype)
    expected = re.escape(f"K of torch.float32 on cpu in a buffer of {dtype}")
    with pytest.raises(ValueError, match=expected):
        generate_greedy(model, _ids(12), 2, cache=buf.cache(0, 4, 0))
    assert not any(t.any() for t in buf.tensors)


def test_bf16_model_on_a_bf16_buffer_matches_its_recompute(model: Any) -> None:
    half = make_demo_model("llama", seed=4, hidden_size=64, num_hidden_layers=2)[0]
    half = half.to(torch.bfloat16)
    ids = _ids(BS + 1)
    ref = generate_greedy(half, ids, 3)
    buf = PagedKVBuffer(half.config, 4, BS, dtype=torch.bfloat16)
    generate_greedy(half, ids[:, :BS], 1, cache=buf.cache(0, 4, 0))
    out = generate_greedy(half, ids, 3, cache=buf.cache(0, 4, BS))
    assert out.prefill_tokens == 1 and torch.equal(out.tokens, ref.tokens)
    assert torch.equal(out.logits, ref.logits)
    f32 = PagedKVBuffer(half.config, 4, BS)
    with pytest.raises(ValueError, match=r"K of torch\.bfloat16 on cpu in a buffer of torch\.f"):
        generate_greedy(half, ids, 1, cache=f32.cache(0, 4, 0))


def test_kv_on_another_device_is_refused(model: Any) -> None:
    layer = PagedKVBuffer(model.config, 2, BS).cache(0, 2, 3).layers[0]
    assert isinstance(layer, PagedKVLayer)
    k = torch.zeros(1, 2, 1, 16, device="meta")
    with pytest.raises(ValueError, match=r"on meta in a buffer of torch\.float32 on cpu"):
        layer.update(k, k)
    assert layer.get_seq_length() == 3


def test_counts_and_dtypes_that_do_not_fit_are_refused(model: Any) -> None:
    with pytest.raises(ValueError, match=r"num_blocks=2\.5 is invalid"):
        PagedKVBuffer(model.config, 2.5, BS)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"dtype=torch\.int64 is invalid"):
        PagedKVBuffer(model.config, 2, BS, dtype=torch.int64)
    buf = PagedKVBuffer(model.config, 4, BS)
    with pytest.raises(ValueError, match=r"held_tokens=1\.5 is invalid"):
        buf.cache(0, 2, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_blocks=True is invalid"):
        buf.cache(0, True, 1)
    with pytest.raises(ValueError, match=r"first_block=0\.5 is invalid"):
        buf.cache(0.5, 2, 1)  # type: ignore[arg-type]
