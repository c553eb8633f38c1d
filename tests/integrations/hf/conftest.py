"""Shared pieces of the HF integration tests: a multi-turn chat run both ways.

Imports of torch and transformers stay inside the functions: a conftest that raised `Skipped`
at import would break collection of the whole suite where transformers is not installed; the
test modules themselves `importorskip` it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

BLOCK_SIZE = 16
NUM_PAGES = 256


@dataclass
class ChatRun:
    """What a multi-turn chat measured, reusing offloaded blocks vs recomputing every turn."""

    max_logit_diff: float = 0.0
    tokens_equal: bool = True
    rebuild_bit_identical: bool = True
    reused_tokens: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    margins: list[Any] = field(default_factory=list)


def blocks_match(cache: Any, pages: list[Any], first: int, end: int, block_size: int) -> bool:
    """Whether page `b` holds block `b`'s KV (row 0) for `first <= b < end`, bit for bit.

    A per-block loop on purpose: a reference independent of the vectorised copy under test.
    Blocks a sliding-window layer no longer holds are skipped for that layer.
    """
    import torch

    for layer, page in zip(cache.layers, pages, strict=True):
        held_from = layer.get_seq_length() - layer.keys.shape[2]
        for b in range(first, end):
            lo = b * block_size - held_from
            if lo < 0:
                continue
            k = layer.keys[0, :, lo : lo + block_size].transpose(0, 1)
            v = layer.values[0, :, lo : lo + block_size].transpose(0, 1)
            if not (torch.equal(page[b, 0], k) and torch.equal(page[b, 1], v)):
                return False
    return True


def run_chat(
    model: Any, turns: int = 5, user_tokens: int = 72, new_tokens: int = 16, seed: int = 1
) -> ChatRun:
    """Chat of `turns` turns; turn k's prompt is all earlier turns (prompts and replies) + new text.

    Each turn runs twice: recompute (full prefill) and reuse (load the blocks stored after
    earlier turns, prefill the rest). After the reuse run its new full blocks go to the pages,
    as an offloading engine would store them. Both copies (cache -> pages after a turn, pages ->
    cache before the next) are checked bit for bit.
    """
    import torch

    from kvtier.integrations.hf.kv_blocks import (
        allocate_pages,
        build_cache_from_blocks,
        extract_blocks,
    )
    from kvtier.integrations.hf.prefix import generate_greedy

    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    pages = allocate_pages(model.config, NUM_PAGES, BLOCK_SIZE)
    ids = torch.empty((1, 0), dtype=torch.int64)
    stored = 0
    run = ChatRun()
    for _ in range(turns):
        ids = torch.cat([ids, torch.randint(0, vocab, (1, user_tokens), generator=gen)], dim=1)
        ref = generate_greedy(model, ids, new_tokens)
        cache = build_cache_from_blocks(
            pages, [list(range(stored))], stored * BLOCK_SIZE, model.config
        )
        if stored:
            run.rebuild_bit_identical &= blocks_match(cache, pages, 0, stored, BLOCK_SIZE)
        out = generate_greedy(model, ids, new_tokens, cache=cache)
        diff = (ref.logits - out.logits).abs().max().item()
        # max() would keep the old value over a NaN difference, and NaN logits would pass.
        run.max_logit_diff = diff if math.isnan(diff) else max(run.max_logit_diff, diff)
        run.tokens_equal &= torch.equal(ref.tokens, out.tokens)
        run.reused_tokens.append(stored * BLOCK_SIZE)
        run.prompt_tokens.append(ids.shape[1])
        top2 = ref.logits[0].topk(2, dim=-1).values
        run.margins.append(top2[:, 0] - top2[:, 1])
        ids = torch.cat([ids, ref.tokens], dim=1)
        full = out.cache.get_seq_length() // BLOCK_SIZE
        extract_blocks(
            out.cache,
            0,
            stored * BLOCK_SIZE,
            full - stored,
            BLOCK_SIZE,
            pages,
            list(range(stored, full)),
        )
        run.rebuild_bit_identical &= blocks_match(out.cache, pages, stored, full, BLOCK_SIZE)
        stored = full
    return run


@pytest.fixture
def chat() -> Callable[..., ChatRun]:
    """`run_chat`, as a fixture so test modules need not import a helper module."""
    return run_chat
