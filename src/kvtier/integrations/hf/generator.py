"""`KVTierGenerator`: greedy generation for transformers models with kvtier as the prefix cache.

Call it instead of `model.generate`. Per prompt: hash its tokens into blocks, ask kvtier's
scheduler half how much of the prefix it holds, load those chunks from the host pool into
consecutive blocks of the generator's paged KV buffer (the "device" KV), prefill only the rest
and generate on a transformers cache that reads and writes those blocks in place
(`paged_cache`), then hand the request's new full blocks to kvtier to store. The stores run in
the background while the next prompt is processed; a prompt that needs a chunk still being
written waits for it.

The paged buffer is one `(2, kv_heads, num_blocks, block_size, head_dim)` tensor per layer,
registered with kvtier's transfer engine; the manager, the connector halves and the transfer
engine are the same objects an engine integration uses. KV is never copied between the buffer
and a separate transformers cache: a store copies from where the model wrote it.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import signal
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import numpy as np
import torch

from kvtier.base import checked_int
from kvtier.config import ConfigError, KVTierConfig
from kvtier.connector import OffloadingScheduler, OffloadingWorker, StepMetadata, StepProgress
from kvtier.cpu import CPUOffloadingManager
from kvtier.hashing import BlockHasher
from kvtier.integrations.hf.paged_cache import PagedKVBuffer
from kvtier.integrations.hf.prefix import (
    check_cache_written,
    check_causal,
    check_decoder_only,
    check_positions,
    generate_greedy,
    input_vocab_size,
    learned_position_rows,
    rope_switch_length,
    stop_ids,
)
from kvtier.transfer import FaultInjector, HostPool, TransferWorker
from kvtier.transfer.factory import transfer_worker_from_config

__all__ = ["GenerationResult", "GeneratorStats", "KVTierGenerator"]

_DEFAULT_SLOTS_PER_BLOCK = 8


@dataclass(frozen=True)
class GenerationResult:
    """One prompt's result: greedy `tokens` (1-D), per-step `logits` `(n, vocab)`, the
    `hit_tokens` loaded from kvtier, the `prefill_tokens` the model ran over, and `ttft_s`, the
    time from the call (or from its turn, after another thread's call) to the first token's
    logits (lookup, load and prefill)."""

    tokens: torch.Tensor
    logits: torch.Tensor
    hit_tokens: int
    prefill_tokens: int
    ttft_s: float


@dataclass
class GeneratorStats:
    """Totals over a generator's lifetime."""

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    prefill_tokens: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    failed_loads: int = 0
    ttft_s: list[float] = field(default_factory=list)

    @property
    def prefix_hit_ratio(self) -> float:
        """Share of prompt tokens whose KV came from kvtier."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


_INT64_MAX = 2**63 - 1


def _unconvertible(prompt: object) -> Exception:
    """The error for a prompt torch cannot make a tensor of: name its first bad id.

    torch's own messages ("Overflow when unpacking long long", "too many dimensions 'str'")
    name neither the id nor its position."""
    if isinstance(prompt, (list, tuple)):
        for i, t in enumerate(prompt):
            try:
                value = None if isinstance(t, bool) else operator.index(t)  # numpy ints too
            except TypeError:
                value = None
            if value is None:
                return TypeError(
                    f"prompt has token id {t!r} at position {i}; expected integer token ids"
                )
            if not 0 <= value <= _INT64_MAX:
                return IndexError(
                    f"token id {value} at position {i} is not in the model's vocabulary; "
                    "expected an id of its input embedding"
                )
    return TypeError(
        f"prompt {prompt!r:.80} is not a list or tensor of token ids; expected one prompt's "
        f"integer token ids{_MAPPING_HINT if isinstance(prompt, Mapping) else ''}"
    )


_MAPPING_HINT = " (for a tokenizer's output, pass its ['input_ids'])"


def _bool_id(items: Sequence[object]) -> tuple[int, object] | None:
    """The position (in the flattened ids) and value of the first bool among a list's ids.

    Nested lists count (a `(1, seq_len)` prompt as `[[5, True]]`), and so do tensors of a bool
    dtype (`[5, torch.tensor(True)]`): torch reads every one of them as an id, 0 or 1."""
    return _scan_bools(items)[1]


def _scan_bools(items: Sequence[object]) -> tuple[int, tuple[int, object] | None]:
    """(ids in `items`, the first bool's position and value or None), for `_bool_id`."""
    if set(map(type, items)) <= {int}:
        return len(items), None  # the common case, at C speed: plain ints only
    pos = 0
    for t in items:
        if isinstance(t, (list, tuple)):
            n, found = _scan_bools(t)
            if found is not None:
                return pos, (pos + found[0], found[1])
            pos += n
        elif isinstance(t, (bool, np.bool_)):
            return pos, (pos, t)
        elif isinstance(t, (torch.Tensor, np.ndarray)):
            if t.dtype in (torch.bool, np.bool_):
                return pos, (pos, t)
            pos += int(t.size if isinstance(t, np.ndarray) else t.numel())
        else:
            pos += 1
    return pos, None


def _prompt_ids(prompt: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """One prompt's token ids as a 1-D int64 CPU tensor (hashing reads them with numpy, and a
    prompt may come on the model's GPU); a (1, seq_len) row counts as one prompt."""
    try:
        ids = torch.as_tensor(prompt)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise _unconvertible(prompt) from None
    if isinstance(prompt, (list, tuple)):
        found = _bool_id(prompt)
        if found is not None:  # torch reads [5, True] as the ids 5, 1
            pos, value = found
            raise TypeError(
                f"prompt has token id {value!r} at position {pos}; expected integer token ids"
            )
    if ids.ndim == 0:
        # generate([5, 7]) would otherwise run each id as a one-token prompt.
        raise ValueError(
            f"prompt is the single token id {prompt!r:.40}; expected one prompt's token ids, "
            "a list or a 1-D or (1, seq_len) tensor"
        )
    if ids.numel() == 0:
        raise ValueError("prompt is empty; expected at least one token id")
    if ids.ndim > 2 or (ids.ndim == 2 and ids.shape[0] != 1):
        # Flattened, a batch would silently run as one prompt: the rows concatenated.
        raise ValueError(
            f"prompt has shape {tuple(ids.shape)}; expected one prompt's token ids, 1-D or "
            "(1, seq_len); for several prompts call generate() with a list of them"
        )
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"prompt has dtype {ids.dtype}; expected integer token ids")
    if ids.device.type == "meta":
        # It has no values to hash or run: torch's "Cannot copy out of meta tensor" names
        # neither the prompt nor what would do.
        raise ValueError(
            "prompt is a tensor on the meta device, which holds no token ids; expected a "
            "tensor on the CPU or the model's device"
        )
    if ids.dtype == torch.uint64:
        # int64 would wrap an id past 2**63 - 1 to a negative one, and name that instead.
        values = ids.reshape(-1).tolist()
        if values and max(values) > _INT64_MAX:
            raise _unconvertible(values)
    return ids.reshape(-1).to(device="cpu", dtype=torch.int64)


def _active_dropout(model: Any) -> str | None:
    """The first module that drops (or jitters) activations at random as the model runs
    now, if any.

    A model built from a config (not `from_pretrained`) is in training mode, and GPT-2's
    dropout (0.1) is then active: its KV would be noise, stored for every later prompt with
    the same prefix to load."""
    if not getattr(model, "training", False):
        return None
    for name, module in model.named_modules():
        if not module.training:
            continue
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            return f"{name} ({type(module).__name__}, p={module.p})"
        # Most models apply dropout functionally, `F.dropout(x, p=self.dropout,
        # training=self.training)`, with the rate a plain float attribute: OPT, XGLM and
        # BioGPT (0.1 by default) have no Dropout module at all; sdpa's `attention_dropout`,
        # MPT's `attn_dropout_p`, BioGPT's `layerdrop` (skips whole layers) likewise. MoE
        # routers jitter their input only in training mode (Mixtral's and MiniMax's
        # `jitter_noise`, DBRX's `moe_jitter_eps`), PhiMoE's also samples its experts.
        for attr, rate in vars(module).items():
            if ("drop" in attr or "jitter" in attr) and isinstance(rate, float) and rate > 0:
                return f"{name or type(module).__name__} ({attr}={rate})"
    # Falcon reads its residual dropout from the config in the forward pass.
    config = getattr(model, "config", None)
    for attr in ("hidden_dropout", "dropout"):
        rate = getattr(config, attr, None)
        if isinstance(rate, float) and rate > 0:
            return f"{type(model).__name__} (config.{attr}={rate})"
    return None


def _check_module(model: object) -> None:
    """Refuse a model that is not a torch module, naming what it is."""
    if not isinstance(model, torch.nn.Module):
        # A model name or a config failed on a bare "has no attribute 'parameters'".
        what = f"a {type(model).__name__}"
        if model is None or isinstance(model, str):  # a config's repr runs to many lines
            what = f"{model!r:.80} (type {type(model).__name__})"
        raise TypeError(
            f"model is {what}; expected a transformers causal LM, a torch.nn.Module (e.g. "
            "AutoModelForCausalLM.from_pretrained(...))"
        )
    # A plain torch module failed on a bare "'Linear' object has no attribute 'config'", one
    # without parameters on a bare StopIteration.
    if getattr(model, "config", None) is None:
        raise TypeError(
            f"model is a {type(model).__name__} without a config: it is not a transformers "
            "model; expected a transformers causal LM (e.g. AutoModelForCausalLM.from_pretrained"
            "(...))"
        )
    if next(model.parameters(), None) is None:
        raise ValueError(
            f"model is a {type(model).__name__} without parameters, so it has no dtype or "
            "device for its KV buffer; expected a transformers causal LM with its weights"
        )


# Config fields that leave every token's K and V as they were: token ids, output switches,
# labels, names and versions; `resize_token_embeddings` grows `vocab_size` and keeps the rows
# there were; the dtype has a check of its own, with a message that names the conversion.
_KV_NEUTRAL_FIELDS = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "architectures",
        "dtype",
        "torch_dtype",
        "finetuning_task",
        "id2label",
        "label2id",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",  # MoE models' router logits, an output switch like the two above
        "prefix",
        "problem_type",
        "return_dict",
        "task_specific_params",
        "tokenizer_class",
        "transformers_version",
        "use_cache",
        "vocab_size",
    }
)


def _kv_config(model: Any) -> dict[str, object]:
    """The model's config fields that decide its KV, as dotted names (sub-configs flattened)."""
    flat: dict[str, object] = {}

    def walk(fields: Mapping[str, Any], prefix: str) -> None:
        for name, value in fields.items():
            if name in _KV_NEUTRAL_FIELDS or str(name).endswith("_token_id"):
                continue
            if isinstance(value, Mapping):
                walk(value, f"{prefix}{name}.")
            else:
                flat[f"{prefix}{name}"] = value

    to_dict = getattr(getattr(model, "config", None), "to_dict", None)
    if callable(to_dict):
        walk(to_dict(), "")
    return flat


def _changes(before: Mapping[str, object], after: Mapping[str, object]) -> str:
    """The first fields that differ, as `name old -> new`, for an error message."""
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))

    def show(fields: Mapping[str, object], name: str) -> str:
        return f"{fields[name]!r:.40}" if name in fields else "unset"

    text = ", ".join(f"{k} {show(before, k)} -> {show(after, k)}" for k in changed[:3])
    return text + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")


def _checkpointing_layer(model: Any) -> str | None:
    """The first layer that gradient checkpointing makes run without the cache, if any (a
    layer checkpoints only in training mode)."""
    for name, module in model.named_modules():
        if module.training and getattr(module, "gradient_checkpointing", False) is True:
            return name or type(module).__name__
    return None


class _HeldInterrupts:
    """Holds SIGINT (Ctrl-C) back while kvtier's bookkeeping runs, and delivers it at the end.

    A KeyboardInterrupt can come between any two bytecodes, for instance as a call that
    planned stores returns and before its result is kept: the stores' keys would then stay
    pending, and a later prompt with that prefix would wait for them forever. In a notebook
    the user goes on after Ctrl-C, so every step of the bookkeeping must happen or not at
    all. Only the main thread receives SIGINT, and only a Python handler raises; elsewhere
    this does nothing. `allowed()` lets it through where waiting is long (the model).
    """

    def __init__(self) -> None:
        self._previous: Any = None
        self._caught: tuple[int, FrameType | None] | None = None

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        if self._caught is None:
            self._caught = (signum, frame)

    def __enter__(self) -> _HeldInterrupts:
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):
                self._previous = previous
                signal.signal(signal.SIGINT, self._hold)
        return self

    def __exit__(self, *exc: object) -> None:
        self._release()

    def _release(self) -> None:
        previous, self._previous = self._previous, None
        if previous is None:
            return
        signal.signal(signal.SIGINT, previous)
        caught, self._caught = self._caught, None
        if caught is not None:
            previous(*caught)  # the default handler raises KeyboardInterrupt here

    @contextlib.contextmanager
    def allowed(self) -> Iterator[None]:
        """Let SIGINT through inside the block (one held so far is delivered now)."""
        previous = self._previous
        try:
            self._release()
            yield
        finally:
            if previous is not None:
                self._previous = previous
                signal.signal(signal.SIGINT, self._hold)


class KVTierGenerator:
    """Greedy generation for a transformers causal LM that reuses offloaded prefix blocks.

    `config` sets the host pool (`cpu_bytes` or `num_slots`; default: room for 8 blocks per
    device block, `8 * max_blocks // blocks_per_chunk` slots), the cache and admission policies,
    the hash and the transfer backend. `max_blocks` device blocks must hold the longest prompt
    plus its reply; twice that lets a prompt start while the previous one's stores still read
    its blocks. `namespace` identifies the model (name, revision, dtype) so two models never
    share blocks. Prompts run one at a time, each on a cache over its own run of consecutive
    blocks. `fault_injector` goes to the transfer worker (tests make transfers fail with it).
    Use as a context manager, or call `close()`.
    A model kvtier cannot serve exactly (not causal, ignoring its cache, recurrent, KV of
    another shape than its config says) is refused here with `ValueError` (docs/hf.md).
    """

    def __init__(
        self,
        model: Any,
        config: KVTierConfig | None = None,
        *,
        block_size: int = 16,
        max_blocks: int = 256,
        namespace: str = "",
        fault_injector: FaultInjector | None = None,
    ) -> None:
        _check_module(model)
        check_decoder_only(model)
        config = config if config is not None else KVTierConfig()
        if not isinstance(config, KVTierConfig):
            # A dict failed later, on a missing attribute, naming neither argument nor fix.
            raise TypeError(
                f"config={config!r} has type {type(config).__name__}; expected a KVTierConfig "
                "(KVTierConfig.from_dict(...) reads a mapping)"
            )
        block_size = checked_int("block_size", block_size)
        max_blocks = checked_int("max_blocks", max_blocks)
        self.model = model
        self.config = config
        self.block_size = block_size
        self.hasher = BlockHasher(block_size, algorithm=config.hash_algorithm, namespace=namespace)
        bpc = config.resolve_blocks_per_chunk(block_size)
        if bpc > max_blocks:
            # A request never holds more than max_blocks blocks, so no chunk would ever fill.
            raise ValueError(
                f"blocks_per_chunk={bpc} (a chunk of {bpc * block_size} tokens) is more than "
                f"the page buffer holds, max_blocks={max_blocks}: no chunk could ever be "
                f"stored; expected max_blocks >= {bpc}"
            )
        device = next(model.parameters()).device
        self._kv = PagedKVBuffer(
            model.config, max_blocks, block_size, dtype=model.dtype, device=device
        )
        self._pages = self._kv.tensors
        # Probes of what the config cannot tell, before any KV exists to store: a block's KV
        # must depend on its prefix only, and the model must write it into the paged cache.
        check_causal(model)
        probe_tokens = min(2, max_blocks * block_size)
        probe_blocks = -(-probe_tokens // block_size)
        try:
            check_cache_written(model, self._kv.cache(0, probe_blocks, 0), probe_tokens)
        finally:
            for t in self._pages:
                t[:, :, :probe_blocks].zero_()  # the buffer starts zeroed, as documented
        self.max_blocks = max_blocks
        registration = self._kv.registration()
        # Built in inference mode, the pool and a copy thread's staging buffers would be
        # inference tensors, which the copy threads (never in inference mode) cannot write.
        with torch.inference_mode(False):
            if config.cpu_bytes is not None:
                slot_bytes = HostPool.slot_bytes_for(registration, bpc)
                if config.cpu_bytes < slot_bytes:
                    # Checked here, not left to HostPool: its error names its own byte_budget.
                    raise ConfigError(
                        f"{config.describe('cpu_bytes')} holds no slot of {slot_bytes} bytes "
                        f"({bpc} blocks x {registration.max_page_bytes} bytes); expected at "
                        f"least {slot_bytes} bytes"
                    )
                self._pool = HostPool(
                    registration, bpc, byte_budget=config.cpu_bytes, pin=config.pin_memory
                )
            else:
                slots = config.num_slots or _DEFAULT_SLOTS_PER_BLOCK * max_blocks // bpc
                self._pool = HostPool(registration, bpc, num_slots=slots, pin=config.pin_memory)
            try:
                # A cache policy of the user's (`package.module:Class`) may raise as it is built.
                self.manager = CPUOffloadingManager.from_config(self._pool.num_slots, config)
                self.scheduler = OffloadingScheduler(
                    self.manager,
                    tokens_per_block=block_size,
                    blocks_per_chunk=bpc,
                    offload_prompt_only=config.offload_prompt_only,
                )
                self._transfer = transfer_worker_from_config(
                    registration, self._pool, config, fault_injector=fault_injector
                )
            except BaseException:
                self._pool.close()  # unpinned now, not whenever the collector gets to it
                raise
        self._worker = OffloadingWorker(self._transfer)
        self.stats = GeneratorStats()
        self._free = np.ones(max_blocks, dtype=bool)
        self._held: dict[str, range] = {}
        self._req_ids = itertools.count()
        self._closed = False
        # One caller at a time: a step's metadata carries every request's unsent loads, so a
        # second thread's request could take another's load and leave it reading its blocks
        # before they are loaded. Reentrant so that `generate` keeps its prompts together.
        self._lock = threading.RLock()
        self._learned_positions = learned_position_rows(model)
        self._rope_switch = rope_switch_length(model)
        self._config_fields = _kv_config(model)

    # -- the memory, until close() releases it --------------------------------------------------

    @property
    def kv(self) -> PagedKVBuffer:
        """The paged buffer the model reads and writes KV in (the device KV)."""
        self._check_open("its KV buffer was released")
        return self._kv

    @property
    def pages(self) -> list[torch.Tensor]:
        """Per layer, `(2, kv_heads, max_blocks, block_size, head_dim)`: the device KV."""
        self._check_open("its KV buffer was released")
        return self._pages

    @property
    def pool(self) -> HostPool:
        """The host pool kvtier stores chunks in."""
        self._check_open("its host pool was released")
        return self._pool

    @property
    def transfer(self) -> TransferWorker:
        """The transfer worker that copies between the pages and the host pool."""
        self._check_open("its transfer worker was released")
        return self._transfer

    @property
    def worker(self) -> OffloadingWorker:
        """kvtier's worker half, over `transfer`."""
        self._check_open("its transfer worker was released")
        return self._worker

    # -- public API ---------------------------------------------------------------------------

    def generate_one(
        self,
        prompt: Sequence[int] | torch.Tensor,
        max_new_tokens: int,
        *,
        stop_token_ids: int | Iterable[int] | None = None,
    ) -> GenerationResult:
        """Generate for one prompt: load its cached prefix, prefill the rest, store new blocks.

        Generation ends after `max_new_tokens` tokens or at the first of `stop_token_ids` (such
        as `model.generation_config.eos_token_id`), which ends the reply. Calls from other
        threads wait for this one to end (prompts run one at a time)."""
        with self._lock:
            return self._generate_one(prompt, max_new_tokens, stop_token_ids)

    def _generate_one(
        self,
        prompt: Sequence[int] | torch.Tensor,
        max_new_tokens: int,
        stop_token_ids: int | Iterable[int] | None,
    ) -> GenerationResult:
        start = time.perf_counter()  # once its turn has come: waiting for a thread is no TTFT
        ids, max_new_tokens, need = self._checked(prompt, max_new_tokens)
        stops = stop_ids(self.model, stop_token_ids)  # before the request is tracked
        # Ctrl-C is held back outside the model's forward passes: see _HeldInterrupts.
        with _HeldInterrupts() as held:
            req_id = f"hf-{next(self._req_ids)}"
            hashes = self.hasher.hash_blocks(ids.numpy())
            scheduler = self.scheduler
            try:
                scheduler.add_request(req_id, hashes, ids.numel())
            except BaseException:
                # The scheduler tracks the request before it tells the cache policy
                # (`on_new_request`), which may raise: end it, or it stays tracked for good.
                # The original error is the one to see: "not tracked" (refused before) or a
                # second error of the policy's is dropped.
                with contextlib.suppress(Exception):
                    scheduler.request_finished(req_id)
                raise
            blocks = range(0)  # none yet
            stores: StepMetadata | None = None
            load: StepMetadata | None = None
            try:
                hit = scheduler.get_num_new_matched_tokens(req_id, 0)
                while hit is None:  # a chunk of this prefix is still being written
                    self._drain()
                    hit = scheduler.get_num_new_matched_tokens(req_id, 0)
                    if hit is None and not scheduler.job_ids_in_flight():
                        # Waiting again would spin forever, with Ctrl-C held back.
                        raise RuntimeError(
                            f"request {req_id}: a chunk of its prefix is pending a write that "
                            "no transfer in flight will complete"
                        )
                blocks = self._allocate(need)
                scheduler.update_state_after_alloc(req_id, [blocks], hit)
                if hit:
                    load = scheduler.build_step_metadata()
                    self._worker.start_step(load)
                    self._worker.wait_for_loads(load)
                    self._collect()
                    if req_id in self._last_failed_loads:
                        hit = 0  # never use the blocks of a failed load: recompute them
                        self.stats.failed_loads += 1
                # The model reads the loaded blocks and writes every new token's KV in place, so
                # the request's blocks hold its whole KV when generation ends: nothing to copy out.
                cache = self._kv.cache(blocks.start, need, hit)
                device = self._pages[0].device
                with held.allowed():  # the model's time: Ctrl-C stops it at once
                    out = generate_greedy(
                        self.model,
                        ids.unsqueeze(0).to(device),
                        max_new_tokens,
                        cache,
                        stop_token_ids=stops,
                    )

                # Offer the request's full blocks to kvtier (reply blocks only if they may be
                # stored).
                held_tokens = int(out.cache.get_seq_length())
                full = held_tokens // self.block_size
                if full > len(hashes) and not self.config.offload_prompt_only:
                    # Continue the chain from the prompt's last full block: only the new blocks
                    # hash.
                    seq = torch.cat([ids, out.tokens[0].cpu()])
                    tail = seq[len(hashes) * self.block_size : full * self.block_size].numpy()
                    hashes.extend(
                        self.hasher.hash_blocks(tail, parent=hashes[-1] if hashes else None)
                    )
                stores = scheduler.build_step_metadata(
                    [StepProgress(req_id, [blocks], held_tokens)]
                )
                self._worker.start_step(stores)
                self._worker.finish_step(stores)
            except BaseException:
                # An error or interrupt anywhere (while waiting for a store, in the load, in the
                # model, while the stores are planned or handed over) ends the request and frees
                # its blocks, at once or when its transfers end. Before the stores are planned
                # nothing is stored. Stores already planned hold reserved slots and pending keys
                # that only their completion releases (a later prompt with this prefix would wait
                # for them forever), so the worker gets every one of them: their KV is complete.
                try:
                    if stores is not None:
                        self._worker.finish_step(stores)  # skips the ones it already has
                finally:
                    self._release(req_id, blocks, (load, stores))
                raise
            ttft = out.first_token_time - start
            self._release(req_id, blocks, (load, stores))
            s = self.stats
            s.requests += 1
            s.prompt_tokens += ids.numel()
            s.hit_tokens += hit
            s.prefill_tokens += out.prefill_tokens
            s.ttft_s.append(ttft)
        return GenerationResult(out.tokens[0], out.logits[0], hit, out.prefill_tokens, ttft)

    def generate(
        self,
        prompts: Iterable[Sequence[int] | torch.Tensor],
        max_new_tokens: int,
        *,
        stop_token_ids: int | Iterable[int] | None = None,
    ) -> list[GenerationResult]:
        """`generate_one` for each prompt in order (a later prompt may reuse an earlier one's).

        Every prompt is checked before the first runs, so a bad one changes nothing; a flat
        list of ids is refused (each id would otherwise run as a one-token prompt)."""
        # Checked once, before the prompts: an empty list of them would otherwise take any
        # max_new_tokens (0, -1, "x"), and a closed generator, without a word.
        self._check_open()
        max_new_tokens = checked_int("max_new_tokens", max_new_tokens)
        stops = stop_ids(self.model, stop_token_ids)
        if isinstance(prompts, torch.Tensor) and prompts.ndim < 2:
            raise ValueError(
                f"prompts is a tensor of shape {tuple(prompts.shape)}; expected a list of "
                "prompts or a (batch, seq_len) tensor (for one prompt call generate_one)"
            )
        if isinstance(prompts, (str, bytes, Mapping)) or not isinstance(prompts, Iterable):
            # `list()` failed on a bare "'NoneType' object is not iterable", and a tokenizer's
            # output (a mapping) ran its keys as prompts: "prompt 'input_ids' is not ...".
            hint = _MAPPING_HINT if isinstance(prompts, Mapping) else ""
            raise TypeError(
                f"prompts is {prompts!r:.60} (type {type(prompts).__name__}); expected a list of "
                f"prompts or a (batch, seq_len) tensor{hint}"
            )
        prompts = list(prompts)  # checked, then run: an iterator would be used up
        with self._lock:  # another thread's prompts wait, and cannot close it in between
            for i, p in enumerate(prompts):
                try:
                    self._checked(p, max_new_tokens)
                except (TypeError, ValueError, IndexError) as e:
                    if type(e) not in (TypeError, ValueError, IndexError):
                        raise  # a subclass may take other arguments: keep it as it is
                    raise type(e)(f"prompts[{i}]: {e}") from None
            return [self.generate_one(p, max_new_tokens, stop_token_ids=stops) for p in prompts]

    def flush(self) -> None:
        """Wait until every store in flight is done (on a closed generator none is)."""
        with self._lock:
            if not self._closed:
                self._drain()

    def close(self) -> None:
        """Finish the stores in flight, stop the transfer worker and release the host pool and
        the KV buffer (their memory goes once no other reference holds it); a closed generator
        refuses to generate, and `stats` stays readable. Closing again does nothing, except
        after a close that was cut short as the worker stopped (Ctrl-C): it then stops the
        worker and releases the memory, as the first would have."""
        with self._lock:  # after a generation in another thread, not in the middle of it
            self._close()

    _released = False
    """Whether `close()` released the worker, the pool and the KV buffer."""

    def _close(self) -> None:
        if self._closed:
            if not self._released:
                # Otherwise nothing could ever stop the worker or unpin the pool: `transfer`
                # and `pool` refuse on a closed generator.
                self._stop_and_release()
            return
        self._closed = True
        try:
            self._drain()
        finally:
            # Also after an error or an interrupt in the drain: the worker reports the jobs it
            # never ran as failed, and once it has stopped no copy can run, so what it still
            # holds is applied and the reports that never came are failed.
            self._stop_and_release()

    def _stop_and_release(self) -> None:
        stopped = False
        try:
            self._transfer.shutdown()
            stopped = True
            try:
                self._collect()
            finally:
                self._fail_lost_reports()
        finally:
            # Kept, and pinned, where the worker did not stop (Ctrl-C in its shutdown): a
            # copy may still run, into memory that must not be handed out again, and the
            # pool refuses to close under it (`HostPool.close`).
            if stopped:
                try:
                    self._pool.close()
                finally:
                    # The pool (GiBs of host memory) and the pages (device memory) would
                    # otherwise live as long as this object: a user who closes it and
                    # builds another holds both. The transfer worker holds them as well.
                    self._released = True  # first: a Ctrl-C in the del leaves no retry to fail
                    del self._worker, self._transfer, self._pool, self._kv, self._pages

    def __enter__(self) -> KVTierGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -----------------------------------------------------------------------------

    def _checked(
        self, prompt: Sequence[int] | torch.Tensor, max_new_tokens: int
    ) -> tuple[torch.Tensor, int, int]:
        """The prompt's ids, `max_new_tokens` and the blocks the request needs, or the error a
        prompt the generator cannot run gets before any work."""
        self._check_open()
        ids = _prompt_ids(prompt)
        dropout = _active_dropout(self.model)
        if dropout is not None:
            raise ValueError(
                f"the model is in training mode and {dropout} makes its activations random: "
                "its KV would not be reproducible, and kvtier would store it for later prompts; "
                "expected model.eval()"
            )
        checkpointed = _checkpointing_layer(self.model)
        if checkpointed is not None:
            # transformers' checkpointed layers then drop `past_key_values`: the model failed
            # later with "ignores past_key_values", which names neither cause nor fix.
            raise ValueError(
                f"the model is in training mode with gradient checkpointing on ({checkpointed}), "
                "so its layers skip the KV cache; expected model.eval() (or "
                "model.gradient_checkpointing_disable())"
            )
        # The page buffer and the host pool were sized for the model's dtype and device when
        # built: after `model.half()` or `.to(...)` the model's KV no longer fits them, and
        # the cache's error told the user to build a buffer they never built.
        dtype, device = self.model.dtype, next(self.model.parameters()).device
        page = self._pages[0]
        if (dtype, device) != (page.dtype, page.device):
            raise ValueError(
                f"the model now runs in {dtype} on {device}, but this generator's KV buffer "
                f"and host pool hold {page.dtype} on {page.device}, as the model was when it "
                "was built; expected a new KVTierGenerator for the converted model"
            )
        # KV stored before a change such as `config.sliding_window = 6` would be served to a
        # model that now computes other KV: logits 5.7 off recompute on a Mistral.
        fields = _kv_config(self.model)
        if fields != self._config_fields:
            raise ValueError(
                "the model's config changed since this generator was built "
                f"({_changes(self._config_fields, fields)}), so its KV is no longer what kvtier "
                "stored; expected a new KVTierGenerator for the changed model (or the config as "
                "it was)"
            )
        if torch.is_autocast_enabled(device.type):
            autocast = torch.get_autocast_dtype(device.type)
            if autocast != page.dtype:
                # Its projections would then give V (and K) in the autocast dtype: the cache
                # refused it mid-prefill, telling the user to build a buffer they never built.
                raise ValueError(
                    f"torch.autocast is on for {device.type} with {autocast}, so the model would "
                    f"compute its KV in {autocast}, but this generator's KV buffer holds "
                    f"{page.dtype}; expected generation outside autocast (or a model converted "
                    f"to {autocast} and a new KVTierGenerator for it)"
                )
        # Read at each call, not once when built: `resize_token_embeddings` after that (new
        # special tokens) had the new ids refused as outside a vocabulary of the old size.
        vocab = input_vocab_size(self.model)
        if vocab is not None and (int(ids.max()) >= vocab or int(ids.min()) < 0):
            # The embedding lookup would fail inside the model: on CUDA a device-side assert
            # that leaves the context unusable, on the CPU an IndexError naming neither.
            pos = int(torch.nonzero((ids >= vocab) | (ids < 0))[0, 0])
            raise IndexError(
                f"token id {int(ids[pos])} at position {pos} is not in the model's vocabulary "
                f"(index out of range of its {vocab}-row input embedding); expected "
                f"0..{vocab - 1}"
            )
        max_new_tokens = checked_int("max_new_tokens", max_new_tokens)
        # The cache ends up holding the prompt and every new token but the last, whose
        # positions are the highest the model runs.
        length = ids.numel() + max_new_tokens - 1
        need = -(-length // self.block_size)
        if need > self.max_blocks:
            raise ValueError(
                f"prompt of {ids.numel()} tokens + {max_new_tokens} new needs {need} blocks; "
                f"the page buffer holds {self.max_blocks}"
            )
        check_positions(self._learned_positions, ids.numel(), max_new_tokens)
        if self._rope_switch is not None and length > self._rope_switch[1]:
            rope_type, limit = self._rope_switch
            # Past it the model recomputes every K at other frequencies: KV loaded from a
            # shorter prompt would not be what recompute gives (and vice versa).
            raise ValueError(
                f"prompt of {ids.numel()} tokens + {max_new_tokens} new runs positions up to "
                f"{length - 1}, past the {limit} at which the model's {rope_type!r} RoPE "
                "changes its frequencies, so its KV would depend on more than its prefix; "
                f"expected prompt + max_new_tokens - 1 <= {limit}"
            )
        return ids, max_new_tokens, need

    def _check_open(self, released: str = "") -> None:
        if self._closed:
            # Its transfer worker is gone: every load and store would fail, one logged error
            # each, and the generator would quietly recompute everything.
            why = f" and {released}" if released and self._released else ""
            raise RuntimeError(f"this KVTierGenerator is closed{why}; create a new one to generate")

    _last_failed_loads: frozenset[str] = frozenset()
    _reports_lost = False

    def _allocate(self, n: int) -> range:
        """`n` consecutive free device blocks (the cache views them as one tensor), the
        lowest run that fits; waits for stores in flight when no run is free."""
        start = self._first_fit(n)
        if start is None and self._held:
            self._drain()  # blocks of finished requests come back when their stores end
            start = self._first_fit(n)
        if start is None:
            raise RuntimeError(
                f"{n} consecutive device blocks needed, {int(self._free.sum())} free of "
                f"{self.max_blocks}"
            )
        self._free[start : start + n] = False
        return range(start, start + n)

    def _release(
        self, req_id: str, blocks: range, steps: Iterable[StepMetadata | None] = ()
    ) -> None:
        """End the request: its blocks are free now, or when its transfers (the jobs of
        `steps`, the request's load and stores) end."""
        held = True
        try:
            held = self.scheduler.request_finished(req_id)
        except BaseException:
            # The scheduler marks the request finished before it calls the cache policy
            # (`touch`, `on_request_finished`), which may raise: it then reports the request
            # in `sending` once its jobs in flight end, and never if none is. Without this,
            # the blocks were never freed, and that report raised KeyError in `_settle`.
            in_flight = set(self.scheduler.job_ids_in_flight())
            jobs = {j.job_id for m in steps if m is not None for j in (*m.loads, *m.stores)}
            held = not in_flight.isdisjoint(jobs)
            raise
        finally:
            if held:
                self._held[req_id] = blocks
            else:
                self._free[blocks.start : blocks.stop] = True
        self._collect()

    def _first_fit(self, n: int) -> int | None:
        edges = np.diff(np.concatenate(([0], self._free.view(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        fits = np.flatnonzero(ends - starts >= n)
        return int(starts[fits[0]]) if fits.size else None

    def _collect(self) -> None:
        # Results taken from the worker and not yet applied would be lost to an interrupt,
        # their jobs in flight forever (flush and close run this outside generate_one).
        with _HeldInterrupts():
            try:
                self.scheduler.on_worker_results(self._worker.get_finished())
            except BaseException:
                # A manager call that raised (a cache policy's) left jobs in flight whose
                # reports the worker has already handed over: `_drain` fails them.
                self._reports_lost = True
                raise
            finally:
                self._settle()

    def _settle(self) -> None:
        """Take the scheduler's finished work: stats, failed loads, blocks held for stores."""
        self.stats.bytes_loaded = self.scheduler.bytes_loaded
        self.stats.bytes_stored = self.scheduler.bytes_stored
        done = self.scheduler.take_finished()
        self._last_failed_loads = frozenset(done.failed_loads)
        for req_id in done.sending:
            blocks = self._held.pop(req_id)
            self._free[blocks.start : blocks.stop] = True

    def _drain(self) -> None:
        self._transfer.wait(self.scheduler.job_ids_in_flight())
        self._collect()
        if self._reports_lost:
            # Every copy has ended and every report the worker held is applied: the jobs still
            # in flight lost theirs. Left there, a store's keys stay pending (a later prompt
            # with the prefix waits forever) and a load's pins and device blocks stay held.
            self._fail_lost_reports()

    def _fail_lost_reports(self) -> None:
        """Fail every job in flight; only once no copy of theirs can still run."""
        with _HeldInterrupts():
            try:
                self.scheduler.fail_unreported()
            finally:
                self._settle()
            self._reports_lost = False
