"""The planner and the CPU copy paths against a naive model, on random layouts.

Every random case lays KV tensors of random layouts, dtypes, paddings, memory orders, aliases
and KV-cache groups out in one byte buffer (the "device memory"). The model knows nothing of
segments or rows: from each tensor's own sizes, strides and storage offset it lists the byte
addresses of every element of every device block, and a group's page is those bytes, tensor by
tensor and part by part (exact aliases within a group once). A store copies each block's page
into the first page bytes of host row `slot * blocks_per_chunk + j`; a load copies host rows,
from `skip_blocks` of the first slot on, back into the blocks' bytes. Random stores and loads
(chunks of several blocks, skips, partial last chunks, ids of several array types) then go
through the planner and every copy path on the CPU, and the whole buffer and the whole pool
must equal the model's after each job. Seeded: a failure names its seed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from kvtier.transfer import (
    CPUTransferWorker,
    HostPool,
    KVCacheRegistration,
    KVTensor,
    NativeCPUTransferWorker,
)
from kvtier.transfer.copier import BlockCopier
from kvtier.transfer.native import library
from kvtier.transfer.pageable import BounceCopier
from kvtier.transfer.plan import Job, JobPlanner
from kvtier.transfer.registration import Segment

Bytes = npt.NDArray[np.uint8]
Offsets = npt.NDArray[np.int64]

_DTYPES = (torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)


@dataclass(frozen=True)
class _Spec:
    """One KV tensor: `typed.as_strided(sizes, strides, offset)` over the buffer viewed as
    `dtype`, its block dimension (a layout name or an int) and group."""

    dtype: torch.dtype
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    layout: str | int
    group: int

    @property
    def block_dim(self) -> int:
        named = {"flash": 1, "flashinfer": 0, "cross_layer": 0, "mla": 0}
        return named[self.layout] if isinstance(self.layout, str) else self.layout

    def footprint(self) -> int:
        """Elements from `offset` to one past the last element."""
        return 1 + sum((n - 1) * s for n, s in zip(self.sizes, self.strides, strict=True))


def _shape_strides(
    rng: np.random.Generator, nb: int, kind: str
) -> tuple[tuple[int, ...], tuple[int, ...], str | int]:
    """Sizes and strides (in elements, from offset 0) of one tensor of `kind`."""
    pad = int(rng.choice([0, 0, 1, 3, 8]))
    bs, h, d = (int(x) for x in rng.integers(1, 4, size=3))
    inner = bs * h * d
    if kind == "flash":  # K/V-major
        stride = inner + pad
        return (2, nb, bs, h, d), (nb * stride, stride, h * d, d, 1), "flash"
    if kind == "flash_block_major":  # allocated (nb, 2, ...), exposed K/V-major
        return (2, nb, bs, h, d), (inner, 2 * inner + pad, h * d, d, 1), "flash"
    if kind == "flashinfer":
        return (nb, 2, bs, h, d), (2 * inner + pad, inner, h * d, d, 1), "flashinfer"
    if kind == "cross_layer":
        layers = int(rng.integers(1, 3))
        return (
            (nb, layers, 2, bs, h, d),
            (layers * 2 * inner + pad, 2 * inner, inner, h * d, d, 1),
            "cross_layer",
        )
    if kind == "mla":
        return (nb, bs, d), (bs * d + pad, d, 1), "mla"
    if kind == "unit_dims":  # size-1 dims after the block dim may have any stride
        return (nb, 1, bs, 1, d), (bs * d + pad, 977, d, 5, 1), 0
    if kind == "generic_outer":  # (A, B, nb, x, y), blocks innermost of the three
        a, b = (int(x) for x in rng.integers(1, 3, size=2))
        s = inner + pad
        return (a, b, nb, bs, h * d), (b * nb * s, nb * s, s, h * d, 1), 2
    if kind == "generic_block_major":  # (A, B, nb, x, y) allocated block-major
        a, b = (int(x) for x in rng.integers(1, 3, size=2))
        return (a, b, nb, bs, h * d), (b * inner, inner, a * b * inner + pad, h * d, 1), 2
    raise AssertionError(kind)


_KINDS = (
    "flash",
    "flash_block_major",
    "flashinfer",
    "cross_layer",
    "mla",
    "unit_dims",
    "generic_outer",
    "generic_block_major",
)


def _random_specs(rng: np.random.Generator, nb: int) -> tuple[list[_Spec], int]:
    """Specs of 1-5 tensors (plus aliases and layer-interleaved families) and the buffer size
    in bytes. Tensors of one group never partially overlap; groups may share bytes."""
    groups = [0, 1, 5][: int(rng.integers(1, 4))]
    specs: list[_Spec] = []
    cursor = int(rng.integers(0, 16))
    for _ in range(int(rng.integers(1, 6))):
        dtype = _DTYPES[int(rng.integers(len(_DTYPES)))]
        item = torch.empty(0, dtype=dtype).element_size()
        group = groups[int(rng.integers(len(groups)))]
        cursor = -(-cursor // item) * item + item * int(rng.integers(0, 3))  # maybe unaligned
        roll = rng.random()
        if roll < 0.15 and specs:  # an exact alias, in its own group or another one
            old = specs[int(rng.integers(len(specs)))]
            specs.append(
                _Spec(
                    old.dtype,
                    old.sizes,
                    old.strides,
                    old.offset,
                    old.layout,
                    groups[int(rng.integers(len(groups)))],
                )
            )
            continue
        if roll < 0.3:  # layers interleaved block by block in one region, as mla tensors
            layers = int(rng.integers(2, 4))
            bs, d = (int(x) for x in rng.integers(1, 4, size=2))
            width = bs * d
            stride = layers * width + int(rng.choice([0, 2]))
            base = cursor // item
            for i in range(layers):
                specs.append(
                    _Spec(
                        dtype,
                        (nb, bs, d),
                        (stride, d, 1),
                        base + i * width,
                        "mla",
                        groups[int(rng.integers(len(groups)))] if i else group,
                    )
                )
            cursor = (base + nb * stride) * item
            continue
        kind = _KINDS[int(rng.integers(len(_KINDS)))]
        sizes, strides, layout = _shape_strides(rng, nb, kind)
        spec = _Spec(dtype, sizes, strides, cursor // item, layout, group)
        specs.append(spec)
        cursor = (spec.offset + spec.footprint()) * item
    total = -(-(cursor + 16) // 16) * 16
    return specs, total


def _build(buf: torch.Tensor, specs: list[_Spec]) -> list[KVTensor]:
    out = []
    for s in specs:
        typed = buf.view(s.dtype)
        t = typed.as_strided(s.sizes, s.strides, s.offset)
        out.append(KVTensor(t, s.layout, group=s.group))
    return out


def _element_bytes(spec: _Spec) -> list[Offsets]:
    """Per part (index of the dims before the block dim): `(nb, part_bytes)` byte addresses of
    its elements in logical order, computed from sizes and strides alone."""
    item = torch.empty(0, dtype=spec.dtype).element_size()
    d = spec.block_dim
    nb = spec.sizes[d]
    inner_sizes, inner_strides = spec.sizes[d + 1 :], spec.strides[d + 1 :]
    inner = np.zeros(1, dtype=np.int64)
    for n, s in zip(inner_sizes, inner_strides, strict=True):
        inner = (inner[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).reshape(-1)
    parts = []
    for index in itertools.product(*(range(n) for n in spec.sizes[:d])):
        base = spec.offset + sum(i * s for i, s in zip(index, spec.strides[:d], strict=True))
        elems = base + np.arange(nb, dtype=np.int64)[:, None] * spec.strides[d] + inner[None, :]
        byts = elems[:, :, None] * item + np.arange(item, dtype=np.int64)[None, None, :]
        parts.append(byts.reshape(nb, -1))
    return parts


def _model_pages(specs: list[_Spec]) -> dict[int, Offsets]:
    """Per group, `(nb, page_bytes)` byte addresses of each block's page."""
    pages: dict[int, list[Offsets]] = {}
    for spec in specs:
        seen = pages.setdefault(spec.group, [])
        for part in _element_bytes(spec):
            if not any(p.shape == part.shape and bool(np.all(p == part)) for p in seen):
                seen.append(part)
    return {g: np.concatenate(parts, axis=1) for g, parts in sorted(pages.items())}


class _Model:
    """The naive model: the device buffer and the pool as numpy bytes."""

    def __init__(self, buf: Bytes, pool: Bytes, pages: dict[int, Offsets], bpc: int) -> None:
        self.buf, self.pool, self.pages, self.bpc = buf, pool, pages, bpc

    def rows(self, slots: list[int]) -> list[int]:
        return [s * self.bpc + j for s in slots for j in range(self.bpc)]

    def store(self, blocks: list[int], slots: list[int], group: int) -> None:
        page = self.pages[group]
        for b, r in zip(blocks, self.rows(slots), strict=True):
            self.pool[r, : page.shape[1]] = self.buf[page[b]]

    def load(self, slots: list[int], blocks: list[int], group: int, skip: int) -> None:
        page = self.pages[group]
        rows = self.rows(slots)[skip : skip + len(blocks)]
        for b, r in zip(blocks, rows, strict=True):
            self.buf[page[b]] = self.pool[r, : page.shape[1]]


def _load_is_valid(n_slots: int, n_blocks: int, skip: int, bpc: int) -> bool:
    """The documented rule: blocks from `skip` of the first chunk on, every slot contributing
    one block or more, none left out."""
    if not 0 <= skip < bpc:
        return False
    if n_slots == 0:
        return n_blocks == 0
    first_row_after = skip + n_blocks  # rows [skip, skip + n) of n_slots * bpc
    return n_blocks >= 1 and (n_slots - 1) * bpc < first_row_after <= n_slots * bpc


def _as_ids(rng: np.random.Generator, ids: list[int]) -> Any:
    """`ids` as one of the types a submit accepts."""
    kind = int(rng.integers(6))
    if kind == 0:
        return list(ids)
    if kind == 1:
        return tuple(ids)
    if kind == 2:
        return np.array(ids, dtype=np.int32)
    if kind == 3:
        return np.array(ids, dtype=np.uint16)
    if kind == 4:
        return torch.tensor(ids, dtype=torch.int64)
    wide = np.zeros(2 * len(ids), dtype=np.int64)
    wide[::2] = ids
    return wide[::2]  # a strided view


@dataclass
class _Op:
    store: bool
    blocks: list[int]
    slots: list[int]
    group: int
    skip: int


def _random_ops(
    rng: np.random.Generator, nb: int, num_slots: int, bpc: int, groups: tuple[int, ...], count: int
) -> Iterator[_Op]:
    for _ in range(count):
        group = groups[int(rng.integers(len(groups)))]
        chunks = int(rng.integers(0, min(num_slots, nb // bpc) + 1))
        if rng.random() < 0.5:
            slots = rng.permutation(num_slots)[:chunks].tolist()
            if rng.random() < 0.3:  # a store may read a device block twice
                blocks = rng.integers(0, nb, size=chunks * bpc).tolist()
            else:
                blocks = rng.permutation(nb)[: chunks * bpc].tolist()
            if rng.random() < 0.3 and blocks:  # consecutive device blocks: a run
                start = int(rng.integers(0, nb - len(blocks) + 1))
                blocks = list(range(start, start + len(blocks)))
            if rng.random() < 0.2 and slots:
                start = int(rng.integers(0, num_slots - len(slots) + 1))
                slots = list(range(start, start + len(slots)))
            yield _Op(True, blocks, slots, group, 0)
        else:
            chunks = max(chunks, 1)
            slots = rng.integers(0, num_slots, size=chunks).tolist()  # repeats allowed
            if rng.random() < 0.3:
                start = int(rng.integers(0, num_slots - chunks + 1))
                slots = list(range(start, start + chunks))
            skip = int(rng.integers(0, bpc))
            most = chunks * bpc - skip
            least = max((chunks - 1) * bpc - skip + 1, 1)
            n = int(rng.integers(least, most + 1))
            blocks = rng.permutation(nb)[:n].tolist()
            if rng.random() < 0.3:
                start = int(rng.integers(0, nb - n + 1))
                blocks = list(range(start, start + n))
            yield _Op(False, blocks, slots, group, skip)


@dataclass
class _Case:
    buf: torch.Tensor
    reg: KVCacheRegistration
    pool: HostPool
    planner: JobPlanner
    model: _Model
    bpc: int


def _case(seed: int) -> _Case:
    rng = np.random.default_rng(seed)
    nb = int(rng.integers(4, 24))
    specs, total = _random_specs(rng, nb)
    buf = torch.from_numpy(rng.integers(0, 256, size=total, dtype=np.uint8))
    reg = KVCacheRegistration(_build(buf, specs))
    pages = _model_pages(specs)
    assert reg.groups == tuple(pages), seed
    for g, page in pages.items():
        assert reg.page_bytes(g) == page.shape[1], (seed, g)
    bpc = int(rng.integers(1, 5))
    pool = HostPool(reg, bpc, num_slots=int(rng.integers(1, 7)), pin=False)
    assert pool.row_bytes == max(p.shape[1] for p in pages.values())
    pool.tensor.copy_(
        torch.from_numpy(rng.integers(0, 256, size=pool.nbytes, dtype=np.uint8)).view(
            pool.num_slots, pool.slot_bytes
        )
    )
    planner = JobPlanner(nb, pool.num_slots, bpc, {g: reg.page_bytes(g) for g in reg.groups})
    model = _Model(
        buf.numpy().copy(),
        pool.rows.numpy().copy(),
        pages,
        bpc,
    )
    return _Case(buf, reg, pool, planner, model, bpc)


def _plan(case: _Case, rng: np.random.Generator, job_id: int, op: _Op) -> Job:
    if op.store:
        return case.planner.store(job_id, _as_ids(rng, op.blocks), _as_ids(rng, op.slots), op.group)
    return case.planner.load(
        job_id, _as_ids(rng, op.slots), _as_ids(rng, op.blocks), op.group, op.skip, False
    )


def _check(case: _Case, seed: int, op: _Op) -> None:
    assert np.array_equal(case.pool.rows.numpy(), case.model.pool), (seed, op)
    assert np.array_equal(case.buf.numpy(), case.model.buf), (seed, op)


def _apply_model(case: _Case, op: _Op) -> None:
    if op.store:
        case.model.store(op.blocks, op.slots, op.group)
    else:
        case.model.load(op.slots, op.blocks, op.group, op.skip)


SEEDS = range(60)


def _copier_runner(variant: str, case: _Case, rng: np.random.Generator) -> Callable[[Job], None]:
    rows = case.pool.rows
    if variant == "bounce":
        piece = int(rng.integers(1, 5)) * case.pool.row_bytes
        bounce = BounceCopier(case.reg, rows, bounce_bytes=piece)
        return lambda job: bounce.run(
            job, torch.from_numpy(job.dev_rows), torch.from_numpy(job.host_rows)
        )
    stage_bytes = case.pool.row_bytes * int(rng.integers(1, 4)) + int(rng.integers(0, 7))
    copier = BlockCopier(case.reg, rows, torch.empty(stage_bytes, dtype=torch.uint8))
    if variant == "torch_ops":
        copier._on_cpu = False  # the CUDA worker's torch-op paths (gather, scatter, staging)
    return lambda job: copier.run(
        job, torch.from_numpy(job.dev_rows), torch.from_numpy(job.host_rows)
    )


@pytest.mark.parametrize("variant", ["native", "memmove", "torch_ops", "bounce"])
def test_copy_paths_match_the_model(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if variant == "memmove":
        monkeypatch.setattr("kvtier.transfer.copier.row_copier", lambda: None)
    elif variant == "native" and library() is None:
        pytest.skip("the compiled row copier cannot be built here")
    # Small thresholds, so that small jobs take the run-by-run and multi-thread paths too.
    monkeypatch.setattr("kvtier.transfer.copier._PARALLEL_BYTES", 64)
    for seed in SEEDS:
        rng = np.random.default_rng([seed, 1])
        monkeypatch.setattr("kvtier.transfer.plan.RUN_BYTES", int(rng.choice([1, 64, 1 << 30])))
        case = _case(seed)
        run = _copier_runner(variant, case, rng)
        ops = _random_ops(
            rng, case.reg.num_blocks, case.pool.num_slots, case.bpc, case.reg.groups, 12
        )
        for job_id, op in enumerate(ops):
            job = _plan(case, rng, job_id, op)
            run(job)
            _apply_model(case, op)
            if variant == "bounce" and op.store:
                # The bounce copier writes whole host rows: past a smaller group's page, the
                # rows it stored hold whatever the bounce buffer held (bytes nobody reads).
                page = case.reg.page_bytes(op.group)
                for r in case.model.rows(op.slots):
                    case.model.pool[r, page:] = case.pool.rows.numpy()[r, page:]
            _check(case, seed, op)


@pytest.mark.parametrize("backend", ["python", "native"])
def test_workers_match_the_model(backend: str) -> None:
    if backend == "native" and library() is None:
        pytest.skip("the compiled copy engine cannot be built here")
    for seed in range(0, 60, 3):
        rng = np.random.default_rng([seed, 2])
        case = _case(seed)
        make: Any = CPUTransferWorker if backend == "python" else NativeCPUTransferWorker
        with make(case.reg, case.pool) as w:
            ops = list(
                _random_ops(
                    rng, case.reg.num_blocks, case.pool.num_slots, case.bpc, case.reg.groups, 10
                )
            )
            for job_id, op in enumerate(ops):
                _submit(w, rng, job_id, op, urgent=False)
                w.wait([job_id])
                (result,) = w.get_finished()
                assert result.success and result.job_id == job_id, (seed, op)
                page = case.reg.page_bytes(op.group)
                assert result.bytes == len(op.blocks) * page, (seed, op)
                _apply_model(case, op)
                _check(case, seed, op)


def _submit(w: Any, rng: np.random.Generator, job_id: int, op: _Op, urgent: bool) -> None:
    if op.store:
        w.submit_store(job_id, _as_ids(rng, op.blocks), _as_ids(rng, op.slots), group=op.group)
    else:
        w.submit_load(
            job_id,
            _as_ids(rng, op.slots),
            _as_ids(rng, op.blocks),
            group=op.group,
            skip_blocks=op.skip,
            urgent=urgent,
        )


def _burst(rng: np.random.Generator, case: _Case, count: int) -> list[_Op]:
    """Random jobs that may all be in flight at once under the caller's contract: no load
    from a slot stored in the burst, no store reading a block a load of the burst writes, no
    load writing a block a store of the burst reads (block ids across groups, which may
    alias). Loads may overwrite each other's blocks, stores each other's slots."""
    stored: set[int] = set()
    read: set[int] = set()
    written: set[int] = set()
    ops: list[_Op] = []
    nb, slots, bpc = case.reg.num_blocks, case.pool.num_slots, case.bpc
    for op in _random_ops(rng, nb, slots, bpc, case.reg.groups, 4 * count):
        if op.store and not written & set(op.blocks):
            stored |= set(op.slots)
            read |= set(op.blocks)
        elif not op.store and not stored & set(op.slots) and not read & set(op.blocks):
            written |= set(op.blocks)
        else:
            continue
        ops.append(op)
        if len(ops) == count:
            break
    return ops


@pytest.mark.parametrize("backend", ["python", "native"])
def test_bursts_of_jobs_in_flight_match_the_model(backend: str) -> None:
    """Jobs submitted back to back, then waited for together (the native worker's waiter then
    shares the backlog over its copy threads): on the CPU every lane runs in submission order,
    so the model applies them in that order (urgent loads touch nothing the others do)."""
    if backend == "native" and library() is None:
        pytest.skip("the compiled copy engine cannot be built here")
    for seed in range(40):
        rng = np.random.default_rng([seed, 3])
        case = _case(seed)
        make: Any = CPUTransferWorker
        if backend == "native":
            make = partial(NativeCPUTransferWorker, copy_threads=int(rng.integers(1, 4)))
        ops = _burst(rng, case, 16)
        with make(case.reg, case.pool) as w:
            for job_id, op in enumerate(ops):
                _submit(w, rng, job_id, op, False)
            w.wait(range(len(ops)))
            results = w.get_finished()
        assert [r.job_id for r in results] == list(range(len(ops))), seed
        assert all(r.success for r in results), seed
        for op in ops:
            _apply_model(case, op)
        _check(case, seed, ops[-1] if ops else _Op(True, [], [], 0, 0))


def test_load_arguments_are_accepted_exactly_when_the_rule_allows() -> None:
    rng = np.random.default_rng(7)
    for _ in range(3000):
        bpc = int(rng.integers(1, 5))
        planner = JobPlanner(64, 16, bpc, {0: 8})
        n_slots = int(rng.integers(0, 5))
        n_blocks = int(rng.integers(0, 4 * bpc + 2))
        skip = int(rng.integers(-1, bpc + 1))
        slots = rng.integers(0, 16, size=n_slots).tolist()
        blocks = rng.permutation(64)[:n_blocks].tolist()
        want = _load_is_valid(n_slots, n_blocks, skip, bpc)
        try:
            job = planner.load(1, slots, blocks, 0, skip, False)
        except ValueError:
            assert not want, (bpc, n_slots, n_blocks, skip)
            continue
        assert want, (bpc, n_slots, n_blocks, skip)
        rows = [s * bpc + j for s in slots for j in range(bpc)][skip : skip + n_blocks]
        assert job.host_rows.tolist() == rows
        assert job.dev_rows.tolist() == blocks
        assert job.nbytes == 8 * n_blocks


def test_store_arguments_are_accepted_exactly_when_the_rule_allows() -> None:
    rng = np.random.default_rng(8)
    for _ in range(2000):
        bpc = int(rng.integers(1, 5))
        planner = JobPlanner(64, 16, bpc, {3: 8})
        slots = rng.integers(0, 16, size=int(rng.integers(0, 5))).tolist()
        blocks = rng.integers(0, 64, size=int(rng.integers(0, 4 * bpc + 2))).tolist()
        want = len(blocks) == len(slots) * bpc and len(set(slots)) == len(slots)
        try:
            job = planner.store(1, blocks, slots, 3)
        except ValueError:
            assert not want, (bpc, slots, blocks)
            continue
        assert want, (bpc, slots, blocks)
        assert job.host_rows.tolist() == [s * bpc + j for s in slots for j in range(bpc)]
        assert job.dev_rows.tolist() == blocks


def _segment(address: int, width: int, stride: int, nb: int) -> Segment:
    view = torch.empty(0, dtype=torch.uint8)
    return Segment(address, 0, width, stride, nb, view)


def _bytes_of(seg: Segment) -> set[int]:
    return {
        seg.address + b * seg.stride + i for b in range(seg.num_blocks) for i in range(seg.width)
    }


def test_overlap_test_never_misses_shared_bytes() -> None:
    """`Segment.overlaps` may be conservative, but never says "apart" for segments that share
    a byte; with one stride at least as wide as both it is exact."""
    rng = np.random.default_rng(11)
    for _ in range(3000):
        nb = int(rng.integers(1, 6))
        wa, wb = (int(x) for x in rng.integers(1, 9, size=2))
        sa = int(rng.integers(wa, wa + 9))
        sb = sa if rng.random() < 0.6 else int(rng.integers(wb, wb + 9))
        a = _segment(1000, wa, sa, nb)
        b = _segment(1000 + int(rng.integers(-40, 41)), wb, sb, nb)
        shared = bool(_bytes_of(a) & _bytes_of(b))
        assert a.overlaps(b) == b.overlaps(a)
        if shared:
            assert a.overlaps(b), (a, b)
        elif sa == sb and sa >= max(wa, wb):
            assert not a.overlaps(b), (a, b)


def _random_call(rng: np.random.Generator, bpc: int) -> tuple[bool, list[int], list[int], int]:
    """A store or load call near the edge of validity: (store, blocks, slots, skip)."""
    store = bool(rng.random() < 0.5)
    n_slots = int(rng.integers(0, 4))
    slots = rng.integers(-1, 9, size=n_slots).tolist()  # 8 slots: -1 and 8 are out of range
    exact = n_slots * bpc - (0 if store else int(rng.integers(0, bpc)))
    n_blocks = max(0, exact + int(rng.integers(-bpc - 1, 2)))
    blocks = rng.integers(-1, 33, size=n_blocks).tolist()  # 32 blocks
    if rng.random() < 0.7:  # mostly in range, to reach the length and repeat rules
        slots = [s % 8 for s in slots]
        blocks = [b % 32 for b in blocks]
    skip = 0 if store else int(rng.integers(-1, bpc + 1))
    return store, blocks, slots, skip


@pytest.mark.parametrize("route", ["extension", "ctypes"])
def test_compiled_planning_accepts_exactly_what_the_planner_accepts(
    route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The native worker validates submits in C and asks the planner only about what C
    refused: C must refuse everything the planner refuses, and queue the same rows."""
    if library() is None:
        pytest.skip("the compiled copy engine cannot be built here")
    if route == "ctypes":
        monkeypatch.setattr("kvtier.transfer.native_worker.submit_extension", lambda: None)
    rng = np.random.default_rng(12)
    for bpc in (1, 2, 3):
        kv = KVTensor(
            torch.from_numpy(rng.integers(0, 256, size=(32, 2, 4), dtype=np.uint8)), "mla"
        )
        reg = KVCacheRegistration([kv])
        pool = HostPool(reg, bpc, num_slots=8, pin=False)
        planner = JobPlanner(32, 8, bpc, {0: 8})
        with NativeCPUTransferWorker(reg, pool, copy_threads=1) as w:
            for job_id in range(400):
                store, blocks, slots, skip = _random_call(rng, bpc)
                try:
                    if store:
                        planner.store(job_id, blocks, slots, 0)
                    else:
                        planner.load(job_id, slots, blocks, 0, skip, False)
                    want = True
                except ValueError:
                    want = False
                # Ids of any accepted type; bad ones as int64, which holds them as they are.
                dev = _as_ids(rng, blocks) if min(blocks, default=0) >= 0 else np.array(blocks)
                sl = _as_ids(rng, slots) if min(slots, default=0) >= 0 else np.array(slots)
                try:
                    if store:
                        w.submit_store(job_id, dev, sl)
                    else:
                        w.submit_load(job_id, sl, dev, skip_blocks=skip)
                    got = True
                except ValueError:
                    got = False
                assert got == want, (bpc, store, blocks, slots, skip)
                w.wait([job_id])
                for r in w.get_finished():
                    assert r.success
