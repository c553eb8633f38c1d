"""The test helpers themselves: snapshots cover every block, of any block size."""

from __future__ import annotations

import torch

from kvtier.transfer import KVTensor
from kvtier.transfer.testing import NUM_BLOCKS, block_bytes, make_layout, snapshot


def test_a_snapshot_covers_every_block_the_tensors_hold() -> None:
    """It once stopped at NUM_BLOCKS (or ran past the end) whatever the tensors held."""
    for nb in (16, NUM_BLOCKS + 16):
        kvs = make_layout("flash", torch.float16, nb=nb)
        snap = snapshot(kvs)
        assert len(snap) == nb
        assert torch.equal(snap[-1][0], block_bytes(kvs, nb - 1)[0])
    assert len(snapshot(make_layout("mla", torch.float16), 5)) == 5


def test_a_block_of_one_element_is_its_bytes() -> None:
    t = torch.arange(8, dtype=torch.float16)
    got = block_bytes([KVTensor(t, 0)], 3)
    assert torch.equal(got[0], t[3:4].view(torch.uint8))
