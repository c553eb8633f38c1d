"""A transformers cache whose K and V live in kvtier's registered paged buffer.

`KVTierGenerator` needs a request's KV in the "device" blocks that kvtier's transfer engine
copies to and from the host pool. A transformers `DynamicCache` keeps KV in tensors of its
own (and reallocates them with `torch.cat` on every step), so going through it costs a copy
out of the paged buffer before a prompt (loaded blocks into the cache) and a copy back after it
(new blocks out of the cache, before kvtier can store them). `PagedKVBuffer` removes both:
its per-layer tensors are laid out so that a run of consecutive blocks *is* a transformers
`(batch=1, kv_heads, tokens, head_dim)` tensor, as a strided view, so the cache layers it hands
out (`PagedKVLayer`) read and write the registered memory directly. Loads land where attention
reads them, prefill and decode write each new token's KV once, in place, and a store copies
straight from there into the host pool.

Layout: one `(2, kv_heads, num_blocks, block_size, head_dim)` tensor per layer (K at 0, V at 1),
registered with the block dimension 2: a block is `2 * kv_heads` pieces of `block_size *
head_dim` values, one per K/V and head. For one head, blocks `b..b+n-1` are then one
contiguous `(n * block_size, head_dim)` run, so a request's K is a `(1, kv_heads, tokens,
head_dim)` view whose every head is contiguous, like a `DynamicCache` tensor. (The "flash"
layout, `(2, num_blocks, block_size, kv_heads, head_dim)`, also gives a view, but with the
heads interleaved token by token; decode attention over it was ~30% slower per call here.)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvtier.base import checked_int
from kvtier.integrations.hf.kv_blocks import kv_layout
from kvtier.transfer import KVCacheRegistration, KVTensor

__all__ = ["BLOCK_DIM", "PagedKVBuffer", "PagedKVLayer"]

BLOCK_DIM = 2
"""The dimension of a `PagedKVBuffer` tensor that indexes blocks."""


class PagedKVLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # untyped upstream
    """One layer of a batch-1 cache whose `keys`/`values` are views of a paged buffer.

    `key_space`/`value_space` are `(1, kv_heads, capacity, head_dim)` views of the blocks the
    request owns; the first `held` tokens already hold KV (loaded from kvtier). `update`
    writes the new tokens' KV after them and returns views of everything written so far, so
    attention sees the same tensors a `DynamicLayer` would build, without any reallocation.
    `crop` (inherited) shortens the views; the next `update` writes from the new end.
    """

    def __init__(self, key_space: torch.Tensor, value_space: torch.Tensor, held: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        if key_space.shape != value_space.shape or key_space.ndim != 4 or key_space.shape[0] != 1:
            raise ValueError(
                f"key_space {tuple(key_space.shape)} and value_space {tuple(value_space.shape)} "
                "must both be (1, kv_heads, capacity, head_dim)"
            )
        if not 0 <= held <= key_space.shape[2]:
            raise ValueError(f"held={held} is invalid; expected 0..{key_space.shape[2]}")
        self._key_space = key_space
        self._value_space = value_space
        self.dtype, self.device = key_space.dtype, key_space.device
        self.keys = key_space[:, :, :held]
        self.values = value_space[:, :, :held]
        self.is_initialized = True

    @property
    def capacity(self) -> int:
        """Tokens the layer's blocks can hold."""
        return int(self._key_space.shape[2])

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the memory is the paged buffer's."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' KV after the held ones; return K and V of all of them."""
        assert self.keys is not None and self.values is not None  # set in __init__
        start = self.keys.shape[2]
        end = start + key_states.shape[2]
        _, heads, _, head_dim = self._key_space.shape
        # `copy_` would broadcast KV of fewer heads (stored as many times over, host bytes
        # included) and fail on another head size with a bare shape error inside the model.
        if (
            key_states.shape[:2] != (1, heads)
            or key_states.shape[3] != head_dim
            or value_states.shape != key_states.shape
            or end > self.capacity
        ):
            raise ValueError(
                f"cannot cache K {tuple(key_states.shape)} and V {tuple(value_states.shape)} "
                f"after {start} tokens: the layer holds one sequence of at most {self.capacity} "
                f"tokens, K and V each (1, {heads}, tokens, {head_dim}) (kv_heads and head_dim "
                "as read from the model's config)"
            )
        # `copy_` would cast (or move) silently, and attention then fail on K/V of another
        # dtype than its queries with a bare error, after the buffer was already written.
        for name, t in (("K", key_states), ("V", value_states)):
            if t.dtype != self.dtype or t.device != self.device:
                raise ValueError(
                    f"cannot cache {name} of {t.dtype} on {t.device} in a buffer of "
                    f"{self.dtype} on {self.device}; expected the model's KV dtype and device "
                    "(PagedKVBuffer(..., dtype=model.dtype, device=<the model's device>))"
                )
        self._key_space[:, :, start:end].copy_(key_states)
        self._value_space[:, :, start:end].copy_(value_states)
        self.keys = self._key_space[:, :, :end]
        self.values = self._value_space[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """Tokens cached so far."""
        assert self.keys is not None
        return int(self.keys.shape[2])

    def reset(self) -> None:
        """Forget every token (the memory stays the request's)."""
        self.keys = self._key_space[:, :, :0]
        self.values = self._value_space[:, :, :0]

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Refused: the layer holds one sequence in fixed memory."""
        raise NotImplementedError("a PagedKVLayer holds one sequence; it cannot grow a batch")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Refused: the layer holds one sequence in fixed memory."""
        raise NotImplementedError("a PagedKVLayer holds one sequence; it cannot select rows")


class PagedKVBuffer:
    """`num_blocks` blocks of `block_size` tokens of KV for every layer of `config`'s model.

    `tensors[layer]` is `(2, kv_heads, num_blocks, block_size, head_dim)`, zero-filled;
    `registration()` describes them to kvtier's transfer engine, and `cache(first, n, held)`
    gives a transformers cache over blocks `first..first+n-1` that already holds `held` tokens.
    """

    def __init__(
        self,
        config: Any,
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        num_blocks = checked_int("num_blocks", num_blocks)
        block_size = checked_int("block_size", block_size)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype={dtype!r} is invalid; expected a floating-point torch dtype")
        layout = kv_layout(config)
        shape = (2, layout.kv_heads, num_blocks, block_size, layout.head_dim)
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Normal tensors even when built in inference mode: inference tensors could never be
        # written outside it again (a later generation's KV, a load by a copy thread).
        with torch.inference_mode(False):
            try:
                self.tensors: list[torch.Tensor] = [
                    torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)
                ]
            except RuntimeError as e:
                if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
                    raise
                # torch's message names a byte count only, not what asked for it.
                nbytes = layout.num_layers * math.prod(shape) * dtype.itemsize
                raise MemoryError(
                    f"cannot allocate the paged KV buffer: num_blocks={num_blocks} blocks of "
                    f"{block_size} tokens x {layout.num_layers} layers is {nbytes} bytes "
                    f"({nbytes / 2**30:,.1f} GiB) of {dtype} on {device}; expected fewer "
                    "blocks (KVTierGenerator's max_blocks)"
                ) from e

    def registration(self) -> KVCacheRegistration:
        """The buffer as kvtier's transfer engine sees it: per layer, blocks along dimension 2.

        A block's host row is, layer after layer, K of each head then V of each head.
        """
        return KVCacheRegistration([KVTensor(t, BLOCK_DIM) for t in self.tensors])

    def cache(self, first_block: int, num_blocks: int, held_tokens: int) -> Cache:
        """A batch-1 cache over blocks `first_block..+num_blocks-1`, holding `held_tokens`.

        The blocks must be consecutive: only then are they one strided tensor that attention
        can read without a copy.
        """
        first_block = checked_int("first_block", first_block, minimum=0)
        num_blocks = checked_int("num_blocks", num_blocks)
        held_tokens = checked_int("held_tokens", held_tokens, minimum=0)
        if first_block < 0 or num_blocks < 1 or first_block + num_blocks > self.num_blocks:
            raise ValueError(
                f"blocks {first_block}..{first_block + num_blocks - 1} are out of range; "
                f"expected within 0..{self.num_blocks - 1}"
            )
        tokens = num_blocks * self.block_size
        if not 0 <= held_tokens <= tokens:
            raise ValueError(f"held_tokens={held_tokens} is invalid; expected 0..{tokens}")
        layers: list[Any] = []
        for t in self.tensors:
            run = t[:, :, first_block : first_block + num_blocks]
            # (2, H, n, bs, D) -> (2, H, n*bs, D) is a view: the run is contiguous per head.
            kv = run.reshape(2, t.shape[1], tokens, t.shape[4])
            layers.append(PagedKVLayer(kv[0:1], kv[1:2], held_tokens))
        return Cache(layers=layers)
