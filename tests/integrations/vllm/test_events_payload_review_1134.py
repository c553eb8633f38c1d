"""Review of the self-describing KV events (`ChunkPayloads`): a backlog of manager events that
stores a chunk, removes it and stores it again describes the second store too.

`stored` popped the chunk's planned payload, and a later job's plan of the same chunk had
replaced the first job's: translating such a backlog in one go announced the first store
with the second job's payload and the second store bare (its last block hash alone,
`block_size=0`, no tokens), so the chunk's later removal was bare as well. vLLM's scheduler
takes the events after every step, where a chunk's store and its removal never share a
backlog; a caller that takes them less often met it (unless the backlog outgrew
`max_pending_events`, whose merge keeps one store). Real vLLM requests and events; nothing is
mocked.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import make_request
from test_events import PROMPT_A, external

from kvtier.base import OffloadKey, ReqContext, make_offload_key
from kvtier.cpu import CPUOffloadingManager
from kvtier.integrations.vllm.events import ChunkPayloads, to_vllm_events

BLOCKS_PER_CHUNK = 2  # 32-token chunks of 16-token blocks


def store(
    manager: CPUOffloadingManager, payloads: ChunkPayloads, job: int, request: Any, chunk: int
) -> OffloadKey:
    """Plan and complete job `job`, which stores `request`'s chunk `chunk` (one slot, so it
    evicts the chunk held before)."""
    key = make_offload_key(request.block_hashes[(chunk + 1) * BLOCKS_PER_CHUNK - 1], 0)
    ctx = ReqContext(request.request_id)
    out = manager.prepare_store([key], ctx)
    assert out is not None and out.keys_to_store == [key]
    payloads.plan(job, request, [(key, chunk)])
    manager.complete_store([key], ctx)
    return key


def translated(manager: CPUOffloadingManager, payloads: ChunkPayloads) -> list[Any]:
    """vLLM events for every manager event not yet taken, in one go."""
    return to_vllm_events(manager.take_events(), payloads)


def test_a_chunk_stored_again_in_one_backlog_is_described_each_time() -> None:
    request = make_request("a", PROMPT_A, 1)  # four 16-token blocks: two chunks
    manager = CPUOffloadingManager(1, enable_events=True)
    payloads = ChunkPayloads(16, BLOCKS_PER_CHUNK, [("full_attention", None)])
    store(manager, payloads, 1, request, 0)
    store(manager, payloads, 2, request, 1)  # evicts chunk 0
    store(manager, payloads, 3, request, 0)  # evicts chunk 1; chunk 0 is stored again
    events = translated(manager, payloads)
    payloads.forget_ended([])  # every job has ended

    chunk0 = external(list(request.block_hashes[:2]))
    chunk1 = external(list(request.block_hashes[2:4]))
    kinds = [(type(e).__name__, list(e.block_hashes)) for e in events]
    assert kinds == [
        ("BlockStored", chunk0),
        ("BlockRemoved", chunk0),
        ("BlockStored", chunk1),
        ("BlockRemoved", chunk1),
        ("BlockStored", chunk0),
    ]
    again = events[-1]
    assert again.token_ids == PROMPT_A[:32] and again.block_size == 16
    assert again.kv_cache_spec_kind == "full_attention"
    assert len(payloads) == 1  # chunk 0's, held for its removal

    # Its removal names both of its blocks, as its store did.
    store(manager, payloads, 4, request, 1)
    events = translated(manager, payloads)
    kinds = [(type(e).__name__, list(e.block_hashes)) for e in events]
    assert kinds == [("BlockRemoved", chunk0), ("BlockStored", chunk1)]
