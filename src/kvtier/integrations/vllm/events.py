"""kvtier's `OffloadingEvent`s as vLLM KV cache events (`BlockStored` / `BlockRemoved`).

vLLM's scheduler drains `KVConnectorBase_V1.take_events()` after every step and publishes the
result next to its own prefix-cache events (`--kv-events-config`). The payload is the one
vLLM's `OffloadingConnector` publishes by default: per chunk, the block hash that keys it
(the chunk's last device block), the KV-cache group and the medium; no token ids, parent hash
or block size, which the host tier does not keep.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import BlockHash, ExternalBlockHash, maybe_convert_block_hash

from kvtier.base import OffloadingEvent, get_offload_block_hash, get_offload_group_idx


def to_vllm_events(events: Iterable[OffloadingEvent]) -> list[KVCacheEvent]:
    """vLLM events for kvtier's manager events, in order.

    One `BlockStored` per stored chunk (as vLLM's OffloadingConnector does: a multi-hash
    `BlockStored` would claim a parent chain that admission may have broken), one
    `BlockRemoved` per KV-cache group of each removal.
    """
    out: list[KVCacheEvent] = []
    for event in events:
        medium = event.medium
        if not event.removed:
            out.extend(
                BlockStored(
                    block_hashes=[maybe_convert_block_hash(BlockHash(get_offload_block_hash(k)))],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=0,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                    group_idx=get_offload_group_idx(k),
                )
                for k in event.keys
            )
            continue
        by_group: dict[int, list[ExternalBlockHash]] = {}
        for k in event.keys:
            by_group.setdefault(get_offload_group_idx(k), []).append(
                maybe_convert_block_hash(BlockHash(get_offload_block_hash(k)))
            )
        out.extend(
            BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group)
            for group, hashes in by_group.items()
        )
    return out
