"""Worker side of kvtier: register KV tensors, allocate the host pool, move blocks.

See docs/transfer.md. Typical use::

    reg = KVCacheRegistration([KVTensor(t, "flash") for t in kv_caches])
    pool = HostPool(reg, blocks_per_chunk=4, byte_budget=8 << 30)
    worker = make_transfer_worker(reg, pool)
    worker.submit_store(job_id, device_blocks, slots)
"""

try:
    import torch  # noqa: F401
except ModuleNotFoundError as e:
    if e.name != "torch":
        raise
    # The scheduler side installs without torch (README); this said only "No module named
    # 'torch'" from deep inside cpu_worker, not which extra brings it.
    raise ModuleNotFoundError(
        "kvtier.transfer (the worker side) needs torch: pip install 'kvtier[torch]'", name="torch"
    ) from e

from kvtier.transfer.cpu_worker import CPUTransferWorker
from kvtier.transfer.factory import make_transfer_worker
from kvtier.transfer.host_pool import HostPool
from kvtier.transfer.native_worker import NativeCPUTransferWorker
from kvtier.transfer.plan import Direction
from kvtier.transfer.registration import KVCacheRegistration, KVTensor
from kvtier.transfer.worker import FaultInjector, TransferWorker

__all__ = [
    "CPUTransferWorker",
    "Direction",
    "FaultInjector",
    "HostPool",
    "KVCacheRegistration",
    "KVTensor",
    "NativeCPUTransferWorker",
    "TransferWorker",
    "make_transfer_worker",
]
