"""Greedy generation that starts from a cache already holding a prompt's prefix.

`generate_greedy(model, input_ids, n, cache=c)` where `c` holds the KV of the first `P`
tokens runs the model over tokens `P..T-1` only, then decodes `n` tokens greedily; with no
cache it is the plain recompute path (full prefill, then greedy). Both paths return every
step's logits so a caller can compare them. Positions are passed explicitly (`P..T-1`), so
RoPE sees the same positions as in a full prefill; no attention mask is passed, which makes
transformers build the plain causal (or sliding-window) mask over cached + new tokens.

Rows of a batch share one cache, so they have the same prompt length and the same cached
prefix length (a transformers cache has one sequence length for all rows). Callers with
ragged prompts run one batch per prompt; `kvtier.integrations.hf.generator` does that.
"""

from __future__ import annotations

import contextlib
import operator
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicSlidingWindowLayer

from kvtier.base import checked_int
from kvtier.integrations.hf.kv_blocks import standalone_decoder_layers

__all__ = [
    "GreedyOutput",
    "check_cache_written",
    "check_causal",
    "check_decoder_only",
    "check_positions",
    "generate_greedy",
    "learned_position_rows",
    "prefill",
    "rope_switch_length",
    "stop_ids",
]


@dataclass(frozen=True)
class GreedyOutput:
    """Result of `generate_greedy`.

    `tokens`: `(batch, n)` greedy choices, `n` = `max_new_tokens` unless every row produced a
    stop token before (then `n` is the step at which the last row did). `logits`: `(batch, n,
    vocab)` float32 logits each choice was the argmax of. `cache`: the KV of the prompt and of
    every generated token but the last (its KV is computed only when a later step feeds it).
    `prefill_tokens`: how many prompt tokens the forward ran over (prompt length minus the
    cached prefix actually used). `lengths`: per row, the tokens up to and including its first
    stop token (`n` for a row without one); a row's tokens after it are the greedy
    continuation that decoding the other rows produced, not part of its answer.
    """

    tokens: torch.Tensor
    logits: torch.Tensor
    cache: Cache
    prefill_tokens: int
    first_token_time: float = 0.0
    """`time.perf_counter()` when the first token's logits were ready (time to first token)."""
    lengths: torch.Tensor | None = None
    """`(batch,)` int64 answer lengths (see above); `None` only in outputs built by hand."""


def _check_ids(model: Any, input_ids: torch.Tensor) -> None:
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.ndim != 2
        or input_ids.shape[0] == 0
        or input_ids.shape[1] == 0
    ):
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)
        raise ValueError(
            f"input_ids is {shape}; expected a (batch, seq_len >= 1) tensor with batch >= 1"
        )
    if input_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"input_ids has dtype {input_ids.dtype}; expected int64 token ids")
    if input_ids.device.type == "meta":
        # No values: the vocabulary check below would fail on a bare `.item()` error.
        raise ValueError(
            "input_ids is a tensor on the meta device, which holds no token ids; expected a "
            "tensor on the model's device"
        )
    vocab = input_vocab_size(model)
    if vocab is not None:
        outside = (input_ids < 0) | (input_ids >= vocab)
        if bool(outside.any()):
            # The embedding lookup would fail inside the model: on CUDA a device-side assert
            # that leaves the context unusable, on the CPU an IndexError naming neither.
            row, pos = (int(i) for i in torch.nonzero(outside)[0])
            raise IndexError(
                f"token id {int(input_ids[row, pos])} at row {row}, position {pos} is not in "
                f"the model's vocabulary (its input embedding has {vocab} rows); expected "
                f"0..{vocab - 1}"
            )


def check_decoder_only(model: Any) -> None:
    """Refuse an encoder-decoder model (T5, `BartForConditionalGeneration`): the prompt would
    go to its encoder and the reply come from its decoder, so no KV of the prompt's tokens
    exists to store by prefix. T5 failed inside its forward on a bare "You must specify
    exactly one of input_ids or inputs_embeds", Bart's generator on "not causal ... needs
    is_decoder=True". Its decoder alone (`BartForCausalLM`) is decoder-only and runs."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) is True:
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder model (config.is_encoder_decoder="
            "True): the prompt would go to its encoder, so there is no per-token KV of the "
            "prompt to reuse; expected a decoder-only causal LM (AutoModelForCausalLM)"
        )


def input_vocab_size(model: Any) -> int | None:
    """Rows of the model's input embedding (the token ids it accepts), if it says."""
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    rows = getattr(embeddings, "num_embeddings", None)
    return rows if isinstance(rows, int) else None


def learned_position_rows(model: Any) -> tuple[str, int] | None:
    """The model's learned absolute position embedding (GPT-2's `wpe`, OPT's
    `embed_positions`) and how many positions it has rows for, if it has one.

    A position past its rows fails inside the model as a bare "index out of range" (on CUDA a
    device-side assert that leaves the context unusable). Rotary and ALiBi models have none."""
    inputs = None
    with contextlib.suppress(AttributeError, NotImplementedError):
        inputs = model.get_input_embeddings()
    # The decoder only: a multimodal model's vision tower has patch position embeddings.
    root = model
    with contextlib.suppress(AttributeError, NotImplementedError, TypeError):
        decoder = model.get_decoder()
        if isinstance(decoder, torch.nn.Module):
            root = decoder
    for name, module in root.named_modules():
        last = name.rsplit(".", 1)[-1]
        if (
            isinstance(module, torch.nn.Embedding)
            and module is not inputs
            and (last == "wpe" or "pos" in last)
        ):
            offset = getattr(module, "offset", 0)  # OPT and BioGPT skip their first 2 rows
            return name, module.num_embeddings - (offset if isinstance(offset, int) else 0)
    return None


def rope_switch_length(model: Any) -> tuple[str, int] | None:
    """A RoPE type whose frequencies change with the sequence length, and the longest
    sequence (highest position + 1) that still runs at the original frequencies.

    transformers' "dynamic" RoPE rescales once a forward pass reaches a position past
    `max_position_embeddings` (and keeps that scale, model state, until a shorter pass), and
    "longrope" switches to its long factors past `original_max_position_embeddings`. Either
    way a token's K depends on the longest position of the pass that computed it, not only on
    its prefix: KV stored from a short prompt is not what a long prompt's prefill computes."""
    found: tuple[str, int] | None = None
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        # One type per layer type (Gemma 3's sliding and full layers) or one for all.
        per_layer = rope_type if isinstance(rope_type, dict) else {None: rope_type}
        config = getattr(module, "config", None) or getattr(model, "config", None)
        params = getattr(config, "rope_parameters", None)
        for layer_type, kind in per_layer.items():
            if kind == "dynamic":
                # Rescales past the length it was built for (its `original_max_seq_len`).
                limit = getattr(module, "original_max_seq_len", None)
                if not isinstance(limit, int):
                    limit = getattr(config, "max_position_embeddings", None)
            elif kind == "longrope":
                # Switches factors past `original_max_position_embeddings` (not past
                # `max_position_embeddings`: longer prompts stay on the long factors).
                p = params.get(layer_type) if layer_type is not None and params else params
                limit = p.get("original_max_position_embeddings") if isinstance(p, dict) else None
            else:
                continue
            if isinstance(limit, int) and (found is None or limit < found[1]):
                found = (kind, limit)
    return found


def check_positions(learned: tuple[str, int] | None, seq_len: int, max_new_tokens: int) -> None:
    """Refuse, before the model runs, positions past a learned position embedding's rows
    (`learned`: what `learned_position_rows` found)."""
    # The last new token is never fed back: positions 0..seq_len + max_new_tokens - 2 run.
    needed = seq_len + max_new_tokens - 1
    if learned is not None and needed > learned[1]:
        name, rows = learned
        raise ValueError(
            f"a prompt of {seq_len} tokens + {max_new_tokens} new runs positions up to "
            f"{needed - 1}, but the model's position embedding {name} has {rows} positions; "
            f"expected prompt + max_new_tokens - 1 <= {rows} (max_position_embeddings)"
        )


def _check_cache_fits(model: Any, cache: Cache, batch: int) -> None:
    """Refuse held KV of another dtype or batch than the run's before the model sees it.

    Another dtype would be promoted silently where the cache concatenates (bf16 pages under a
    float32 model: logits off by ~1e-2 from recompute) or fail inside attention with a bare
    dtype error; another batch fails inside the model as a size mismatch.
    """
    if not isinstance(cache, Cache):
        # A legacy tuple of (K, V) pairs failed on a bare "'tuple' object has no attribute
        # 'layers'".
        raise TypeError(
            f"cache is a {type(cache).__name__}; expected a transformers Cache (a DynamicCache, "
            "build_cache_from_blocks(...) or PagedKVBuffer.cache(...)), or None to recompute"
        )
    model_dtype = getattr(model, "dtype", None)
    for i, layer in enumerate(cache.layers):
        keys = getattr(layer, "keys", None)
        if not isinstance(keys, torch.Tensor) or keys.ndim != 4 or keys.shape[-2] == 0:
            continue  # nothing held (or not plain per-token KV): nothing to mix with
        if isinstance(model_dtype, torch.dtype) and keys.dtype != model_dtype:
            raise ValueError(
                f"cache layer {i} holds {keys.dtype} KV but the model runs in {model_dtype}; "
                f"expected KV of the model's dtype (build the pages or buffer with "
                f"dtype={model_dtype})"
            )
        if keys.shape[0] != batch:
            raise ValueError(
                f"cache layer {i} holds a batch of {keys.shape[0]} sequences but input_ids has "
                f"{batch} rows; expected one cached row per prompt row"
            )


def _cached_length(cache: Cache) -> int | None:
    """Tokens the cache has seen, or None where it cannot say (only recurrent layers)."""
    try:
        return int(cache.get_seq_length())
    except ValueError:
        return None


def _forward(model: Any, ids: torch.Tensor, cache: Cache, start: int) -> torch.Tensor:
    """Run `ids` at positions `start..` on top of `cache`; return the last position's logits.

    Refuses a model that did not write the new tokens' KV into `cache`: it ignores
    `past_key_values` (OpenAI-GPT, XLNet), so each decode step would run without its context
    and the cache would hold no KV to store."""
    before = _cached_length(cache)
    positions = torch.arange(start, start + ids.shape[1], device=ids.device)
    out = model(
        input_ids=ids,
        position_ids=positions.unsqueeze(0).expand(ids.shape[0], -1),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,  # the prompt's other positions' logits are never used
    )
    after = _cached_length(cache)
    if before is not None and after != before + ids.shape[1]:
        raise ValueError(
            f"{type(model).__name__} did not write the KV of {ids.shape[1]} tokens into the "
            f"cache it was given (it held {before} tokens, then {after}): the model ignores "
            "past_key_values, so it has no per-token KV to reuse and would decode without "
            "context; expected a model that supports transformers' KV cache"
        )
    return _logits(model, out)[:, -1, :].float()


def _logits(model: Any, out: Any) -> torch.Tensor:
    """The logits of a forward's output; refuses a model with no language-model head."""
    logits = getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor):
        # A base model (AutoModel, not AutoModelForCausalLM) returns hidden states only: it
        # failed on a bare "'BaseModelOutputWithPast' object has no attribute 'logits'".
        raise ValueError(
            f"{type(model).__name__} returned a {type(out).__name__} without logits: it has no "
            "language-model head to choose tokens with; expected a causal LM (e.g. "
            "AutoModelForCausalLM, not AutoModel)"
        )
    return logits


# Cross-attention reads an encoder's output, which a decoder-only run never passes: it is
# marked is_causal=False but plays no part in whether the decoder's KV is causal.
_CROSS_ATTENTION_NAMES = ("encoder_attn", "crossattention", "cross_attn")


def _marked_non_causal(model: Any) -> str | None:
    """The first self-attention module of the model's decoder marked `is_causal=False`, if
    any: a hint for `check_causal`'s message, not a verdict (BigBirdPegasus's decoder marks
    its self-attention so and is causal through its mask; RoFormer marks nothing and is not)."""
    root = model
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        try:
            decoder = get_decoder()
        except (AttributeError, NotImplementedError, TypeError):
            decoder = None
        if isinstance(decoder, torch.nn.Module):
            root = decoder  # a multimodal model's vision tower is not causal either
    for name, module in root.named_modules():
        if any(part in name for part in _CROSS_ATTENTION_NAMES):
            continue
        if getattr(module, "is_causal", None) is False:
            return f"{name or type(root).__name__} ({type(module).__name__})"
    return None


_PROBE_PREFIX = 6  # tokens before the one the probe changes
_NOISE_ULPS = 32  # see causality_tolerance
_FP32_FLOOR = 1e-4


def _probe_vocab(model: Any) -> int | None:
    vocab = input_vocab_size(model) or getattr(model.config, "vocab_size", None)
    return vocab if isinstance(vocab, int) and vocab >= 2 else None


def _probe_ids(model: Any, rows: int, length: int) -> torch.Tensor | None:
    """Seeded random token ids for a probe, `(rows, length)` on the CPU (None: no vocabulary
    size to draw from); the caller's RNG stream is left as it was."""
    vocab = _probe_vocab(model)
    if vocab is None:
        return None
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(0))


@contextlib.contextmanager
def _eval_mode(model: Any) -> Iterator[None]:
    """Run the model in eval mode, then give every module back its own training flag."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


@torch.no_grad()
def check_cache_written(model: Any, cache: Cache, num_tokens: int = 2) -> None:
    """Refuse a model that does not write its KV into `cache`: one forward of `num_tokens`
    seeded tokens from position 0 (in eval mode) must leave `cache` holding them.

    Catches models that ignore `past_key_values` before any KV is stored, and, on a paged
    cache, models whose KV has another shape than the buffer's (DeepSeek's latent attention,
    per-layer KV heads)."""
    ids = _probe_ids(model, 1, num_tokens)
    if ids is None:
        return
    try:
        with _eval_mode(model):
            _forward(model, ids.to(next(model.parameters()).device), cache, 0)
    except ValueError as e:
        name = type(model).__name__
        if str(e).startswith(name):
            raise
        raise ValueError(f"{name}: {e}") from None


def causality_tolerance(dtype: torch.dtype) -> float:
    """Largest change at earlier positions, relative to the logits' scale, that
    `check_causal` takes for rounding noise in a model computing in `dtype`.

    Both probe runs have the same shape, so a causal model runs the same kernels on the same
    inputs at the probed positions: bit-identical logits there, except where the changed
    token changes how work is split (an MoE routes it to other experts, so their matmuls
    get other shapes: Mixtral and Qwen2-MoE move by ~3 float32 ulps of the largest logit) or
    where GPU reductions use atomics. 32 ulps of `dtype` leave ~10x above that; float32 gets
    at least 1e-4. A non-causal head moves them by 2e-3 (untrained BERT init) to ~0.8:
    always caught in float32; in bfloat16 (tolerance 0.25) only a strong leak is.
    """
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return max(_NOISE_ULPS * eps, _FP32_FLOOR)


@torch.no_grad()
def check_causal(model: Any) -> None:
    """Refuse a model whose logits at a position depend on later tokens.

    Runs the model (no cache) over two token sequences that differ only in their last token
    and compares the logits at the earlier positions. A BERT-style head used as a causal LM
    without `is_decoder=True` attends both ways: its KV for a block would depend on tokens
    after it, which the block's prefix hash does not cover, and another prompt with the same
    prefix would be served KV it never computed. The model's training flags are restored."""
    length = _PROBE_PREFIX + 1
    learned = learned_position_rows(model)
    if learned is not None:
        length = min(length, learned[1])
    vocab = _probe_vocab(model)
    ids = _probe_ids(model, 2, length)
    if vocab is None or ids is None or length < 2:
        return
    ids[1, :-1] = ids[0, :-1]
    ids[1, -1] = (ids[0, -1] + 1 + ids[1, -1] % (vocab - 1)) % vocab  # another last token
    ids = ids.to(next(model.parameters()).device)
    with _eval_mode(model):  # dropout would make the two runs differ by chance
        # One row per forward: rows of one batch may go through differently tiled kernels.
        a, b = (_logits(model, model(input_ids=ids[i : i + 1], use_cache=False)) for i in (0, 1))
    # The coarser of the two precisions: some models upcast their logits to float32.
    model_dtype = getattr(model, "dtype", a.dtype)
    tol = max(causality_tolerance(a.dtype), causality_tolerance(model_dtype))
    first = a[0, :-1].float()
    scale = float(first.abs().max())
    change = float((b[0, :-1].float() - first).abs().max())
    if change > tol * scale or (scale == 0 and change > 0):
        marked = _marked_non_causal(model)
        hint = f" (its attention {marked} is marked is_causal=False)" if marked else ""
        raise ValueError(
            f"{type(model).__name__} is not causal{hint}: changing the last of {length} tokens "
            f"changed the logits at the earlier positions by {change / (scale or 1):.1e} of "
            f"their scale (tolerance {tol:.0e}); kvtier reuses KV by prefix, which only a "
            "causal LM's KV allows; expected a causal LM (a BERT-style model needs "
            "is_decoder=True in its config)"
        )


def _check_can_drop_last(cache: Cache, seq_len: int) -> None:
    """Refuse, before any layer is cropped, a cache that cannot forget its last token."""
    for i, layer in enumerate(cache.layers):
        # Such a layer keeps only the last `window - 1` tokens: after dropping the newest, the
        # oldest key that token attends to is already gone, so it cannot be recomputed.
        if (
            isinstance(layer, DynamicSlidingWindowLayer)
            and not layer.record_past
            and layer.get_seq_length() >= layer.sliding_window
        ):
            raise ValueError(
                f"cache holds the whole prompt ({seq_len} tokens) and its sliding-window layer "
                f"{i} a full window of {layer.sliding_window}, so the last token cannot be "
                f"dropped and recomputed; load at most {seq_len - 1} tokens (e.g. "
                f"build_cache_from_blocks(..., num_tokens={seq_len - 1}, ...))"
            )


@torch.no_grad()
def prefill(
    model: Any, input_ids: torch.Tensor, cache: Cache | None = None
) -> tuple[torch.Tensor, Cache, int]:
    """Run the prompt over whatever `cache` does not hold; return (last logits, cache, tokens run).

    `cache` holds the KV of the first `P` tokens of every row of `input_ids` (`P` =
    `cache.get_seq_length()`); it is extended in place. When it holds the whole prompt the
    last token is dropped from it and recomputed, since its logits are needed to choose the
    first new token; a sliding-window layer that already holds a full window cannot drop it
    (ValueError: load at most `T - 1` tokens). `cache=None` starts a fresh `DynamicCache`
    (the recompute path).
    """
    check_decoder_only(model)
    _check_ids(model, input_ids)
    check_positions(learned_position_rows(model), input_ids.shape[1], 1)
    if cache is None:
        # A cache built from such a config would have the encoder's layer count; one without
        # a config grows a layer per layer the model runs.
        alone = standalone_decoder_layers(model.config) is not None
        cache = DynamicCache() if alone else DynamicCache(config=model.config)
    else:
        _check_cache_fits(model, cache, input_ids.shape[0])
    seq_len = input_ids.shape[1]
    cached = int(cache.get_seq_length())
    if cached > seq_len:
        raise ValueError(
            f"cache holds {cached} tokens but the prompt has {seq_len}; expected a prefix of it"
        )
    if cached == seq_len:
        _check_can_drop_last(cache, seq_len)
        cache.crop(-1)
        cached -= 1
    logits = _forward(model, input_ids[:, cached:], cache, cached)
    return logits, cache, seq_len - cached


@torch.no_grad()
def generate_greedy(
    model: Any,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    cache: Cache | None = None,
    *,
    stop_token_ids: int | Iterable[int] | None = None,
) -> GreedyOutput:
    """Greedy-decode up to `max_new_tokens` tokens after `input_ids`, reusing `cache`'s prefix
    KV.

    With `cache=None` this is the recompute baseline: the same model calls a user makes with
    `model.generate(do_sample=False)`. Its one stopping rule is `stop_token_ids` (such as
    `model.generation_config.eos_token_id`): decoding ends once every row has produced one of
    them, the stop token included in its answer (`GreedyOutput.lengths`); without it, always
    `max_new_tokens`. See `prefill` for what `cache` must hold.
    """
    max_new_tokens = checked_int("max_new_tokens", max_new_tokens)
    check_decoder_only(model)
    _check_ids(model, input_ids)
    stops = stop_ids(model, stop_token_ids)
    check_positions(learned_position_rows(model), input_ids.shape[1], max_new_tokens)
    logits, cache, ran = prefill(model, input_ids, cache)
    if logits.device.type == "cuda":
        # Kernels run asynchronously: without this wait the time would be when the prefill
        # was queued, not when its logits exist (the first `.cpu()` below waits anyway).
        torch.cuda.synchronize(logits.device)
    first_token_time = time.perf_counter()
    batch = input_ids.shape[0]
    tokens = torch.empty((batch, max_new_tokens), dtype=torch.int64, device=input_ids.device)
    steps = torch.empty((batch, max_new_tokens, logits.shape[-1]), dtype=torch.float32)
    lengths = torch.full((batch,), max_new_tokens, dtype=torch.int64)
    stopped = torch.zeros(batch, dtype=torch.bool)
    position = input_ids.shape[1]
    n = max_new_tokens
    for step in range(max_new_tokens):
        steps[:, step] = logits.cpu()
        tokens[:, step] = logits.argmax(dim=-1)
        if stops is not None:
            # The logits were just copied to the host, so this read waits for nothing more.
            now = torch.isin(tokens[:, step].cpu(), stops) & ~stopped
            lengths[now] = step + 1
            stopped |= now
            if bool(stopped.all()):
                n = step + 1  # the last stop token is not fed: nothing needs its KV
                break
        if step + 1 < max_new_tokens:
            logits = _forward(model, tokens[:, step : step + 1], cache, position)
            position += 1
    return GreedyOutput(
        tokens[:, :n], steps[:, :n], cache, ran, first_token_time, lengths.clamp_(max=n)
    )


def stop_ids(model: Any, stop_token_ids: int | Iterable[int] | None) -> torch.Tensor | None:
    """`stop_token_ids` checked, as a 1-D int64 CPU tensor (`None`, or none given: no stop).

    Checked before any forward: an id no token can have would never stop the decoding, which
    would then run silently to `max_new_tokens`."""
    if stop_token_ids is None:
        return None
    one = (
        isinstance(stop_token_ids, (int, str, bytes))
        or (isinstance(stop_token_ids, torch.Tensor) and stop_token_ids.ndim == 0)
        or not isinstance(stop_token_ids, Iterable)
    )
    given: list[Any] = [stop_token_ids] if one else list(cast(Iterable[Any], stop_token_ids))
    vocab = input_vocab_size(model)
    ids: list[int] = []
    for v in given:
        i = -1
        if not isinstance(v, bool) and not (isinstance(v, torch.Tensor) and v.dtype == torch.bool):
            with contextlib.suppress(TypeError, ValueError, RuntimeError):
                i = operator.index(v)  # numpy and 0-d torch integers too
        if i < 0 or (vocab is not None and i >= vocab):
            within = f"0..{vocab - 1}" if vocab is not None else ">= 0"
            raise ValueError(
                f"stop_token_ids has {v!r}; expected token ids ({within}), such as "
                "model.generation_config.eos_token_id"
            )
        ids.append(i)
    return torch.tensor(ids, dtype=torch.int64) if ids else None
