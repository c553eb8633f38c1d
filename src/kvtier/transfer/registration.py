"""Registration of an engine's KV-cache tensors as byte rows, one row per device block.

Every supported layout reduces to *segments*: a segment is a `(num_blocks, width)` uint8 view
over a tensor's storage in which row `b` holds `width` contiguous bytes of device block `b`, and
consecutive rows are `stride` bytes apart. A device block of a KV-cache group is the
concatenation of its segments' rows, in registration order; that concatenation is the group's
*page* and the layout of a block inside a host slot.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left, insort
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvtier.base import checked_int

LAYOUTS: dict[str, int] = {"flash": 1, "flashinfer": 0, "cross_layer": 0, "mla": 0}
"""Named layouts and the dimension that indexes device blocks."""

_LAYOUT_SHAPES: dict[str, tuple[int, str]] = {
    "flash": (5, "(2, num_blocks, block_size, kv_heads, head_dim)"),
    "flashinfer": (5, "(num_blocks, 2, block_size, kv_heads, head_dim)"),
    "cross_layer": (6, "(num_blocks, layers, 2, block_size, kv_heads, head_dim)"),
    "mla": (3, "(num_blocks, block_size, latent_dim)"),
}
# The dimension that must have size 2 (K and V) in each named layout, if any.
_KV_DIM: dict[str, int] = {"flash": 0, "flashinfer": 1, "cross_layer": 2}


def _check_reach(tensor: torch.Tensor) -> None:
    """Refuse a tensor whose elements, at `element_size()` bytes each, reach past its storage:
    packed dtypes (`torch.quint4x2`, `torch.quint2x4`) report one byte per element but store
    several in a byte, and the compiled copier, which trusts the segments' addresses, copied
    past the storage's end (a store read there, a load would write there)."""
    item = tensor.element_size()
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    need = (tensor.storage_offset() + last) * item + item
    have = tensor.untyped_storage().nbytes()
    if need > have:
        raise ValueError(
            f"tensor of shape {tuple(tensor.shape)} and dtype {tensor.dtype} needs {need} "
            f"bytes of storage at {item} B per element, but its storage holds {have}; a dtype "
            "that packs several elements per byte is not supported"
        )


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of `tensor`'s whole storage, whatever its dtype (fp8 included)."""
    storage = tensor.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return flat.set_(storage, 0, (storage.nbytes(),), (1,))


@dataclass(frozen=True, slots=True)
class Segment:
    """`width` contiguous bytes per device block, `stride` bytes apart, inside one storage."""

    storage_ptr: int
    offset: int
    width: int
    stride: int
    num_blocks: int
    storage_view: torch.Tensor
    """Flat uint8 view of the whole storage the segment lives in."""

    @property
    def rows(self) -> torch.Tensor:
        """The segment as a `(num_blocks, width)` uint8 view, no copy."""
        return self.storage_view.as_strided(
            (self.num_blocks, self.width), (self.stride, 1), self.offset
        )

    @property
    def address(self) -> int:
        """Absolute address of the first byte of block 0 (for alignment checks)."""
        return self.storage_ptr + self.offset

    # Both compare addresses, not storages: two storages may share memory (tensors made with
    # `torch.from_numpy` or `torch.frombuffer` over one buffer).
    def same_place(self, other: Segment) -> bool:
        """Whether `other` names exactly the same bytes (an alias, counted once)."""
        return (self.address, self.width, self.stride) == (
            other.address,
            other.width,
            other.stride,
        )

    def overlaps(self, other: Segment) -> bool:
        """Conservative test for shared bytes with `other`."""
        a, b = self.address, other.address
        a_end = a + (self.num_blocks - 1) * self.stride + self.width
        b_end = b + (other.num_blocks - 1) * other.stride + other.width
        if not (a < b_end and b < a_end):
            return False
        if self.stride == other.stride and self.stride >= max(self.width, other.width):
            # Interleaved with the same period: compare the byte windows modulo the stride.
            r = (b - a) % self.stride
            return r < self.width or r + other.width > self.stride
        return True


class KVTensor:
    """One KV-cache tensor of an engine, its layout and its KV-cache group.

    `layout` is one of "flash" `(2, num_blocks, block_size, kv_heads, head_dim)`, "flashinfer"
    `(num_blocks, 2, block_size, kv_heads, head_dim)`, "cross_layer"
    `(num_blocks, layers, 2, block_size, kv_heads, head_dim)`, "mla"
    `(num_blocks, block_size, latent_dim)`, or an int: the block dimension of a tensor whose
    later dimensions are one block's data (densely packed) and whose earlier dimensions each
    select a separate part of every block (as K/V does in "flash").
    """

    __slots__ = ("block_dim", "group", "layout", "tensor")

    def __init__(self, tensor: torch.Tensor, layout: str | int, group: int = 0) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.layout != torch.strided or tensor.is_nested:
            # Their strides do not describe bytes of one storage: a sparse tensor was refused
            # as "not densely packed", a nested one by torch with an internal error.
            kind = "a nested tensor" if tensor.is_nested else f"of layout {tensor.layout}"
            raise ValueError(f"tensor is {kind}; kvtier needs a dense (torch.strided) tensor")
        try:
            group = checked_int("group", group, 0)  # numpy's and 0-d tensors too, never a bool
        except ValueError:
            raise ValueError(f"group={group!r} must be a non-negative int") from None
        if not isinstance(layout, str):
            try:
                layout = checked_int("layout", layout, -(1 << 63))  # its range is checked below
            except ValueError:
                raise TypeError(
                    f"layout={layout!r} must be a layout name or a block dimension"
                ) from None
        if isinstance(layout, str):
            if layout not in LAYOUTS:
                raise ValueError(
                    f"layout={layout!r} is unknown; expected one of {sorted(LAYOUTS)} or an int"
                )
            ndim, pattern = _LAYOUT_SHAPES[layout]
            kv_dim = _KV_DIM.get(layout)
            if tensor.dim() != ndim or (kv_dim is not None and tensor.shape[kv_dim] != 2):
                raise ValueError(
                    f"tensor of shape {tuple(tensor.shape)} does not fit layout {layout!r}: "
                    f"expected {pattern}"
                )
            block_dim = LAYOUTS[layout]
        else:
            if not 0 <= layout < tensor.dim():
                raise ValueError(
                    f"block dimension {layout} is out of range for a tensor of shape "
                    f"{tuple(tensor.shape)}"
                )
            block_dim = layout
        if tensor.shape[block_dim] == 0 or tensor.numel() == 0:
            raise ValueError(f"tensor of shape {tuple(tensor.shape)} holds no blocks")
        _check_reach(tensor)
        self.tensor = tensor
        self.layout = layout
        self.block_dim = block_dim
        self.group = group

    @property
    def num_blocks(self) -> int:
        """Number of device blocks the tensor holds."""
        return int(self.tensor.shape[self.block_dim])

    def segments(self) -> list[Segment]:
        """Split the tensor into segments; raises ValueError if a block's data is not dense."""
        t, d = self.tensor, self.block_dim
        item = t.element_size()
        shape, strides = list(t.shape), list(t.stride())
        # The dims after the block dim must tile one byte run, in any order: an engine may
        # store a block head-major and expose it token-major (vLLM's "HND" cache layout,
        # `permute`d to the logical shape), and kvtier copies the block's bytes as they lie.
        expected = 1
        for stride, size in sorted(
            (s, n) for n, s in zip(shape[d + 1 :], strides[d + 1 :], strict=True) if n != 1
        ):
            if stride != expected:
                raise ValueError(
                    f"tensor of layout {self.layout!r} with shape {tuple(shape)} and strides "
                    f"{tuple(strides)} is not densely packed after its block dimension {d}; "
                    "kvtier needs each block's data to be contiguous"
                )
            expected *= size
        width = expected * item
        block_stride = strides[d] * item
        if shape[d] > 1 and block_stride < width:
            raise ValueError(
                f"tensor with shape {tuple(shape)} and strides {tuple(strides)} has overlapping "
                f"blocks (block stride {block_stride} B < block data {width} B)"
            )
        view = _byte_view(t)
        base = t.storage_offset() * item
        ptr = t.untyped_storage().data_ptr()
        segments = []
        for index in itertools.product(*(range(n) for n in shape[:d])):
            offset = base + sum(i * int(s) * item for i, s in zip(index, strides[:d], strict=True))
            segments.append(Segment(ptr, int(offset), width, block_stride, int(shape[d]), view))
        return segments

    def __repr__(self) -> str:
        return (
            f"KVTensor(shape={tuple(self.tensor.shape)}, dtype={self.tensor.dtype}, "
            f"layout={self.layout!r}, group={self.group})"
        )


def _merge(segments: list[Segment]) -> list[Segment]:
    """Join neighbours whose bytes follow each other in every block (fewer, wider copies).
    The joined segment views the first one's storage, so it must reach that far: two storages
    may start at one address with different sizes (`torch.frombuffer` over one buffer twice),
    and a join past the first one's end made every copier's view of it raise."""
    merged: list[Segment] = []
    for seg in segments:
        prev = merged[-1] if merged else None
        if (
            prev is not None
            and prev.storage_ptr == seg.storage_ptr
            and prev.stride == seg.stride
            and prev.offset + prev.width == seg.offset
            and prev.width + seg.width <= seg.stride
            and seg.offset + (seg.num_blocks - 1) * seg.stride + seg.width
            <= prev.storage_view.numel()
        ):
            merged[-1] = Segment(
                prev.storage_ptr,
                prev.offset,
                prev.width + seg.width,
                prev.stride,
                prev.num_blocks,
                prev.storage_view,
            )
        else:
            merged.append(seg)
    return merged


def _first_ending_after(items: list[tuple[int, int, int]], x: int) -> int:
    """Index of the first of `items`, sorted disjoint `(start, end, _)` intervals, that ends
    after `x`."""
    i = bisect_left(items, (x,))
    return i - 1 if i and items[i - 1][1] > x else i


class _OverlapIndex:
    """The segments of one group accepted so far, each `num_blocks` rows tall, indexed to test
    a new segment against all of them by `Segment.overlaps`' rule: O(log n) steps amortized,
    and list inserts, which for a tensor's parts (in address order) are appends.

    Accepted segments never overlap, so their extents (first to last byte) fall into disjoint
    *spans*: one segment's extent, or the union of extents of segments that interleave with
    one stride S (`S >= width`, the rule's special case). A segment that meets a span of
    another kind overlaps one of its segments. Interleaved segments are tested by their bytes,
    which the rule then is exact for: a segment is a rectangle of periods × residues of its
    address divided by S (a row that wraps past S adds a second one, a period later), all
    `num_blocks` periods tall. Rectangles starting in one band of `num_blocks` periods are
    disjoint in residue, so a new one meets only its band's and the two next to it.
    """

    __slots__ = ("_bands", "_num_blocks", "_origins", "_places", "_spans")

    def __init__(self, num_blocks: int) -> None:
        self._num_blocks = num_blocks
        self._places: set[tuple[int, int, int]] = set()
        # Spans, sorted: (start, end, stride of its interleaved segments, or 0 for a segment
        # that does not interleave).
        self._spans: list[tuple[int, int, int]] = []
        # stride -> the address its periods count from: the first such segment's, so that a
        # tensor's parts, added in address order, are appended to their bands, not inserted.
        self._origins: dict[int, int] = {}
        # (stride, band) -> rectangles, sorted: (residue start, residue end, first period).
        self._bands: dict[tuple[int, int], list[tuple[int, int, int]]] = {}

    def aliases(self, seg: Segment) -> bool:
        """Whether an added segment names exactly the bytes of `seg` (`Segment.same_place`)."""
        return (seg.address, seg.width, seg.stride) in self._places

    def add(self, seg: Segment) -> bool:
        """Add `seg` and return True; or return False, adding nothing, if it overlaps an added
        segment."""
        start, width, stride = seg.address, seg.width, seg.stride
        end = start + (seg.num_blocks - 1) * stride + width
        tag = stride if stride >= width else 0
        spans = self._spans
        lo, hi = _first_ending_after(spans, start), bisect_left(spans, (end,))
        if lo < hi and (not tag or any(span[2] != tag for span in spans[lo:hi])):
            return False
        rects: list[tuple[int, int, int]] = []
        if tag:
            period, residue = divmod(start - self._origins.setdefault(stride, start), stride)
            rects.append((period, residue, min(residue + width, stride)))
            if residue + width > stride:
                rects.append((period + 1, 0, residue + width - stride))
            if any(self._meets(stride, *rect) for rect in rects):
                return False
        if lo < hi:  # the interleaved spans it meets become one
            start, end = min(start, spans[lo][0]), max(end, spans[hi - 1][1])
        spans[lo:hi] = [(start, end, tag)]
        for period, r_start, r_end in rects:
            band = self._bands.setdefault((stride, period // self._num_blocks), [])
            insort(band, (r_start, r_end, period))
        self._places.add((seg.address, width, stride))
        return True

    def _meets(self, stride: int, period: int, r_start: int, r_end: int) -> bool:
        """Whether an added rectangle of `stride` shares bytes with this one."""
        n = self._num_blocks
        for band in range(period // n - 1, period // n + 2):
            rects = self._bands.get((stride, band), [])
            i = _first_ending_after(rects, r_start)
            # Two bands' disjoint rectangles overlap in residue in O(n) pairs; a pair apart in
            # periods is passed here once, by the later one of it.
            while i < len(rects) and rects[i][0] < r_end:
                if abs(rects[i][2] - period) < n:
                    return True
                i += 1
        return False


class KVCacheRegistration:
    """An engine's KV cache as kvtier sees it: per KV-cache group, the byte segments of a block.

    All tensors must live on one device and hold the same number of blocks. Tensors (or parts)
    that alias the same bytes within a group are counted once; partial overlaps are an error.
    Tensors of different groups may alias each other (hybrid models share one block pool).
    """

    def __init__(self, tensors: Iterable[KVTensor]) -> None:
        # A lone KVTensor failed with "'KVTensor' object is not iterable", and a lone
        # torch.Tensor was iterated over its first dimension.
        if isinstance(tensors, (KVTensor, torch.Tensor, str, bytes)) or not isinstance(
            tensors, Iterable
        ):
            raise TypeError(
                f"tensors must be a sequence of KVTensor, got {type(tensors).__name__}; "
                "wrap a single KVTensor in a list"
            )
        tensors = list(tensors)
        if not tensors:
            raise ValueError("tensors is empty; register at least one KVTensor")
        for kv in tensors:
            if not isinstance(kv, KVTensor):
                raise TypeError(f"expected KVTensor items, got {type(kv).__name__}")
        devices = {kv.tensor.device for kv in tensors}
        if len(devices) != 1:
            raise ValueError(f"KV tensors are on several devices {sorted(map(str, devices))}")
        counts = {kv.num_blocks for kv in tensors}
        if len(counts) != 1:
            raise ValueError(f"KV tensors disagree on num_blocks: {sorted(counts)}")
        num_blocks = next(iter(counts))
        by_group: dict[int, list[Segment]] = {}
        indexes: dict[int, _OverlapIndex] = {}
        for kv in tensors:
            group_segments = by_group.setdefault(kv.group, [])
            if kv.group not in indexes:
                indexes[kv.group] = _OverlapIndex(num_blocks)
            index = indexes[kv.group]
            for seg in kv.segments():
                if index.aliases(seg):
                    continue
                if not index.add(seg):
                    # Once, on the way out: name the first added segment it overlaps, as ever.
                    clash = next(old for old in group_segments if seg.overlaps(old))
                    raise ValueError(
                        f"{kv!r} partially overlaps another tensor of group {kv.group} "
                        f"(bytes at {seg.address:#x} vs {clash.address:#x}); aliases must be exact"
                    )
                group_segments.append(seg)
        self.tensors: tuple[KVTensor, ...] = tuple(tensors)
        self.device: torch.device = devices.pop()
        self.num_blocks: int = counts.pop()
        self._segments: dict[int, tuple[Segment, ...]] = {
            g: tuple(_merge(segs)) for g, segs in sorted(by_group.items())
        }
        self.groups: tuple[int, ...] = tuple(self._segments)

    def segments(self, group: int) -> tuple[Segment, ...]:
        """The (merged) segments of `group`'s page, in page order."""
        self._check_group(group)
        return self._segments[group]

    def page_bytes(self, group: int = 0) -> int:
        """Bytes of one device block across all of `group`'s tensors, aliases counted once."""
        return sum(seg.width for seg in self.segments(group))

    @property
    def max_page_bytes(self) -> int:
        """The largest page over all groups: the host bytes reserved per device block."""
        return max(self.page_bytes(g) for g in self.groups)

    def alignment(self) -> int:
        """Largest power of two (≤16) dividing every segment's address, width and stride."""
        g = 0
        for segs in self._segments.values():
            for seg in segs:
                g = math.gcd(g, seg.address, seg.width, seg.stride)
        return math.gcd(g, 16)

    def _check_group(self, group: int) -> None:
        try:
            known = group in self._segments
        except TypeError:  # unhashable (a list): the same error as any other unknown group
            known = False
        if not known:
            raise ValueError(f"group={group!r} is not registered; groups are {list(self.groups)}")

    def __repr__(self) -> str:
        pages = {g: self.page_bytes(g) for g in self.groups}
        return (
            f"KVCacheRegistration(tensors={len(self.tensors)}, num_blocks={self.num_blocks}, "
            f"device={self.device}, page_bytes={pages})"
        )
