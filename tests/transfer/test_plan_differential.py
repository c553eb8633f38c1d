"""`JobPlanner` (plan.py) and the compiled planner (`kvt_plan_rows`, which the CPU engine and
the CUDA worker's compiled path use) against a brute-force model, on random ids (hypothesis):
in and out of range, negative, repeated, of every length around what the chunks take, with
skips, for several page sizes; both must accept exactly what the model accepts and pair the
same rows. Runs and long-run lists are checked against the model's row pairs too."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.transfer.native import library
from kvtier.transfer.plan import RUN_BYTES, Job, JobPlanner

PlanFn = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
    ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int64, ctypes.c_int64,
    ctypes.c_void_p, ctypes.c_void_p,
)  # fmt: skip


def _model(
    store: bool, blocks: list[int], slots: list[int], bpc: int, skip: int, nb: int, ns: int
) -> list[tuple[int, int]] | None:
    """(device row, host row) pairs, or None where the call must be refused."""
    if any(not 0 <= b < nb for b in blocks) or any(not 0 <= s < ns for s in slots):
        return None
    hosts = [s * bpc + j for s in slots for j in range(bpc)]
    if store:
        if skip or len(blocks) != len(hosts) or len(set(slots)) != len(slots):
            return None
        return list(zip(blocks, hosts, strict=True))
    if not 0 <= skip < bpc or len(set(blocks)) != len(blocks):
        return None
    used = hosts[skip : skip + len(blocks)]
    if len(used) != len(blocks):  # more blocks than the chunks hold
        return None
    # Every slot given must contribute a block: its chunk's rows meet the used range.
    for k in range(len(slots)):
        if not max(skip, k * bpc) < min(skip + len(blocks), (k + 1) * bpc):
            return None
    return list(zip(blocks, used, strict=True))


def _consecutive(xs: list[int]) -> bool:
    return bool(xs) and xs == list(range(xs[0], xs[0] + len(xs)))


def _python(
    p: JobPlanner, store: bool, blocks: list[int], slots: list[int], skip: int, group: int
) -> Job | None:
    try:
        if store:
            if skip:
                return None  # a store has no skip
            return p.store(1, blocks, slots, group)
        return p.load(1, slots, blocks, group, skip, False)
    except ValueError:
        return None


def _compiled(
    store: bool, blocks: list[int], slots: list[int], bpc: int, skip: int, nb: int, ns: int
) -> list[tuple[int, int]] | None:
    lib = library()
    assert lib is not None
    fn = PlanFn(("kvt_plan_rows", lib))
    b, s = np.array(blocks, np.int64), np.array(slots, np.int64)
    host, dev = np.zeros(max(1, len(blocks)), np.int64), np.zeros(max(1, len(blocks)), np.int64)
    rc = fn(int(store), b.ctypes.data, len(blocks), s.ctypes.data, len(slots), bpc, skip, nb, ns,
            host.ctypes.data, dev.ctypes.data)  # fmt: skip
    if rc:
        return None
    return list(zip(dev[: len(blocks)].tolist(), host[: len(blocks)].tolist(), strict=True))


@st.composite
def _calls(draw: st.DrawFn) -> tuple[bool, list[int], list[int], int, int, int, int]:
    bpc = draw(st.integers(1, 5))
    nb, ns = draw(st.integers(1, 40)), draw(st.integers(1, 12))
    store = draw(st.booleans())
    nslots = draw(st.integers(0, 5))
    slots = draw(st.lists(st.integers(-2, ns + 1), min_size=nslots, max_size=nslots))
    fit = nslots * bpc if store else max(0, nslots * bpc - draw(st.integers(0, bpc)))
    n = max(0, fit + draw(st.sampled_from([0, 0, 0, -1, 1, -bpc])))
    blocks = draw(st.lists(st.integers(-2, nb + 1), min_size=n, max_size=n))
    skip = 0 if store and draw(st.booleans()) else draw(st.integers(0, bpc))
    return store, blocks, slots, bpc, skip, nb, ns


@pytest.mark.skipif(library() is None, reason="needs the native library")
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_calls(), st.sampled_from([2, 64, 4096, RUN_BYTES // 3, RUN_BYTES]))
def test_both_planners_accept_and_pair_exactly_what_the_model_does(
    call: tuple[bool, list[int], list[int], int, int, int, int], page: int
) -> None:
    store, blocks, slots, bpc, skip, nb, ns = call
    want = _model(store, blocks, slots, bpc, skip, nb, ns)
    # Two groups of different page sizes: the group's own page sizes the job.
    p = JobPlanner(nb, ns, bpc, {0: 16, 3: page})
    job = _python(p, store, blocks, slots, skip, 3)
    got = (
        None
        if job is None
        else list(zip(job.dev_rows.tolist(), job.host_rows.tolist(), strict=True))
    )
    assert got == want, (call, got, want)
    assert _compiled(store, blocks, slots, bpc, skip, nb, ns) == want, call
    if job is None or want is None:
        return
    assert job.nbytes == len(want) * page
    devs, hosts = [d for d, _ in want], [h for _, h in want]
    assert job.dev_run == (devs[0] if _consecutive(devs) else None)
    assert job.host_run == (hosts[0] if _consecutive(hosts) else None)
    if job.runs is not None:
        d0, h0, lengths = job.runs
        pairs = [(d + i, h + i) for d, h, n in zip(d0, h0, lengths, strict=True) for i in range(n)]
        assert pairs == want and len(want) * page >= RUN_BYTES * len(lengths)


@pytest.mark.skipif(library() is None, reason="needs the native library")
def test_a_very_large_job_plans_the_same_in_python_and_in_c() -> None:
    """A million blocks in chunks of 4, slots in a random order, loaded from mid-chunk."""
    rng = np.random.default_rng(6)
    bpc, nb, ns = 4, 1 << 21, 1 << 19
    slots = rng.permutation(ns)[: 1 << 18]
    blocks = rng.permutation(nb)[: (1 << 20) - 3]
    p = JobPlanner(nb, ns, bpc, {0: 64})
    job = p.load(1, slots, blocks, 0, 2, False)
    want_host = (slots[:, None] * bpc + np.arange(bpc)).reshape(-1)[2 : 2 + blocks.shape[0]]
    assert np.array_equal(job.host_rows, want_host) and np.array_equal(job.dev_rows, blocks)
    got = _compiled(False, blocks.tolist(), slots.tolist(), bpc, 2, nb, ns)
    assert got is not None
    assert np.array_equal(np.array(got)[:, 1], want_host)
    with pytest.raises(ValueError, match="repeats id"):
        p.load(2, slots, np.concatenate([blocks[:-1], blocks[:1]]), 0, 2, False)
