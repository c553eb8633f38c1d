"""kvtier: KV-cache offloading for LLM inference engines."""

from kvtier.base import (
    BlockIDsLoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    ManagerStats,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    TransferResult,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)

__version__ = "0.1.0"

__all__ = [
    "BlockIDsLoadStoreSpec",
    "LoadStoreSpec",
    "LookupResult",
    "ManagerStats",
    "OffloadKey",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "ReqContext",
    "TransferResult",
    "__version__",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
]
