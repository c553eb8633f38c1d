"""Edge cases of KV tensor registration: block layouts that engines produce and that kvtier
must register as they are, and the ones it must still refuse."""

from __future__ import annotations

import pytest
import torch

from kvtier.transfer import HostPool, KVCacheRegistration, KVTensor, make_transfer_worker
from kvtier.transfer.testing import assert_block_equals, fill_random_bytes, snapshot

NB = 12


def _hnd(layout: str) -> torch.Tensor:
    """A cache allocated head-major (2 heads, 4 tokens, 8 dims) and exposed token-major."""
    if layout == "flash":
        return torch.empty(2, NB, 2, 4, 8, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)
    return torch.empty(NB, 2, 2, 4, 8, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)


@pytest.mark.parametrize(("layout", "parts"), [("flash", 2), ("flashinfer", 1)])
def test_head_major_cache_exposed_token_major_registers_whole_blocks(
    layout: str, parts: int
) -> None:
    # vLLM's "HND" layout: the buffer is (.., heads, tokens, dim) and the tensor the engine
    # hands over is its permute to (.., tokens, heads, dim). A block is still one byte run.
    t = _hnd(layout)
    assert not t.is_contiguous()
    reg = KVCacheRegistration([KVTensor(t, layout)])
    assert reg.page_bytes() == 2 * 4 * 2 * 8 * 2
    assert len(reg.segments(0)) == parts


def test_head_major_blocks_round_trip_byte_exact() -> None:
    kvs = [KVTensor(_hnd("flash"), "flash"), KVTensor(_hnd("flashinfer"), "flashinfer")]
    for i, kv in enumerate(kvs):
        fill_random_bytes(kv.tensor, i)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 2, num_slots=3)
    before = snapshot(kvs)
    with make_transfer_worker(reg, pool) as w:
        w.submit_store(1, [7, 2, 5, 0], [2, 0])
        w.wait([1])
        w.submit_load(2, [2, 0], [10, 11, 3], skip_blocks=1)
        w.wait([2])
        assert [r.success for r in w.get_finished()] == [True, True]
    for dst, src in [(10, 2), (11, 5), (3, 0)]:
        assert_block_equals(kvs, dst, before[src])


@pytest.mark.parametrize(
    "tensor",
    [
        torch.empty(NB, 2, 4, 2, 8)[..., :4],  # a slice of each head: gaps in every block
        torch.empty(NB, 2, 1, 8).expand(NB, 2, 4, 8),  # one token's bytes repeated
        torch.empty(NB, 4, 2, 8).permute(0, 1, 3, 2)[:, :, :, :1],  # a gap after a permute
    ],
)
def test_a_block_with_gaps_or_repeats_is_still_refused(tensor: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="not densely packed"):
        KVCacheRegistration([KVTensor(tensor, 0)])
