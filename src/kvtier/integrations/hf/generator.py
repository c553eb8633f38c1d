"""Draft `KVTierGenerator`: greedy generation that loads a prompt's offloaded prefix blocks.

Per prompt: hash its tokens into blocks (`BlockHasher`), ask the block store how many leading
blocks it holds, load those into the generator's page buffer, build a cache from them,
prefill only the rest, generate, then store the request's new full blocks. The page buffer
plays the engine's device KV (one `(num_blocks, 2, block_size, H, D)` tensor per layer, the
layout the transfer engine registers); the `BlockStore` moves blocks between it and wherever
offloaded blocks live. Wiring kvtier's connector means implementing `BlockStore` on top of it
(lookup -> manager lookup, load -> submit_load + wait, store -> submit_store).

`InProcessBlockStore` is TEST SCAFFOLDING: a dict standing in for the connector so the
generator can be tested now. It has no capacity limit, no eviction and no tiers; it is not the
product.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvtier.base import OffloadKey
from kvtier.hashing import BlockHasher, chunk_keys
from kvtier.integrations.hf.kv_blocks import allocate_pages, build_cache_from_blocks, extract_blocks
from kvtier.integrations.hf.prefix import generate_greedy

__all__ = ["BlockStore", "GenerationResult", "InProcessBlockStore", "KVTierGenerator"]


class BlockStore(Protocol):
    """Offloaded KV blocks by key, moved to and from the generator's page buffer."""

    def lookup(self, keys: Sequence[OffloadKey]) -> int:
        """How many of `keys`, from the first, can be loaded now (stops at the first miss)."""
        ...

    def load(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        """Copy the blocks of `keys` into pages `block_ids`; done when this returns."""
        ...

    def store(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        """Offload pages `block_ids` under `keys` (the store may drop some: it is a cache)."""
        ...


class InProcessBlockStore:
    """TEST SCAFFOLDING, not the product: an unbounded dict of key -> per-layer block copies."""

    def __init__(self, pages: Sequence[torch.Tensor]) -> None:
        self.pages = list(pages)
        self.blocks: dict[OffloadKey, list[torch.Tensor]] = {}

    def lookup(self, keys: Sequence[OffloadKey]) -> int:
        """Number of leading `keys` held."""
        for i, key in enumerate(keys):
            if key not in self.blocks:
                return i
        return len(keys)

    def load(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        """Copy held blocks into pages; `KeyError` names a key that is not held."""
        missing = [k.hex() for k in keys if k not in self.blocks]
        if missing:
            raise KeyError(f"keys not held: {missing}")
        ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
        for layer, page in enumerate(self.pages):
            page.index_copy_(0, ids, torch.stack([self.blocks[k][layer] for k in keys]))

    def store(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        """Copy pages into the dict under `keys`."""
        for key, block in zip(keys, block_ids, strict=True):
            self.blocks[key] = [page[block].clone() for page in self.pages]


@dataclass(frozen=True)
class GenerationResult:
    """One prompt's result: greedy `tokens` (1-D), per-step `logits` `(n, vocab)`,
    `hit_tokens` loaded from the store, `prefill_tokens` the model actually ran over."""

    tokens: torch.Tensor
    logits: torch.Tensor
    hit_tokens: int
    prefill_tokens: int


class KVTierGenerator:
    """Greedy generation for a transformers causal LM that reuses offloaded prefix blocks.

    `pages` defaults to a fresh buffer of `max_blocks` blocks (enough for the longest prompt
    plus its reply). `namespace` identifies the model (name, revision) so two models never
    share blocks. Prompts run one at a time, each on its own cache.
    """

    def __init__(
        self,
        model: Any,
        store: BlockStore | None = None,
        *,
        block_size: int = 16,
        max_blocks: int = 256,
        namespace: str = "",
        pages: Sequence[torch.Tensor] | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.hasher = BlockHasher(block_size, namespace=namespace)
        self.pages = (
            list(pages)
            if pages is not None
            else allocate_pages(model.config, max_blocks, block_size, dtype=model.dtype)
        )
        self.max_blocks = int(self.pages[0].shape[0])
        self.store: BlockStore = store if store is not None else InProcessBlockStore(self.pages)

    def _keys(self, tokens: torch.Tensor) -> list[OffloadKey]:
        return chunk_keys(self.hasher.hash_blocks(tokens.cpu().numpy()), 1)

    def generate_one(
        self, prompt: Sequence[int] | torch.Tensor, max_new_tokens: int
    ) -> GenerationResult:
        """Generate for one prompt: load its cached prefix, prefill the rest, store new blocks."""
        ids = torch.as_tensor(prompt, dtype=torch.int64).reshape(-1)
        # The cache ends up holding prompt + all new tokens but the last.
        total_blocks = (ids.numel() + max_new_tokens - 1) // self.block_size
        if total_blocks > self.max_blocks:
            raise ValueError(
                f"prompt of {ids.numel()} tokens + {max_new_tokens} new needs {total_blocks} "
                f"blocks; the page buffer holds {self.max_blocks}"
            )
        keys = self._keys(ids)
        hit = self.store.lookup(keys)
        if hit:
            self.store.load(keys[:hit], range(hit))
        device = next(self.model.parameters()).device
        cache = build_cache_from_blocks(
            self.pages, [list(range(hit))], hit * self.block_size, self.model.config, device=device
        )
        out = generate_greedy(self.model, ids.unsqueeze(0).to(device), max_new_tokens, cache=cache)
        seq = torch.cat([ids, out.tokens[0].cpu()])
        full = int(out.cache.get_seq_length()) // self.block_size
        if full > hit:
            all_keys = self._keys(seq[: full * self.block_size])
            first = hit * self.block_size
            extract_blocks(
                out.cache, 0, first, full - hit, self.block_size, self.pages, range(hit, full)
            )
            self.store.store(all_keys[hit:full], range(hit, full))
        return GenerationResult(
            tokens=out.tokens[0],
            logits=out.logits[0],
            hit_tokens=hit * self.block_size,
            prefill_tokens=out.prefill_tokens,
        )

    def generate(
        self, prompts: Sequence[Sequence[int] | torch.Tensor], max_new_tokens: int
    ) -> list[GenerationResult]:
        """`generate_one` for each prompt in order (a later prompt may reuse an earlier one's)."""
        return [self.generate_one(p, max_new_tokens) for p in prompts]
