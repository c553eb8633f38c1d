"""Host pool sizing, alignment and pinning fallback."""

from __future__ import annotations

import mmap
import warnings

import pytest
import torch

from kvtier.transfer import HostPool, KVCacheRegistration, KVTensor


def _reg() -> KVCacheRegistration:
    return KVCacheRegistration(
        [KVTensor(torch.zeros(2, 16, 4, 2, 8, dtype=torch.float16), "flash", group=0),
         KVTensor(torch.zeros(16, 4, 72, dtype=torch.float16), "mla", group=1)]
    )  # fmt: skip


def test_budget_sizing_is_exact() -> None:
    reg = _reg()
    assert reg.page_bytes(0) == 256 and reg.page_bytes(1) == 576
    slot = 3 * 576
    pool = HostPool(reg, 3, byte_budget=10 * slot + slot - 1)
    assert (pool.num_slots, pool.slot_bytes, pool.nbytes) == (10, slot, 10 * slot)
    assert pool.tensor.shape == (10, slot) and pool.tensor.dtype == torch.uint8
    assert HostPool.slots_for_budget(reg, 3, 7 * slot) == 7
    assert pool.rows.shape == (30, 576)


def test_pool_is_page_aligned_and_pageable_without_cuda() -> None:
    pool = HostPool(_reg(), 1, num_slots=5, pin=False)
    assert pool.address % mmap.PAGESIZE == 0
    assert not pool.pinned


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA fallback")
def test_pinning_failure_warns_once_and_falls_back() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pool = HostPool(_reg(), 1, num_slots=5, pin=True)
    assert not pool.pinned
    assert len([w for w in caught if "pageable" in str(w.message)]) == 1
    pool.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one"),
        ({"num_slots": 4, "byte_budget": 1 << 20}, "exactly one"),
        ({"num_slots": 0}, "num_slots"),
        ({"byte_budget": 100}, "smaller than one slot"),
        ({"byte_budget": -1}, "byte_budget"),
    ],
)
def test_bad_sizes_are_refused(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HostPool(_reg(), 1, **kwargs)  # type: ignore[arg-type]


def test_bad_blocks_per_chunk_is_refused() -> None:
    with pytest.raises(ValueError, match="blocks_per_chunk"):
        HostPool(_reg(), 0, num_slots=4)


def test_a_pool_too_large_to_map_says_how_large() -> None:
    # 2**53 slots of 576 bytes: past any address space, so the kernel refuses it at once.
    with pytest.raises(MemoryError, match="could not allocate the host pool: 9007199254740992"):
        HostPool(_reg(), 1, num_slots=2**53)


def test_a_pool_beyond_any_address_space_is_refused_before_mapping() -> None:
    with pytest.raises(ValueError, match="more than any address space"):
        HostPool(_reg(), 2**70, num_slots=4)
