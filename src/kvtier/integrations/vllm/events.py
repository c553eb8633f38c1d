"""kvtier's `OffloadingEvent`s as vLLM KV cache events (`BlockStored` / `BlockRemoved`).

vLLM's scheduler drains `KVConnectorBase_V1.take_events()` after every step and publishes the
result next to its own prefix-cache events (`--kv-events-config`). By default the payload is
the one vLLM's `OffloadingConnector` sends by default: per chunk, the block hash that keys it
(the chunk's last device block), the KV-cache group and the medium; no token ids, parent hash
or block size, which the host tier does not keep.

With `self_describing_kv_events` (vLLM's key for the same opt-in) `ChunkPayloads` keeps, for
each chunk stored or being stored, what a consumer needs to index it without the engine: every
block hash of the chunk, the hash of the block before it, its token ids and the block size.
A `BlockRemoved` then names every block hash of the removed chunks.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm import envs
from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import BlockHash, ExternalBlockHash

from kvtier.base import (
    OffloadingEvent,
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request


Convert = Callable[[bytes], ExternalBlockHash]


def _low_64_bits(h: bytes) -> ExternalBlockHash:
    return int.from_bytes(h, "big") & 0xFFFF_FFFF_FFFF_FFFF


def _as_is(h: bytes) -> ExternalBlockHash:
    return BlockHash(h)


def hash_converter() -> Convert:
    """How vLLM publishes a block hash (`maybe_convert_block_hash`): its low 64 bits as an int
    under `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` (the default), else the bytes. The setting is
    read once here: vLLM reads it from the environment on every call, which was about two
    thirds of the time kvtier spent translating events."""
    return _low_64_bits if envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES else _as_is


@dataclass(frozen=True, slots=True)
class ChunkPayload:
    """One chunk's `BlockStored` fields, taken from its request when its store was planned."""

    block_hashes: tuple[ExternalBlockHash, ...]
    parent_block_hash: ExternalBlockHash | None
    # 4 bytes a token, not a list of ints: a full tier holds one payload per slot.
    token_ids: array[int]
    lora_id: int | None
    lora_name: str | None


class ChunkPayloads:
    """Self-describing payloads of the chunks of the host tier, from store to removal.

    `plan` snapshots a chunk from its request when its store job is sent (the request may be
    gone by the time the store completes); `stored` copies it to the chunks held when the
    manager announces the store, `removed` drops the held one when the manager announces the
    removal, and `forget_ended` drops the planned ones once their job has ended.
    """

    def __init__(
        self,
        tokens_per_block: int,
        blocks_per_chunk: int,
        group_kinds: Sequence[tuple[str | None, int | None]],
    ) -> None:
        self.tokens_per_block = tokens_per_block
        self.blocks_per_chunk = blocks_per_chunk
        self.group_kinds = tuple(group_kinds)
        self._convert = hash_converter()
        self._planned: dict[OffloadKey, tuple[int, ChunkPayload]] = {}  # key -> (job, payload)
        self._held: dict[OffloadKey, ChunkPayload] = {}

    def __len__(self) -> int:
        """Payloads kept: chunks held, and chunks of store jobs not yet seen to end."""
        return len(self._planned) + len(self._held)

    def plan(self, job_id: int, request: Request, chunks: Iterable[tuple[OffloadKey, int]]) -> None:
        """Snapshot `(key, chunk index)` of `request` that store job `job_id` writes."""
        bpc, tpb = self.blocks_per_chunk, self.tokens_per_block
        hashes, tokens = request.block_hashes, request.all_token_ids
        lora = request.lora_request
        lora_id, lora_name = (lora.adapter_id, lora.name) if lora is not None else (None, None)
        convert = self._convert
        for key, chunk in chunks:
            first = chunk * bpc
            self._planned[key] = (
                job_id,
                ChunkPayload(
                    block_hashes=tuple(convert(h) for h in hashes[first : first + bpc]),
                    parent_block_hash=convert(hashes[first - 1]) if first else None,
                    token_ids=array("i", tokens[first * tpb : (first + bpc) * tpb]),
                    lora_id=lora_id,
                    lora_name=lora_name,
                ),
            )

    def stored(self, key: OffloadKey, medium: str) -> BlockStored:
        """The `BlockStored` of `key`, described by its payload if it has one; the payload is
        kept for the key's removal."""
        # Left planned until `forget_ended`: events taken less often than every step may hold
        # this store, the chunk's removal and its store again by a later job, whose plan
        # replaced this one (with the same blocks and tokens: the key hashes them).
        entry = self._planned.get(key)
        if entry is None:
            return _bare_stored(key, medium, self._convert)
        payload = self._held[key] = entry[1]
        group = get_offload_group_idx(key)
        kind, window = self.group_kinds[group]
        return BlockStored(
            block_hashes=list(payload.block_hashes),
            parent_block_hash=payload.parent_block_hash,
            token_ids=payload.token_ids.tolist(),
            block_size=self.tokens_per_block,
            lora_id=payload.lora_id,
            medium=medium,
            lora_name=payload.lora_name,
            group_idx=group,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
        )

    def removed(self, key: OffloadKey) -> Sequence[ExternalBlockHash]:
        """Every block hash of `key`'s chunk (its own alone without a payload); the payload
        is dropped."""
        payload = self._held.pop(key, None)
        if payload is None:
            return (self._convert(get_offload_block_hash(key)),)
        return payload.block_hashes

    def forget_ended(self, jobs_in_flight: Iterable[int]) -> None:
        """Drop the planned payloads of store jobs that ended: stored ones are held by now;
        a failed job's, or one a reset outdated, are dropped for good. Call it once the
        manager's events of the ended jobs are taken."""
        planned = self._planned
        if planned:
            live = set(jobs_in_flight)
            for k in [k for k, (job, _) in planned.items() if job not in live]:
                del planned[k]


def _bare_stored(key: OffloadKey, medium: str, convert: Convert) -> BlockStored:
    return BlockStored(
        block_hashes=[convert(get_offload_block_hash(key))],
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=get_offload_group_idx(key),
    )


def to_vllm_events(
    events: Iterable[OffloadingEvent], payloads: ChunkPayloads | None = None
) -> list[KVCacheEvent]:
    """vLLM events for kvtier's manager events, in order: one `BlockStored` per stored chunk,
    one `BlockRemoved` per KV-cache group of each removal.

    Without `payloads` a chunk is announced by its key's block hash alone, as vLLM's
    OffloadingConnector does by default (one hash per event: several would claim a parent
    chain that admission may have broken); with them, by every block hash of the chunk.
    """
    out: list[KVCacheEvent] = []
    convert = hash_converter()
    for event in events:
        medium = event.medium
        if not event.removed:
            if payloads is None:
                out.extend(_bare_stored(k, medium, convert) for k in event.keys)
            else:
                out.extend(payloads.stored(k, medium) for k in event.keys)
            continue
        by_group: dict[int, list[ExternalBlockHash]] = {}
        for k in event.keys:
            hashes = by_group.setdefault(get_offload_group_idx(k), [])
            if payloads is None:
                hashes.append(convert(get_offload_block_hash(k)))
            else:
                hashes.extend(payloads.removed(k))
        out.extend(
            BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group)
            for group, hashes in by_group.items()
        )
    return out
