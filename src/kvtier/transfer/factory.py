"""Pick a transfer backend for a registration and host pool."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.transfer.cpu_worker import CPUTransferWorker, check_stage_bytes
from kvtier.transfer.host_pool import HostPool
from kvtier.transfer.native import library
from kvtier.transfer.native_worker import NativeCPUTransferWorker
from kvtier.transfer.registration import KVCacheRegistration
from kvtier.transfer.worker import FaultInjector, TransferWorker, check_fault_injector, check_pool

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig

BACKENDS = ("auto", "cpu", "cuda")


def make_transfer_worker(
    registration: KVCacheRegistration, pool: HostPool, backend: str = "auto", **kwargs: Any
) -> TransferWorker:
    """Build a worker: "cpu", "cuda", or "auto" (the one matching the KV tensors' device).

    On the CPU the copy thread is compiled code (`NativeCPUTransferWorker`) where the native
    library can be built, and a Python thread (`CPUTransferWorker`) elsewhere.

    On CUDA with a pool that is not pinned (pinning failed or `pin=False`), the worker falls
    back to bounce buffers on a background thread and logs a warning.

    Extra keyword arguments (`stage_bytes`, `fault_injector`, for CUDA `copy_mode`,
    `compiled` and `coalesce_depth`, for the CPU `copy_threads`, `copy_cpus`,
    `avoid_submitter_cpu` and `share_backlog`) go to the backend. The CPU ones are ignored on
    CUDA, the CUDA ones by the pageable fallback and on the CPU, and the CPU ones by the
    Python-thread fallback, which splits large jobs over torch's threads. Their values are
    checked on every backend all the same (`stage_bytes`, `fault_injector`, and the CUDA ones
    `copy_mode`, `compiled` and `coalesce_depth`, which a CPU-only test run would otherwise
    never see).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; expected one of {BACKENDS}")
    check_pool(registration, pool)
    _check_options(kwargs)
    if backend == "auto":
        backend = "cuda" if registration.device.type == "cuda" else "cpu"
    if backend == "cuda":
        kwargs.pop("copy_threads", None)  # no copy threads of its own to size or place
        kwargs.pop("copy_cpus", None)
        kwargs.pop("avoid_submitter_cpu", None)
        kwargs.pop("share_backlog", None)
        # Imported here only so that a CPU-only install never touches torch.cuda set-up.
        from kvtier.transfer.cuda_worker import CUDATransferWorker
        from kvtier.transfer.pageable import PageableCUDATransferWorker

        if not pool.pinned:
            kwargs.pop("copy_mode", None)  # one way to copy without a pinned pool
            kwargs.pop("compiled", None)
            kwargs.pop("coalesce_depth", None)
            return PageableCUDATransferWorker(registration, pool, **kwargs)
        return CUDATransferWorker(registration, pool, **kwargs)
    kwargs.pop("copy_mode", None)
    kwargs.pop("compiled", None)
    kwargs.pop("coalesce_depth", None)
    if library() is not None:
        return NativeCPUTransferWorker(registration, pool, **kwargs)
    kwargs.pop("copy_threads", None)
    kwargs.pop("copy_cpus", None)
    kwargs.pop("avoid_submitter_cpu", None)
    kwargs.pop("share_backlog", None)
    return CPUTransferWorker(registration, pool, **kwargs)


def transfer_worker_from_config(
    registration: KVCacheRegistration,
    pool: HostPool,
    config: KVTierConfig,
    *,
    fault_injector: FaultInjector | None = None,
) -> TransferWorker:
    """`make_transfer_worker` with `config`'s `transfer_*` settings. A setting these KV tensors
    or this machine cannot honour (a CPU it does not have, the CUDA backend for host tensors)
    raises `ConfigError` naming the settings, as a bad value would; a mistake of the caller's
    own (a pool of another registration, a fault injector that is not callable) stays a
    `ValueError`."""
    from kvtier.config import ConfigError, KVTierConfig

    # Checked here, outside the wrapping below: not the configuration's fault.
    if not isinstance(config, KVTierConfig):  # a dict raised AttributeError on its first read
        raise TypeError(
            f"config must be a KVTierConfig (KVTierConfig.from_dict for a dict), got "
            f"{type(config).__name__}"
        )
    _check_options({"fault_injector": fault_injector})
    check_pool(registration, pool)
    # Loaded here too, outside the wrapping: a bad KVTIER_NATIVE_COPY or KVTIER_PORTABLE_COPY
    # raised inside it and was reported as the transfer_* settings' fault. Every backend
    # loads the library, so this builds nothing that the worker would not.
    library()
    settings = {
        "transfer_backend": config.transfer_backend,
        "transfer_cpus": config.transfer_cpus,
        "transfer_coalesce_depth": config.transfer_coalesce_depth,
    }
    try:
        return make_transfer_worker(
            registration,
            pool,
            config.transfer_backend,
            fault_injector=fault_injector,
            copy_cpus=config.transfer_cpus,
            avoid_submitter_cpu=config.transfer_avoid_submitter_cpu,
            coalesce_depth=config.transfer_coalesce_depth,
        )
    except ConfigError:
        raise
    except ValueError as exc:
        named = ", ".join(f"{key}={value!r}" for key, value in settings.items())
        raise ConfigError(f"{named}: cannot be used on this worker: {exc}") from exc


def _check_options(kwargs: dict[str, Any]) -> None:
    """Check the values of options that some backends drop unread."""
    if "stage_bytes" in kwargs:
        kwargs["stage_bytes"] = check_stage_bytes(kwargs["stage_bytes"])
    check_fault_injector(kwargs.get("fault_injector"))
    if not kwargs.keys() & {"compiled", "coalesce_depth", "copy_mode"}:
        return
    # Imported only here: a CPU-only run that passes no CUDA option never loads it.
    from kvtier.transfer.cuda_worker import check_cuda_options

    check_cuda_options(
        kwargs.get("copy_mode", "auto"), kwargs.get("compiled"), kwargs.get("coalesce_depth", 0)
    )
