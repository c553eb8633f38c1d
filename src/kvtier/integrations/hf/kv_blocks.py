"""Copy KV between a transformers cache and a paged block buffer.

The paged buffer is the layout the transfer engine registers: one tensor per layer of shape
`(num_blocks, 2, block_size, kv_heads, head_dim)` (K at index 0, V at 1, flashinfer-style).
A transformers cache stores each layer as `keys`/`values` of shape
`(batch, kv_heads, seq_len, head_dim)`. Every copy here is one vectorised torch op per layer
(a reshape + `index_copy_` or a gather), never a Python loop over tokens or blocks.

Supported cache layers: `DynamicLayer` and `StaticLayer` (full attention), and
`DynamicSlidingWindowLayer` for the tokens it still holds. Quantized, indexed (sparse
attention) and linear-attention layers hold no plain per-token KV and are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
    QuantizedLayer,
    StaticIndexedLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)

from kvtier.base import checked_int

__all__ = [
    "KVLayout",
    "allocate_pages",
    "build_cache_from_blocks",
    "extract_blocks",
    "kv_layout",
    "standalone_decoder_layers",
]

# Subclasses first: each of these is-a DynamicLayer/StaticLayer but does not hold plain KV.
_REFUSED_LAYERS: tuple[type, ...] = (
    QuantizedLayer,
    DynamicIndexedLayer,
    StaticIndexedLayer,
    StaticSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
)


class KVLayout:
    """Shape of one model's paged KV: layers, KV heads and head size (from its config)."""

    __slots__ = ("head_dim", "kv_heads", "num_layers")

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int) -> None:
        for name, value in (("num_layers", num_layers), ("kv_heads", kv_heads)):
            if value < 1:
                raise ValueError(f"{name}={value} is invalid; expected a positive int")
        if head_dim < 1:
            raise ValueError(f"head_dim={head_dim} is invalid; expected a positive int")
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim

    def __repr__(self) -> str:
        return (
            f"KVLayout(num_layers={self.num_layers}, kv_heads={self.kv_heads}, "
            f"head_dim={self.head_dim})"
        )

    def page_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        """Shape of one layer's paged buffer holding `num_blocks` blocks of `block_size`."""
        return (num_blocks, 2, block_size, self.kv_heads, self.head_dim)


def _stateful_layer(config: Any) -> str | None:
    """The first decoder layer whose cache is not plain per-token attention KV, if any.

    Hybrid models (Jamba, Bamba, Qwen3-Next, LFM2's conv layers, ...) carry a recurrent or
    convolution state in some layers: it sums up the whole prefix, so no set of per-token
    blocks restores it (and the model fails inside its forward, mid-generation).
    transformers' own `DynamicCache(config=...)` says which layers those are (it builds no
    tensors); a config it cannot read is left to the shape checks."""
    if not hasattr(config, "get_text_config"):
        return None
    try:
        layers = DynamicCache(config=config).layers
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    text = config.get_text_config(decoder=True)
    types = getattr(text, "layer_types", None) or []
    for i, layer in enumerate(layers):
        if isinstance(layer, _REFUSED_LAYERS) or not isinstance(layer, DynamicLayer):
            kind = f"a {types[i]!r} layer, " if i < len(types) else ""
            return f"layer {i} ({kind}cached as {type(layer).__name__})"
    return None


def standalone_decoder_layers(config: Any) -> int | None:
    """The decoder's layer count if `config` is a decoder of an encoder-decoder family run
    alone (`BartForCausalLM`, `BlenderbotForCausalLM`, ...), else None.

    Such a config's generic names (`num_hidden_layers`, `num_attention_heads`) still read the
    encoder's fields, which may differ from the decoder's (Blenderbot: 2 encoder layers, 12
    or 24 decoder layers); transformers' `DynamicCache(config=...)` then has too few layers."""
    attribute_map = getattr(config, "attribute_map", None) or {}
    layers = getattr(config, "decoder_layers", None)
    if (
        attribute_map.get("num_hidden_layers") == "encoder_layers"
        and getattr(config, "is_encoder_decoder", True) is False
        and isinstance(layers, int)
    ):
        return layers
    return None


def _uniform_field(text: Any, field: str) -> Any:
    """`text.<field>`, None if unset; refuses a field whose value differs between layers.

    transformers raises for such a field (Gemma 4's full-attention layers cache a head of
    `global_head_dim`, its sliding ones of `head_dim`) an error that names no fix."""
    try:
        return getattr(text, field, None)
    except RuntimeError as e:  # AmbiguousGlobalPerLayerAttributeError, not in every release
        if "per-layer" not in str(e):
            raise
        raise ValueError(
            f"{type(text).__name__} gives its layers different {field} values: kvtier's "
            "paged buffer holds KV of one shape for every layer (Gemma 4 with global_head_dim "
            f"!= head_dim is one such model); expected a model whose layers share {field}"
        ) from None


def kv_layout(config: Any) -> KVLayout:
    """The paged-KV layout of a decoder-only transformers model, read from its config.

    A model with a layer that holds no plain per-token KV (a recurrent, convolution or linear
    attention layer of a hybrid model, or a recurrent model: RWKV, xLSTM, RecurrentGemma) is
    refused with `ValueError`: its KV blocks alone do not restore a prefix. So is a model
    whose layers cache KV of different shapes (Gemma 4 with `global_head_dim != head_dim`)."""
    stateful = _stateful_layer(config)
    if stateful is not None:
        raise ValueError(
            f"the model's {stateful} holds state other than plain per-token KV (recurrent, "
            "convolution or indexed): no set of KV blocks restores a prefix of it; expected a "
            "model whose every layer is attention (full, sliding-window or chunked)"
        )
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    name = type(text).__name__
    recurrent = [t for t in getattr(text, "block_types", None) or [] if t != "attention"]
    layers_field, heads_field = "num_hidden_layers", "num_attention_heads"
    kv_heads_field = "num_key_value_heads"
    if standalone_decoder_layers(text) is not None:
        layers_field, heads_field = "decoder_layers", "decoder_attention_heads"
        # One KV head per query head; Whisper's `num_key_value_heads` names the encoder's.
        kv_heads_field = heads_field
    heads = _uniform_field(text, heads_field)
    if heads is None or recurrent:
        # RWKV and xLSTM have no attention at all; RecurrentGemma's recurrent blocks keep their
        # state inside the model, outside any cache kvtier could hand it.
        what = f"{recurrent[0]!r} blocks" if recurrent else "no attention heads"
        raise ValueError(
            f"{name} describes a model with {what}: a recurrent state sums up the whole "
            "prefix and there is no plain per-token KV, so no set of KV blocks restores a "
            "prefix of it; expected a model whose every layer is attention (full, "
            "sliding-window or chunked)"
        )
    heads = int(heads)
    kv_heads = _uniform_field(text, kv_heads_field) or heads
    if (
        _uniform_field(text, "num_key_value_heads") is None
        and getattr(text, "multi_query", False) is True
        and not getattr(text, "new_decoder_architecture", False)
    ):
        # Falcon's multi-query layout (Falcon-7B) caches one KV head for all query heads; its
        # config names no KV head count (the new decoder caches one per query head).
        kv_heads = 1
    head_dim = _uniform_field(text, "head_dim") or text.hidden_size // heads
    return KVLayout(int(getattr(text, layers_field)), int(kv_heads), int(head_dim))


def allocate_pages(
    config: Any,
    num_blocks: int,
    block_size: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """Zeroed paged buffers for `config`'s model: `(num_blocks, 2, block_size, H, D)` a layer."""
    num_blocks = checked_int("num_blocks", num_blocks)
    block_size = checked_int("block_size", block_size)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        # As PagedKVBuffer refuses it: int64 pages were built, and refused only later, by
        # `extract_blocks` naming the cache's dtype; a string failed on torch's bare message.
        raise TypeError(f"dtype={dtype!r} is invalid; expected a floating-point torch dtype")
    layout = kv_layout(config)
    shape = layout.page_shape(num_blocks, block_size)
    # Normal tensors even in inference mode: `extract_blocks` outside it could not write them.
    with torch.inference_mode(False):
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)]


def _layer_kv(layer: object, index: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(keys, values, first token held, tokens seen) of one cache layer; refuses exotic layers."""
    if isinstance(layer, _REFUSED_LAYERS) or not isinstance(layer, (DynamicLayer, StaticLayer)):
        raise TypeError(
            f"cache layer {index} is a {type(layer).__name__}; expected a DynamicLayer, "
            "DynamicSlidingWindowLayer or StaticLayer holding plain per-token KV"
        )
    seen = int(layer.get_seq_length())
    if seen == 0:
        empty = torch.empty(0)
        return empty, empty, 0, 0
    keys, values = layer.keys, layer.values
    assert keys is not None and values is not None  # initialised: it has seen tokens
    if isinstance(layer, DynamicSlidingWindowLayer):
        # A sliding layer keeps only its last tokens: the held ones end at `seen`.
        return keys, values, seen - keys.shape[-2], seen
    return keys, values, 0, seen


def _as_ids(block_ids: Sequence[int] | torch.Tensor, what: str) -> torch.Tensor:
    ids = torch.as_tensor(block_ids)
    if ids.ndim != 1 or (ids.numel() > 0 and ids.dtype not in (torch.int32, torch.int64)):
        raise TypeError(
            f"{what} has shape {tuple(ids.shape)} and dtype {ids.dtype}; expected 1-D ints"
        )
    return ids.to(torch.int64)


def _check_pages(pages: Sequence[torch.Tensor], block_size: int | None = None) -> int:
    """Validate per-layer page buffers against each other; return their block size."""
    if len(pages) == 0:
        raise ValueError("pages is empty; expected one paged buffer per layer")
    first = pages[0]
    if first.ndim != 5 or first.shape[1] != 2:
        raise ValueError(
            f"pages[0] has shape {tuple(first.shape)}; "
            "expected (num_blocks, 2, block_size, kv_heads, head_dim)"
        )
    for i, page in enumerate(pages):
        if page.shape != first.shape or page.dtype != first.dtype or page.device != first.device:
            raise ValueError(
                f"pages[{i}] is {tuple(page.shape)} {page.dtype} on {page.device}; expected "
                f"every layer like pages[0]: {tuple(first.shape)} {first.dtype} on {first.device}"
            )
    if block_size is not None and first.shape[2] != block_size:
        raise ValueError(f"pages hold blocks of {first.shape[2]} tokens; block_size={block_size}")
    return int(first.shape[2])


def extract_blocks(
    cache: Cache,
    batch_index: int,
    token_start: int,
    num_blocks: int,
    block_size: int,
    out_pages: Sequence[torch.Tensor],
    out_block_ids: Sequence[int] | torch.Tensor,
) -> None:
    """Copy `num_blocks` full blocks of one sequence's KV from `cache` into paged buffers.

    Block `i` is the tokens `token_start + i * block_size` .. `+ block_size` of sequence
    `batch_index`; it goes to page `out_block_ids[i]` of every layer's `out_pages` tensor
    (shape `(num_pages, 2, block_size, kv_heads, head_dim)`, same dtype as the cache).
    Everything is validated before anything is written: on error the pages are unchanged.
    """
    page_block_size = _check_pages(out_pages, block_size)
    # A float would fail later as a bare slicing error, and True would count as 1.
    batch_index = checked_int("batch_index", batch_index, minimum=0)
    token_start = checked_int("token_start", token_start, minimum=0)
    num_blocks = checked_int("num_blocks", num_blocks, minimum=0)
    ids = _as_ids(out_block_ids, "out_block_ids")
    if num_blocks < 0 or ids.numel() != num_blocks:
        raise ValueError(
            f"out_block_ids has {ids.numel()} entries; expected num_blocks={num_blocks} (>= 0)"
        )
    if num_blocks == 0:
        return
    num_pages = out_pages[0].shape[0]
    if int(ids.min()) < 0 or int(ids.max()) >= num_pages:
        raise ValueError(f"out_block_ids {ids.tolist()} out of range; expected 0..{num_pages - 1}")
    if bool(ids.sort().values.diff().eq(0).any()):
        # index_copy_ with a repeated index writes one of the sources, unspecified which.
        raise ValueError(f"out_block_ids {ids.tolist()} repeats a page; expected distinct ids")
    if len(cache.layers) != len(out_pages):
        raise ValueError(
            f"cache has {len(cache.layers)} layers, out_pages {len(out_pages)}; expected equal"
        )
    token_end = token_start + num_blocks * page_block_size
    sources = []
    for i, layer in enumerate(cache.layers):
        keys, values, held_from, seen = _layer_kv(layer, i)
        if token_start < held_from or token_end > seen:
            raise ValueError(
                f"tokens {token_start}..{token_end} are not in cache layer {i}, which holds "
                f"tokens {held_from}..{seen}"
            )
        if not 0 <= batch_index < keys.shape[0]:
            raise ValueError(
                f"batch_index={batch_index} out of range; the cache's batch is {keys.shape[0]}"
            )
        expected = out_pages[i].shape[2:]
        got = (page_block_size, keys.shape[1], keys.shape[3])
        if tuple(expected) != got or keys.dtype != out_pages[i].dtype:
            raise ValueError(
                f"cache layer {i} is {keys.dtype} with (kv_heads, head_dim)=({keys.shape[1]}, "
                f"{keys.shape[3]}); out_pages[{i}] is {out_pages[i].dtype} {tuple(expected)}"
            )
        if values.shape != keys.shape or values.dtype != keys.dtype:
            # A page holds K and V of one shape: V of another head size (latent attention's)
            # or dtype would fail, or be cast, in the copy, after K was already written.
            raise ValueError(
                f"cache layer {i} holds K {tuple(keys.shape)} {keys.dtype} but V "
                f"{tuple(values.shape)} {values.dtype}; expected V of K's shape and dtype"
            )
        sources.append((keys, values, held_from))
    dev_ids = ids.to(out_pages[0].device)
    for page, (keys, values, held_from) in zip(out_pages, sources, strict=True):
        lo, hi = token_start - held_from, token_end - held_from
        for kv_index, t in enumerate((keys, values)):
            # (H, T, D) -> (H, n, bs, D) -> (n, bs, H, D) as a view: one copy into the pages.
            src = t[batch_index, :, lo:hi].reshape(t.shape[1], num_blocks, page_block_size, -1)
            page[:, kv_index].index_copy_(0, dev_ids, src.permute(1, 2, 0, 3).to(page.device))


def build_cache_from_blocks(
    pages: Sequence[torch.Tensor],
    block_ids_per_sequence: Sequence[Sequence[int]] | torch.Tensor,
    num_tokens: int,
    config: Any = None,
    *,
    device: torch.device | str | None = None,
) -> DynamicCache:
    """A `DynamicCache` holding the first `num_tokens` tokens of each sequence, read from pages.

    Row `b` of the batch is the concatenation of pages `block_ids_per_sequence[b]` (each row
    lists at least `ceil(num_tokens / block_size)` ids; extra ids are ignored). All rows have
    the same cached length: a batch whose sequences have different prefixes cached should
    load the common minimum, or run one cache per sequence. `config` (the model's config)
    makes the cache build sliding-window layers where the model has them, exactly as the
    model's own forward would; `device` defaults to the pages' device.
    """
    block_size = _check_pages(pages)
    # A float would fail later as a bare slicing error, and True would count as one token.
    num_tokens = checked_int("num_tokens", num_tokens, minimum=0)
    if isinstance(block_ids_per_sequence, torch.Tensor):
        rows = block_ids_per_sequence
        if rows.ndim != 2:
            raise ValueError(
                f"block_ids_per_sequence has shape {tuple(rows.shape)}; expected (batch, blocks)"
            )
        if rows.numel() and rows.dtype not in (torch.int32, torch.int64):
            # As a list of rows is checked: a cast would truncate 1.7 to page 1.
            raise TypeError(
                f"block_ids_per_sequence has dtype {rows.dtype}; expected int32 or int64 ids"
            )
        rows = rows.to(torch.int64)
    else:
        if len(block_ids_per_sequence) == 0:
            raise ValueError("block_ids_per_sequence is empty; expected one row per sequence")
        lists = [
            _as_ids(row, f"block_ids_per_sequence[{b}]")
            for b, row in enumerate(block_ids_per_sequence)
        ]
        width = min(r.numel() for r in lists)
        rows = torch.stack([r[:width] for r in lists])
    needed = -(-num_tokens // block_size)
    if num_tokens < 0 or rows.shape[1] < needed:
        raise ValueError(
            f"num_tokens={num_tokens} needs {needed} blocks of {block_size} per sequence; "
            f"block_ids_per_sequence rows hold {rows.shape[1]}"
        )
    rows = rows[:, :needed]
    num_pages = pages[0].shape[0]
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_pages):
        raise ValueError(f"block ids {rows.tolist()} out of range; expected 0..{num_pages - 1}")
    if config is None or standalone_decoder_layers(config) is not None:
        # A decoder of an encoder-decoder family run alone: a cache built from its config
        # would have the encoder's layer count (too few layers fail inside the model, too
        # many make `extract_blocks` refuse the cache), so it grows a layer per layer run.
        cache = DynamicCache()
    else:
        cache = DynamicCache(config=config)
        if cache.layers and len(cache.layers) != len(pages):
            # Too few would fail inside the model's forward as a bare size mismatch; too many
            # would index past the cache's layers.
            raise ValueError(
                f"pages holds {len(pages)} layers; the model's cache has {len(cache.layers)} "
                f"({type(config).__name__}); expected one page buffer per cache layer"
            )
    if num_tokens == 0:
        return cache
    target = pages[0].device if device is None else torch.device(device)
    batch = rows.shape[0]
    index = rows.reshape(-1).to(pages[0].device)
    for layer_idx, page in enumerate(pages):
        # (B*n, 2, bs, H, D) -> (B, 2, H, n*bs, D): one gather and one copy per layer.
        kv = page.index_select(0, index).reshape(batch, needed, *page.shape[1:])
        kv = kv.permute(0, 2, 4, 1, 3, 5).flatten(3, 4)[:, :, :, :num_tokens]
        kv = kv.to(target).contiguous()
        cache.update(kv[:, 0], kv[:, 1], layer_idx)
    return cache
