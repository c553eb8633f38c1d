"""Small synthetic traces shared by the simulator tests."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.base import OffloadKey, make_offload_key
from kvtier.sim.trace import Request, Trace

BLOCK_TOKENS = 4


def key(i: int) -> OffloadKey:
    """The key the Mooncake reader gives hash id `i`."""
    return make_offload_key(i.to_bytes(8, "big"), 0)


def random_trace(seed: int, num_requests: int = 60, max_blocks: int = 8) -> Trace:
    """Conversations that grow and share a system prompt, so prefixes repeat and diverge.

    Ids are chained as in Mooncake: a request continues a random earlier request's prefix
    for a random number of blocks, then adds fresh blocks.
    """
    rng = random.Random(seed)
    next_id = 1
    history: list[list[int]] = []
    requests = []
    for n in range(num_requests):
        if history and rng.random() < 0.7:
            base = rng.choice(history)
            ids = base[: rng.randint(1, len(base))]
        else:
            ids = [0]
        for _ in range(rng.randint(0, max_blocks - len(ids))):
            ids.append(next_id)
            next_id += 1
        history.append(ids)
        length = (len(ids) - 1) * BLOCK_TOKENS + rng.randint(1, BLOCK_TOKENS)
        requests.append(Request(f"r{n}", [key(i) for i in ids], length, BLOCK_TOKENS))
    return Trace(requests, name=f"random-{seed}")


def write_mooncake(path: Path, rows: list[dict[str, object]]) -> Path:
    """Write `rows` as a JSONL trace file."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def make_trace() -> Callable[..., Trace]:
    """`random_trace` as a fixture (test modules cannot import conftest by name)."""
    return random_trace


@pytest.fixture
def trace_file() -> Callable[[Path, list[dict[str, object]]], Path]:
    """`write_mooncake` as a fixture."""
    return write_mooncake
