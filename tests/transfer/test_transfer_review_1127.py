"""Review of the CPU transfer worker's inputs and host pool: a forked child's writes stay out of
the parent's pool, and bad arguments to a directly built worker, the factory and the pool are
refused by name, before any thread starts or memory is mapped."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch

from helpers import FakeCudart, in_child
from kvtier.config import KVTierConfig
from kvtier.transfer import CPUTransferWorker, HostPool, KVCacheRegistration, KVTensor
from kvtier.transfer.factory import make_transfer_worker, transfer_worker_from_config
from kvtier.transfer.worker import TransferWorker


def _parts() -> tuple[torch.Tensor, KVCacheRegistration, HostPool]:
    kv = torch.arange(8 * 64, dtype=torch.int32).view(8, 64)
    reg = KVCacheRegistration([KVTensor(kv, 0)])
    return kv, reg, HostPool(reg, 1, num_slots=4, pin=False)


def _copy_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("kvtier")}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_childs_writes_into_its_pool_never_reach_the_parents_slots() -> None:
    """The pool was a MAP_SHARED mapping, shared with every forked child: a child's own stores
    into its inherited pool overwrote the parent's slot, and the parent's next load served
    the child's bytes as a success."""
    kv, reg, pool = _parts()
    with CPUTransferWorker(reg, pool) as w:
        w.submit_store(1, [3], [0])
        w.wait([1])
        assert [r.success for r in w.get_finished()] == [True]
        stored = pool.rows[0].clone()

        def child() -> bool:
            # numpy, not a worker: a forked child should not start torch's thread pools.
            pool.tensor.numpy().fill(0xFF)
            return bool((pool.tensor.numpy() == 0xFF).all())  # the child sees its writes

        in_child(child, "the child's write into its pool")
        assert torch.equal(pool.rows[0], stored), "the child's write reached the parent's slot"
        w.submit_load(2, [0], [5])
        w.wait([2])
        assert [r.success for r in w.get_finished()] == [True]
    assert torch.equal(kv[5], kv[3])


@pytest.mark.parametrize("stage_bytes", [0, -5, True, 2.5e6, "1"])
def test_a_directly_built_cpu_worker_refuses_a_bad_stage_bytes(stage_bytes: object) -> None:
    """The factory refused these; `CPUTransferWorker(...)` took 0, -5 and True silently, and
    died on the others with a TypeError that did not name the option."""
    _, reg, pool = _parts()
    before = _copy_threads()
    with pytest.raises(ValueError, match=rf"stage_bytes={stage_bytes!r} must be a positive int"):
        CPUTransferWorker(reg, pool, stage_bytes=stage_bytes)  # type: ignore[arg-type]
    assert _copy_threads() == before, "a refused worker left a copy thread behind"


def test_a_directly_built_cpu_worker_takes_integer_scalars_for_stage_bytes() -> None:
    _, reg, pool = _parts()
    for value in (np.int64(4096), torch.tensor(4096)):
        CPUTransferWorker(reg, pool, stage_bytes=value).shutdown()  # type: ignore[arg-type]


def test_a_directly_built_cpu_worker_refuses_an_injector_it_cannot_call() -> None:
    """It was accepted, and then every job failed on calling it."""
    _, reg, pool = _parts()
    before = _copy_threads()
    with pytest.raises(ValueError, match=r"fault_injector=5 must be a callable or None"):
        CPUTransferWorker(reg, pool, fault_injector=5)  # type: ignore[arg-type]
    assert _copy_threads() == before


_KVS = [KVTensor(torch.zeros(8, 64, dtype=torch.int32), 0)]

_BUILDERS: dict[str, Callable[[object, object], TransferWorker]] = {
    "CPUTransferWorker": lambda r, p: CPUTransferWorker(r, p),  # type: ignore[arg-type]
    "make_transfer_worker": lambda r, p: make_transfer_worker(r, p),  # type: ignore[arg-type]
    "transfer_worker_from_config": lambda r, p: transfer_worker_from_config(
        r,  # type: ignore[arg-type]
        p,  # type: ignore[arg-type]
        KVTierConfig(),
    ),
}


@pytest.mark.parametrize("builder", sorted(_BUILDERS))
def test_a_registration_of_the_wrong_type_is_named(builder: str) -> None:
    """A list of KVTensors passed as the registration died with AttributeError ('list' object
    has no attribute 'device')."""
    _, _, pool = _parts()
    with pytest.raises(TypeError, match=r"registration must be a KVCacheRegistration, got list"):
        _BUILDERS[builder](_KVS, pool)


@pytest.mark.parametrize("builder", sorted(_BUILDERS))
def test_a_pool_of_the_wrong_type_is_named(builder: str) -> None:
    """The pool's tensor (or None) passed as the pool died with AttributeError ('Tensor'
    object has no attribute 'registration')."""
    _, reg, pool = _parts()
    before = _copy_threads()
    for bad, name in ((pool.tensor, "Tensor"), (None, "NoneType")):
        with pytest.raises(TypeError, match=rf"pool must be a HostPool, got {name}"):
            _BUILDERS[builder](reg, bad)
    assert _copy_threads() == before


@pytest.mark.parametrize("pin", ["no", 0.0, 1, "False"])
def test_pin_must_be_a_bool_or_none(pin: object) -> None:
    """bool(pin) read pin="no" (or "False") as a request to pin the pool."""
    _, reg, _ = _parts()
    with pytest.raises(ValueError, match=rf"pin={pin!r} must be True, False or None"):
        HostPool(reg, 1, num_slots=2, pin=pin)  # type: ignore[arg-type]


def test_pin_takes_numpy_bools() -> None:
    _, reg, _ = _parts()
    assert not HostPool(reg, 1, num_slots=2, pin=np.bool_(False)).pinned  # type: ignore[arg-type]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_pinned_pool_is_not_inherited_by_a_forked_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copy-on-write of a pinned private page would give whoever writes first after a fork a
    new page; where the driver does not pin for fork that could be the parent, with the device
    still using the child's page. So the child gets no mapping, and building a worker on the
    pool there is refused by name rather than faulting on unmapped memory."""
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    kv = torch.arange(8 * 64, dtype=torch.int32).view(8, 64)
    reg = KVCacheRegistration([KVTensor(kv, 0)])
    pool = HostPool(reg, 1, num_slots=4, pin=True)
    assert pool.pinned and cudart.registered == [pool.address]
    assert not pool.forked

    def child() -> bool:
        assert pool.forked
        with pytest.raises(RuntimeError, match="created before the process forked"):
            CPUTransferWorker(reg, pool)
        # Not mapped here (MADV_DONTFORK held): a read would fault.
        return not _mapped(pool.address)

    in_child(child, "a worker built on an inherited pinned pool")
    assert not pool.forked
    with CPUTransferWorker(reg, pool) as w:  # the parent's pool works as before
        w.submit_store(1, [3], [0])
        w.submit_load(2, [0], [5])
        w.wait([1, 2])
        assert sorted((r.job_id, r.success) for r in w.get_finished()) == [(1, True), (2, True)]
    assert torch.equal(kv[5], kv[3])
    pool.close()
    assert cudart.unregistered == [pool.address]


def _mapped(address: int) -> bool:
    """Whether the page at `address` is mapped in this process, asked of the kernel
    (`mincore` fails with ENOMEM for an unmapped page; a read would fault)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    vec = (ctypes.c_ubyte * 1)()
    if libc.mincore(ctypes.c_void_p(address - address % page), ctypes.c_size_t(page), vec) == 0:
        return True
    return ctypes.get_errno() != errno.ENOMEM


def test_the_compiled_worker_refuses_a_bad_pool_and_injector_by_name() -> None:
    """Checked in the base class, so every worker refuses them: the compiled one, built
    directly, took `fault_injector=5` and failed every job, and died on a pool of the wrong
    type with an AttributeError."""
    from kvtier.transfer.native_worker import NativeCPUTransferWorker

    _, reg, pool = _parts()
    with pytest.raises(TypeError, match="pool must be a HostPool, got Tensor"):
        NativeCPUTransferWorker(reg, pool.tensor)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fault_injector=5 must be a callable or None"):
        NativeCPUTransferWorker(reg, pool, fault_injector=5)  # type: ignore[arg-type]
