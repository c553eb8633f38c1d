"""KV tensor registration: layouts, byte views without copies, aliases, clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.transfer import KVCacheRegistration, KVTensor
from kvtier.transfer.testing import LAYOUTS, NUM_BLOCKS, make_layout


def test_every_layout_registers_with_its_page_size(layout: str) -> None:
    kvs = make_layout(layout, torch.float16)
    reg = KVCacheRegistration(kvs)
    assert reg.num_blocks == NUM_BLOCKS
    if layout == "aliased":  # the flash tensor counted once, plus the separate mla tensor
        assert reg.page_bytes() == 2 * 4 * 2 * 8 * 2 + 4 * 24 * 2
    else:  # disjoint tensors: every element of every tensor, 2 bytes each
        per_block = sum(kv.tensor.numel() for kv in kvs) // NUM_BLOCKS
        assert reg.page_bytes() == per_block * 2


def test_views_are_not_copies() -> None:
    t = torch.zeros(2, 8, 4, 2, 8, dtype=torch.bfloat16)
    reg = KVCacheRegistration([KVTensor(t, "flash")])
    k_rows, v_rows = (seg.rows for seg in reg.segments(0))
    k_rows[3].fill_(0xFF)
    assert torch.all(t[0, 3].view(torch.uint8) == 0xFF)
    assert torch.all(t[1, 3] == 0)
    assert v_rows.shape == (8, 4 * 2 * 8 * 2)


def test_block_major_flash_view_merges_k_and_v_into_one_segment() -> None:
    base = torch.zeros(8, 2, 4, 2, 8, dtype=torch.float16)
    reg = KVCacheRegistration([KVTensor(base.transpose(0, 1), "flash")])
    (seg,) = reg.segments(0)
    assert seg.width == seg.stride == 2 * 4 * 2 * 8 * 2


def test_fp8_registers_as_bytes() -> None:
    t = torch.zeros(8, 4, 16, dtype=torch.float8_e4m3fn)
    assert KVCacheRegistration([KVTensor(t, "mla")]).page_bytes() == 64


@pytest.mark.parametrize(
    ("shape", "layout"),
    [
        ((3, 8, 4, 2, 8), "flash"),
        ((8, 4, 2, 8), "flash"),
        ((8, 3, 4, 2, 8), "flashinfer"),
        ((8, 2, 4, 2, 8), "cross_layer"),
        ((8, 4, 2, 16), "mla"),
    ],
)
def test_shape_that_does_not_fit_layout_is_refused(shape: tuple[int, ...], layout: str) -> None:
    with pytest.raises(ValueError, match="does not fit layout"):
        KVTensor(torch.zeros(shape), layout)


def test_bad_layout_arguments() -> None:
    t = torch.zeros(8, 4, 16)
    with pytest.raises(ValueError, match="unknown"):
        KVTensor(t, "paged")
    with pytest.raises(ValueError, match="out of range"):
        KVTensor(t, 3)
    with pytest.raises(TypeError, match="layout=True must be a layout name"):
        KVTensor(t, True)
    with pytest.raises(ValueError, match="group"):
        KVTensor(t, "mla", group=-1)


def test_non_dense_block_data_is_refused() -> None:
    t = torch.zeros(8, 16, 4)[..., :2]  # a block's data has gaps
    with pytest.raises(ValueError, match="not densely packed"):
        KVCacheRegistration([KVTensor(t, 0)])


def test_partial_overlap_in_a_group_is_refused_but_allowed_across_groups() -> None:
    buf = torch.zeros(8, 64, dtype=torch.uint8)
    a, b = buf[:, :40], buf[:, 24:]
    with pytest.raises(ValueError, match="partially overlaps"):
        KVCacheRegistration([KVTensor(a, 0), KVTensor(b, 0)])
    reg = KVCacheRegistration([KVTensor(a, 0, group=0), KVTensor(b, 0, group=1)])
    assert reg.groups == (0, 1)
    assert (reg.page_bytes(0), reg.page_bytes(1), reg.max_page_bytes) == (40, 40, 40)


def test_overlaps_are_found_across_storages_that_share_memory() -> None:
    """Two storages over one buffer (`torch.from_numpy` of two slices): compared by storage,
    a partial overlap was accepted, and a load of block b then wrote into block b + 1."""
    raw = np.zeros(8 * 16 + 8, dtype=np.uint8)
    a = torch.from_numpy(raw[: 8 * 16]).view(8, 16)
    b = torch.from_numpy(raw[8 : 8 + 8 * 16]).view(8, 16)  # straddles a's blocks
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="partially overlaps"):
        KVCacheRegistration([KVTensor(a, 0), KVTensor(b, 0)])
    alias = torch.from_numpy(raw[: 8 * 16]).view(8, 16)  # the same bytes: counted once
    assert KVCacheRegistration([KVTensor(a, 0), KVTensor(alias, 0)]).page_bytes() == 16


def test_disagreeing_tensors_are_refused() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheRegistration([KVTensor(torch.zeros(8, 4, 4), "mla"),
                             KVTensor(torch.zeros(9, 4, 4), "mla")])  # fmt: skip
    with pytest.raises(ValueError, match="empty"):
        KVCacheRegistration([])
    with pytest.raises(TypeError, match="expected KVTensor items, got Tensor"):
        KVCacheRegistration([torch.zeros(8, 4, 4)])  # type: ignore[list-item]
    reg = KVCacheRegistration([KVTensor(torch.zeros(8, 4, 4), "mla")])
    with pytest.raises(ValueError, match="group=3"):
        reg.page_bytes(3)


def test_layout_catalogue_is_complete() -> None:
    assert {"flash", "flashinfer", "cross_layer", "mla", "aliased", "generic"} <= set(LAYOUTS)
