"""Registration's overlap check against the pairwise rule it replaced (each new segment tested
against every earlier one of its group), on random tensors over one buffer: interleaved parts,
exact aliases, wide single-block rows, two groups. And a registration of 65,536 parts, which
took O(n²) before."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from kvtier.transfer import KVCacheRegistration, KVTensor
from kvtier.transfer.registration import Segment, _merge

BUF = 2048  # bytes the random tensors live in


def _pairwise_overlap(a: Segment, b: Segment) -> bool:
    """The rule as it was: extents meet, unless both interleave with one stride and their
    windows modulo it are apart."""
    a_end = a.address + (a.num_blocks - 1) * a.stride + a.width
    b_end = b.address + (b.num_blocks - 1) * b.stride + b.width
    if not (a.address < b_end and b.address < a_end):
        return False
    if a.stride == b.stride and a.stride >= max(a.width, b.width):
        r = (b.address - a.address) % a.stride
        return r < a.width or r + b.width > a.stride
    return True


def _pairwise(kvs: list[KVTensor]) -> tuple[dict[int, list[Segment]], str | None, int]:
    """Each group's segments as the quadratic check kept them, the error it raised (or None)
    and how many aliases it skipped."""
    by_group: dict[int, list[Segment]] = {}
    aliases = 0
    for kv in kvs:
        group = by_group.setdefault(kv.group, [])
        for seg in kv.segments():
            if any((seg.address, seg.width, seg.stride) ==
                   (old.address, old.width, old.stride) for old in group):  # fmt: skip
                aliases += 1
                continue
            clash = next((old for old in group if _pairwise_overlap(seg, old)), None)
            if clash is not None:
                return (
                    by_group,
                    (
                        f"{kv!r} partially overlaps another tensor of group {kv.group} "
                        f"(bytes at {seg.address:#x} vs {clash.address:#x}); aliases must be exact"
                    ),
                    aliases,
                )
            group.append(seg)
    return by_group, None, aliases


def _random_tensor(rng: np.random.Generator, buf: torch.Tensor, nb: int, stride: int) -> KVTensor:
    """A tensor of 1-5 parts of `nb` blocks, mostly `stride` apart (the parts interleave, as
    they are narrower), in group 0 or 1; with one block, now and then a row wider than its
    stride."""
    group = int(rng.random() < 0.2)
    if nb == 1 and rng.random() < 0.2:  # a row wider than its stride: never interleaves
        width = int(rng.integers(2, 40))
        offset = int(rng.integers(0, 600))
        return KVTensor(buf.as_strided((1, width), (int(rng.integers(0, width)), 1), offset), 0)
    s = stride if rng.random() < 0.85 else stride + int(rng.integers(1, 4))  # mostly one stride
    parts = int(rng.integers(1, min(s, 5) + 1))
    width = int(rng.integers(1, s // parts + 1))
    # Parts next to each other (as a permuted cache has them), or spread.
    gap = width if rng.random() < 0.7 else int(rng.integers(1, s))
    # Periods 0, nb, 2nb or nb - 1: tensors stacked whole, or a period apart.
    base = int(rng.choice([0, nb, 2 * nb, max(nb - 1, 0)])) * stride
    offset = base + int(rng.integers(0, s))
    t = buf.as_strided((parts, nb, width), (gap, s, 1), offset)
    return KVTensor(t, 1, group=group)


def test_the_overlap_check_decides_as_the_pairwise_rule_did() -> None:
    rng = np.random.default_rng(7)
    buf = torch.zeros(BUF, dtype=torch.uint8)
    accepted = refused = interleaved = aliased = 0
    for _ in range(2500):
        nb = int(rng.choice([1, 2, 3, 5]))
        stride = int(rng.integers(4, 24))
        kvs = [_random_tensor(rng, buf, nb, stride) for _ in range(int(rng.integers(2, 6)))]
        if rng.random() < 0.3:  # an alias of one of them, registered again
            kvs.insert(int(rng.integers(0, len(kvs) + 1)), kvs[int(rng.integers(0, len(kvs)))])
        kept, error, aliases = _pairwise(kvs)
        aliased += aliases
        if error is not None:
            refused += 1
            with pytest.raises(ValueError) as exc:
                KVCacheRegistration(kvs)
            assert str(exc.value) == error
            continue
        accepted += 1
        reg = KVCacheRegistration(kvs)
        assert reg.groups == tuple(sorted(kept))
        for g, segs in kept.items():
            want = [(s.address, s.width, s.stride) for s in _merge(segs)]
            assert [(s.address, s.width, s.stride) for s in reg.segments(g)] == want
            ends = sorted((s.address, s.address + (nb - 1) * s.stride + s.width) for s in segs)
            interleaved += any(b[0] < a[1] for a, b in itertools.pairwise(ends))
    # Both outcomes, parts whose extents meet but whose bytes do not, and aliases, often.
    assert min(accepted, refused) > 500, (accepted, refused)
    assert interleaved > 200 and aliased > 300, (interleaved, aliased)


@pytest.mark.parametrize("interleaved", [False, True])
def test_sixty_five_thousand_parts_register_and_one_partial_overlap_among_them_is_found(
    interleaved: bool,
) -> None:
    """A block dimension after two dims of 256: 65,536 parts per tensor, which lie one after
    the other, or (a block-major buffer so viewed) interleaved with one stride."""
    nb, width = 2, 8
    if interleaved:
        base = torch.zeros(nb, 256, 256, width, dtype=torch.uint8)
        t = base.permute(1, 2, 0, 3)
    else:
        base = torch.zeros(256, 256, nb, width, dtype=torch.uint8)
        t = base
    reg = KVCacheRegistration([KVTensor(t, 2), KVTensor(t, 2)])  # the second: an alias
    assert reg.page_bytes() == 256 * 256 * width
    assert len(reg.segments(0)) == (1 if interleaved else 256 * 256)
    # Another tensor: the last part's bytes, one byte earlier; so it overlaps the last two
    # parts, and the error names the first of them.
    last, prev = t[255, 255], t[255, 254]
    shifted = base.view(-1).as_strided((nb, width), (last.stride(0), 1), last.storage_offset() - 1)
    start = t.untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="partially overlaps") as exc:
        KVCacheRegistration([KVTensor(t, 2), KVTensor(shifted, 0)])
    at = start + last.storage_offset() - 1
    assert f"bytes at {at:#x} vs {start + prev.storage_offset():#x}" in str(exc.value)
