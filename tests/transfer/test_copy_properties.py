"""Property test: random stores and loads over every layout, two KV-cache groups of different
page sizes, chunks of 1 to 3 blocks, mid-chunk loads, urgent loads and every id form, on
both CPU workers and both native submit routes, leave exactly the bytes that torch indexing
of a model predicts, in device memory and (read back) in the host pool."""

from __future__ import annotations

import array
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.transfer import (
    CPUTransferWorker,
    HostPool,
    KVCacheRegistration,
    KVTensor,
    NativeCPUTransferWorker,
    TransferWorker,
)
from kvtier.transfer.native import library
from kvtier.transfer.testing import LAYOUTS, block_bytes, fill_random_bytes, make_layout, snapshot

NB = 24


def _two_groups(nb: int, dt: torch.dtype, dev: str) -> list[KVTensor]:
    # Group 1's page is smaller than the slot (sized for group 0's): its rows leave a tail.
    return [
        *make_layout("flash", dt, dev, seed=5, nb=nb),
        KVTensor(torch.empty(nb, 3, 8, dtype=dt, device=dev), "mla", group=1),
    ]


LAYOUT_NAMES = [*sorted(LAYOUTS), "two_groups"]


def _kvs(name: str) -> list[KVTensor]:
    if name == "two_groups":
        kvs = _two_groups(NB, torch.float16, "cpu")
        for i, kv in enumerate(kvs):
            fill_random_bytes(kv.tensor, 77 + i)
        return kvs
    return make_layout(name, torch.float16, nb=NB, seed=3)


def _worker(kind: str, reg: KVCacheRegistration, pool: HostPool, threads: int) -> TransferWorker:
    if kind == "python":
        return CPUTransferWorker(reg, pool)
    w = NativeCPUTransferWorker(reg, pool, copy_threads=threads)
    if kind == "native-ctypes":
        w._ext_submit = None
    return w


FORMS: list[Callable[[list[int]], Any]] = [
    list,
    tuple,
    lambda v: np.array(v, dtype=np.int64),
    lambda v: np.array(v, dtype=np.int32),
    lambda v: np.array(v, dtype=np.uint16),
    lambda v: torch.tensor(v, dtype=torch.int64),
    lambda v: array.array("q", v),
    lambda v: np.array(v[::-1], dtype=np.int64)[::-1],  # a strided view
    lambda v: [np.int64(x) for x in v],
]


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_random_jobs_match_torch_indexing(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(LAYOUT_NAMES), "layout")
    kinds = ["python", "native", "native-ctypes"] if library() is not None else ["python"]
    kind = data.draw(st.sampled_from(kinds), "worker")
    threads = data.draw(st.integers(1, 3), "threads")
    bpc = data.draw(st.integers(1, 3), "bpc")
    kvs = _kvs(name)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, bpc, num_slots=7)
    groups = list(reg.groups)
    # The model: every device block's bytes, and per slot its group and chunk's blocks' bytes.
    dev = snapshot(kvs)
    host: dict[int, tuple[int, list[list[torch.Tensor]]]] = {}
    half = NB // 2
    job = 0
    with _worker(kind, reg, pool, threads) as w:
        for _ in range(data.draw(st.integers(1, 4), "rounds")):
            expected_ids: list[int] = []
            # Stores read the first half, loads write the second: within a round no job reads
            # what another writes, so the order jobs run in does not change the bytes.
            free = list(range(pool.num_slots))
            stored: dict[int, tuple[int, list[list[torch.Tensor]]]] = {}
            loadable = sorted(host)
            load_slots: set[int] = set()
            if loadable:
                load_slots = data.draw(st.sets(st.sampled_from(loadable)), "lslots")
            free = [s for s in free if s not in load_slots]
            for _ in range(data.draw(st.integers(0, 3), "stores")):
                if not free:
                    break
                k = data.draw(st.integers(1, min(2, len(free))), "nslots")
                slots = data.draw(st.permutations(free), "perm")[:k]
                free = [s for s in free if s not in slots]
                blocks = data.draw(
                    st.lists(st.integers(0, half - 1), min_size=k * bpc, max_size=k * bpc), "blk"
                )
                g = data.draw(st.sampled_from(groups), "group")
                form = data.draw(st.sampled_from(FORMS), "form")
                w.submit_store(job, form(blocks), form(slots), group=g)
                for i, s in enumerate(slots):
                    chunk = [dev[b] for b in blocks[i * bpc : (i + 1) * bpc]]
                    stored[s] = (g, chunk)
                expected_ids.append(job)
                job += 1
            targets = list(range(half, NB))
            for s in sorted(load_slots):
                g, chunk = host[s]
                skip = data.draw(st.integers(0, bpc - 1), "skip")
                n = data.draw(st.integers(1, bpc - skip), "n")
                if len(targets) < n:
                    break
                picked = data.draw(st.permutations(targets), "dst")[:n]
                targets = [t for t in targets if t not in picked]
                form = data.draw(st.sampled_from(FORMS), "form")
                urgent = data.draw(st.booleans(), "urgent")
                w.submit_load(
                    job, form([s]), form(picked), group=g, skip_blocks=skip, urgent=urgent
                )
                for i, b in enumerate(picked):
                    dev[b] = _only(chunk[skip + i], g, reg, kvs, dev[b])
                expected_ids.append(job)
                job += 1
            w.wait(expected_ids)
            results = w.get_finished()
            assert sorted(r.job_id for r in results) == expected_ids
            assert all(r.success for r in results), results
            host.update(stored)
            for b in range(NB):
                for got, want in zip(block_bytes(kvs, b), dev[b], strict=True):
                    assert torch.equal(got, want), f"block {b} differs"


def _only(
    src: list[torch.Tensor],
    group: int,
    reg: KVCacheRegistration,
    kvs: list[KVTensor],
    old: list[torch.Tensor],
) -> list[torch.Tensor]:
    """A block after a load of `group`: that group's tensors take `src`'s bytes, the others
    keep theirs (the layouts here share no memory between groups)."""
    return [s if kv.group == group else o for kv, s, o in zip(kvs, src, old, strict=True)]
