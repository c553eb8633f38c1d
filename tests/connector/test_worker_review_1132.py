"""Review of the worker half, its metadata and the transfer factory (2026-11-28).

Each test failed before its fix: a step and its pickled copy could not be compared, an object
that is not a transfer worker was taken by the worker half and every job it was handed was
reported failed, and a bad `KVTIER_NATIVE_COPY` was blamed on the `transfer_*` settings."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from helpers import FakeTransfer
from kvtier.base import TransferResult
from kvtier.config import ConfigError, KVTierConfig
from kvtier.connector import JobKind, OffloadingWorker, StepMetadata, TransferJob
from kvtier.transfer import HostPool, KVCacheRegistration, KVTensor, native
from kvtier.transfer.factory import make_transfer_worker, transfer_worker_from_config
from kvtier.transfer.testing import make_layout


def _job(job_id: int, device_blocks: list[int]) -> TransferJob:
    return TransferJob(
        job_id, JobKind.STORE, "r", 0, np.array([4, 5]), np.array(device_blocks, dtype=np.int64)
    )


# -- metadata: a step compared with its serialized copy ---------------------------------------


def test_a_step_equals_its_pickled_copy_and_differs_by_one_block() -> None:
    meta = StepMetadata(stores=[_job(1, [7, 3, 9, 12])], wait_for=[2])
    copy = pickle.loads(pickle.dumps(meta))
    assert copy == meta  # raised ValueError: the truth value of an array is ambiguous
    assert copy.stores[0] == meta.stores[0]
    assert _job(1, [7, 3, 9, 13]) != meta.stores[0]  # one device block differs
    assert StepMetadata(loads=[_job(1, [7, 3, 9, 12])], wait_for=[2]) != meta
    assert meta.stores[0] != (1, JobKind.STORE)
    with pytest.raises(TypeError, match="unhashable"):
        hash(meta.stores[0])  # mutable, as before


# -- the worker half given something that is not a transfer worker ---------------------------


class _Minimal:
    """A backend without `holds`, which is optional: one that cannot answer is taken to have
    queued nothing. Its stores are refused, its loads finish at once."""

    def __init__(self) -> None:
        self.done: list[TransferResult] = []

    def submit_store(self, job_id: int, *args: object) -> None:
        raise RuntimeError("out of memory")

    def submit_load(self, job_id: int, *args: object) -> None:
        self.done.append(TransferResult(job_id, True))

    def get_finished(self) -> list[TransferResult]:
        done, self.done = self.done, []
        return done

    def wait(self, job_ids: object) -> None:
        pass


@pytest.mark.parametrize("transfer", [None, "cpu", transfer_worker_from_config])
def test_the_worker_half_refuses_an_object_that_is_not_a_transfer_worker(
    transfer: object,
) -> None:
    # It was taken: each job of a step was logged and reported failed (a submit that raised
    # AttributeError), and get_finished raised AttributeError.
    with pytest.raises(TypeError, match=r"without .*submit_store.*expected a transfer worker"):
        OffloadingWorker(transfer)  # type: ignore[arg-type]
    # Backends that have the four methods are still taken, `holds` or not.
    assert OffloadingWorker(FakeTransfer()).get_finished() == []
    w = OffloadingWorker(_Minimal())  # type: ignore[arg-type]
    w.finish_step(StepMetadata(stores=[_job(1, [0, 1])]))
    assert w.get_finished() == [TransferResult(1, False)]


# -- factory: a bad switch in the environment is not the settings' fault ----------------------


def test_a_bad_native_copy_switch_is_named_as_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = KVCacheRegistration([KVTensor(torch.zeros(4, 2, 4, 2, 8), "flashinfer")])
    pool = HostPool(reg, num_slots=2, pin=False)
    monkeypatch.setenv("KVTIER_NATIVE_COPY", "maybe")
    monkeypatch.setattr(native, "_cached", native._UNSET)  # read again, as in a fresh process
    with pytest.raises(ValueError, match="KVTIER_NATIVE_COPY='maybe'") as info:
        transfer_worker_from_config(reg, pool, KVTierConfig())
    # Was a ConfigError that named transfer_backend, transfer_cpus and
    # transfer_coalesce_depth as the settings this worker could not use.
    assert not isinstance(info.value, ConfigError)
    assert "transfer_backend" not in str(info.value)


@pytest.mark.parametrize("config", [{"transfer_backend": "cpu"}, None])
def test_a_config_that_is_not_a_kvtier_config_is_named(config: object) -> None:
    # It raised AttributeError ("'dict' object has no attribute 'transfer_backend'").
    reg = KVCacheRegistration([KVTensor(torch.zeros(4, 2, 4, 2, 8), "flashinfer")])
    pool = HostPool(reg, num_slots=2, pin=False)
    with pytest.raises(
        TypeError, match="config must be a KVTierConfig.*got " + type(config).__name__
    ):
        transfer_worker_from_config(reg, pool, config)  # type: ignore[arg-type]


# -- testing helpers: a misspelt layout --------------------------------------------------------


def test_a_misspelt_test_layout_names_the_layouts() -> None:
    # A bare KeyError('flsh') named neither what was expected nor that it was a layout.
    with pytest.raises(ValueError, match=r"layout 'flsh' is unknown; expected one of .*'flash'"):
        make_layout("flsh", torch.float16)


# -- the worker half: a job whose kind is not a JobKind ----------------------------------------


@pytest.mark.parametrize("kind", ["load", "store", None])
def test_a_job_whose_kind_is_not_a_job_kind_is_reported_failed_and_copies_nothing(
    kind: object,
) -> None:
    kv = torch.zeros(4, 2, 4, 2, 8)
    reg = KVCacheRegistration([KVTensor(kv, "flashinfer")])
    pool = HostPool(reg, num_slots=4, pin=False)
    with make_transfer_worker(reg, pool) as transfer:
        pool.tensor.fill_(7)  # slot 0 holds a chunk
        kv[2].fill_(1.0)
        w = OffloadingWorker(transfer)
        job = TransferJob(1, kind, "r", 0, np.array([0]), np.array([2]))  # type: ignore[arg-type]
        meta = StepMetadata(loads=[job])
        w.start_step(meta)
        w.wait_for_loads(meta)
        # Anything but JobKind.LOAD ran as a store, reported done: the slot's chunk was
        # overwritten with the device block the load was to fill.
        assert w.get_finished() == [TransferResult(1, False)]
        assert bool((pool.tensor == 7).all())
        assert bool((kv[2] == 1.0).all())
        w.start_step(meta)  # fed again: not submitted again, nor reported again
        assert w.get_finished() == []
