"""A CPU stand-in for a vLLM engine: the real vLLM `Scheduler` with a KV connector, and a
worker loop that runs the worker-side connector on CPU tensors shaped like vLLM's KV cache.

Substitutes for what needs a GPU: the model forward pass writes a deterministic value per
token (from its position and the token ids up to it) into every layer's KV instead of
attention outputs, and samples a fixed token. Everything else is vLLM's own code.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BLOCK_SIZE = 16
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_SIZE = 32
_MODEL_DIR: str | None = None


def tiny_model_dir() -> str:
    """A locally saved tiny Llama config (no weights: the scheduler only reads the config)."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        from transformers import LlamaConfig

        _MODEL_DIR = tempfile.mkdtemp(prefix="kvtier-tiny-llama-")
        LlamaConfig(
            vocab_size=1024,
            hidden_size=NUM_KV_HEADS * 2 * HEAD_SIZE,
            intermediate_size=128,
            num_hidden_layers=NUM_LAYERS,
            num_attention_heads=NUM_KV_HEADS * 2,
            num_key_value_heads=NUM_KV_HEADS,
            max_position_embeddings=4096,
        ).save_pretrained(_MODEL_DIR)
    return _MODEL_DIR


def make_vllm_config(
    connector: str,
    extra: Mapping[str, Any],
    num_gpu_blocks: int,
    module_path: str | None = None,
    max_num_batched_tokens: int = 512,
    load_failure_policy: Literal["recompute", "fail"] = "fail",
    kv_events_config: Any | None = None,
    tensor_parallel_size: int = 1,
) -> Any:
    """A VllmConfig for the tiny model on CPU with the given KV connector (and vLLM's
    `KVEventsConfig`, when given)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model = ModelConfig(
        model=tiny_model_dir(), skip_tokenizer_init=True, dtype="float32", max_model_len=2048
    )
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_gpu_blocks
    sched = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=2048,
        is_encoder_decoder=False,
    )
    transfer = KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path=module_path,
        kv_role="kv_both",
        kv_connector_extra_config=dict(extra),
        kv_load_failure_policy=load_failure_policy,
    )
    return VllmConfig(
        model_config=model,
        cache_config=cache,
        scheduler_config=sched,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
        kv_events_config=kv_events_config,
        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
    )


def make_kv_cache_config(
    num_blocks: int,
    num_groups: int = 1,
    *,
    spec: Any | None = None,
    layer_groups: list[range] | None = None,
) -> Any:
    """`num_groups` full-attention groups splitting the layers between them (several groups
    make a hybrid-style config), each layer its own tensor. `spec` replaces the
    full-attention spec (an RSWASpec, a non-causal one); `layer_groups` gives each group's
    layer indices instead (an empty range: a group whose layers are all on other stages)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    if spec is None:
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=NUM_KV_HEADS,
            head_size=HEAD_SIZE,
            dtype=torch.float32,
        )
    if layer_groups is None:
        layer_groups = [range(g * NUM_LAYERS, (g + 1) * NUM_LAYERS) for g in range(num_groups)]
    names = [[f"model.layers.{i}.self_attn.attn" for i in layers] for layers in layer_groups]
    page = spec.page_size_bytes
    tensors = [
        KVCacheTensor(size=page * num_blocks, layers=[n], layer_stride=0, block_stride=page)
        for group in names
        for n in group
    ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(group, spec) for group in names],
    )


def make_kv_caches(kv_cache_config: Any) -> dict[str, torch.Tensor]:
    """Per-layer CPU tensors in vLLM's LBHNC layout: (num_blocks, heads, tokens, 2*head)."""
    n = kv_cache_config.num_blocks
    return {
        name: torch.zeros(n, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
        for group in kv_cache_config.kv_cache_groups
        for name in group.layer_names
    }


def token_value(tokens: list[int], position: int, layer: int) -> float:
    """What the stand-in forward pass writes for a token: a function of its whole prefix."""
    h = 0
    for t in tokens[: position + 1]:
        h = (h * 1_000_003 + t + 1) % 16_777_213
    return float(h + layer * 7)


def prefix_values(tokens: list[int], n: int) -> list[int]:
    """`token_value` less its layer term for positions 0..n-1, in one pass."""
    out = []
    h = 0
    for t in tokens[:n]:
        h = (h * 1_000_003 + t + 1) % 16_777_213
        out.append(h)
    return out


def assert_computed_kv(
    kv_caches: dict[str, torch.Tensor],
    group_of_layer: dict[str, int],
    table: Sequence[Sequence[int]],
    tokens: list[int],
    n: int,
    what: str,
) -> None:
    """The first `n` positions of a request with `tokens` and device block `table` (per group)
    hold the stand-in forward's KV in every layer; else an AssertionError naming `what` (the
    request), the layer, the position and the block."""
    values = torch.tensor(prefix_values(tokens, n), dtype=torch.float64)
    for name, t in kv_caches.items():
        layer = int(name.split(".")[2])
        want = (values + layer * 7).to(t.dtype)
        blocks = table[group_of_layer[name]]
        for b in range((n + BLOCK_SIZE - 1) // BLOCK_SIZE):
            lo, hi = b * BLOCK_SIZE, min(n, (b + 1) * BLOCK_SIZE)
            ok = t[blocks[b], :, : hi - lo, :] == want[lo:hi].view(1, -1, 1)
            if not bool(ok.all()):
                bad = lo + int((~ok).nonzero()[0][1])
                raise AssertionError(
                    f"{what}: {name} position {bad} of {n} computed (block {blocks[b]}) holds "
                    "wrong KV"
                )


def worker_output(w: Any, finished_req_ids: set[str]) -> Any:
    """What a worker-side connector hands back after a step, as vLLM's model runner collects
    it (`_get_kv_connector_output`): transfer results, load errors and worker metadata."""
    from vllm.v1.outputs import KVConnectorOutput

    res = w.get_transfer_results(finished_req_ids)
    return KVConnectorOutput(
        finished_sending=res.finished_sending,
        finished_recving=res.finished_recving,
        failed_recving=res.failed_recving,
        invalid_block_ids=w.get_block_ids_with_load_errors(),
        kv_connector_worker_meta=w.build_connector_worker_meta(),
    )


def make_request(req_id: str, prompt: list[int], max_tokens: int, **kwargs: Any) -> Any:
    """A vLLM `Request` sampling `max_tokens` tokens (EOS ignored), hashed as the engine does."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(
        req_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
        **kwargs,
    )


def finish_worker_step(w: Any, so: Any, req_ids: list[str], sampled: list[list[int]]) -> Any:
    """The end of a step on the worker side `w` (its `KVConnectorOutput`, then its metadata
    cleared) and the step's `ModelRunnerOutput`."""
    kv = worker_output(w, so.finished_req_ids)
    w.clear_connector_metadata()
    return runner_output(req_ids, sampled, kv)


def runner_output(req_ids: list[str], sampled: list[list[int]], kv: Any) -> Any:
    """The `ModelRunnerOutput` of a step that ran `req_ids`, sampling `sampled[i]` for the
    i-th, with the worker side's `KVConnectorOutput` `kv`."""
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv,
    )


@dataclass
class Engine:
    """The real vLLM Scheduler plus a CPU worker loop around a worker-side connector."""

    scheduler: Any
    worker: Any  # the worker-side connector, or None when built without one
    kv_caches: dict[str, torch.Tensor]
    group_of_layer: dict[str, int]
    finished: set[str] = field(default_factory=set)
    outputs: list[Any] = field(default_factory=list)
    stats: list[Any] = field(default_factory=list)
    """The `SchedulerStats` of every step, as vLLM's engine core hands them to its loggers."""
    sampled_token: int = 7

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 4) -> Any:
        """Add a request with greedy sampling of `max_tokens` tokens."""
        request = make_request(req_id, prompt, max_tokens)
        self.scheduler.add_request(request)
        return request

    def kvtier_worker(self) -> Any:
        """kvtier's worker half: the worker connector's own, or that of the KVTierConnector
        inside a MultiConnector."""
        w = self.worker
        for c in [w, *getattr(w, "sub_connectors", ())]:
            if getattr(c, "worker_side", None) is not None:
                return c.worker_side
        raise AssertionError("no KVTierConnector on the worker side")

    def step(self, settle: bool = True) -> Any:
        """One engine step: schedule, run the worker side, feed the output back.

        `settle` waits for the transfers submitted in earlier steps before collecting results,
        so each job is reported exactly one step after it was submitted (deterministic tests
        on a shared, busy machine); `settle=False` leaves them to the copy thread.
        """
        from vllm.v1.outputs import KVConnectorOutput

        earlier = list(self.kvtier_worker()._jobs) if self.worker is not None else []
        so = self.scheduler.schedule()
        kv_out = KVConnectorOutput()
        if self.worker is not None:
            w = self.worker
            w.bind_connector_metadata(so.kv_connector_metadata)
            w.handle_preemptions(so.kv_connector_metadata)
            w.start_load_kv(None)
        self._forward(so)
        if self.worker is not None:
            w.wait_for_save()
            if settle and earlier:
                self.kvtier_worker().transfer.wait(earlier)
            kv_out = worker_output(w, so.finished_req_ids)
            w.clear_connector_metadata()
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            req = self.scheduler.requests[req_id]
            done_prefill = req.num_computed_tokens >= req.num_tokens
            sampled.append([self.sampled_token] if done_prefill else [])
        out = runner_output(req_ids, sampled, kv_out)
        engine_outputs = self.scheduler.update_from_output(so, out)
        for eo in engine_outputs.values():
            if eo.scheduler_stats is not None:
                self.stats.append(eo.scheduler_stats)
            for o in eo.outputs:
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)
        self.outputs.append(so)
        return so

    def _forward(self, so: Any) -> None:
        # After schedule(), num_computed_tokens already counts this step's tokens.
        if not self.kv_caches:
            return
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            end = req.num_computed_tokens
            tokens = list(req.all_token_ids)
            table = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            for name, t in self.kv_caches.items():
                g = self.group_of_layer[name]
                layer = int(name.split(".")[2])
                for p in range(end - n, end):
                    t[table[g][p // BLOCK_SIZE], :, p % BLOCK_SIZE, :] = token_value(
                        tokens, p, layer
                    )

    def run_until(self, done: Iterable[str], max_steps: int = 400) -> None:
        """Step until every request in `done` finished and no KV transfer is in flight."""
        want = set(done)
        for _ in range(max_steps):
            if want <= self.finished and not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError(f"requests {sorted(want - self.finished)} did not finish")


def step_until_output(engine: Any, request: Any, max_steps: int = 20) -> None:
    """Step `engine` (an `Engine` or the async tests' one) until `request` has sampled a token,
    as after vLLM recomputed a prompt whose load failed."""
    for _ in range(max_steps):
        if request.num_output_tokens:
            return
        engine.step()
    raise AssertionError(f"request {request.request_id} sampled nothing in {max_steps} steps")


def make_engine(
    connector: str,
    extra: Mapping[str, Any],
    *,
    num_gpu_blocks: int = 64,
    num_groups: int = 1,
    module_path: str | None = "kvtier.integrations.vllm",
    with_worker: bool = True,
    max_num_batched_tokens: int = 512,
    load_failure_policy: Literal["recompute", "fail"] = "fail",
    kv_events_config: Any | None = None,
    tensor_parallel_size: int = 1,
    kv_cache_config: Any | None = None,
    configure: Callable[[Any], None] | None = None,
) -> Engine:
    """Build the scheduler (which builds the scheduler-side connector) and a worker-side
    connector with registered CPU KV tensors; `kv_cache_config` replaces the
    `num_groups` full-attention groups that are built by default, and `configure` may
    change the `VllmConfig` before either half is built."""

    vllm_config = make_vllm_config(
        connector,
        extra,
        num_gpu_blocks,
        module_path,
        max_num_batched_tokens,
        load_failure_policy,
        kv_events_config,
        tensor_parallel_size,
    )
    if configure is not None:
        configure(vllm_config)
    if kv_cache_config is None:
        kv_cache_config = make_kv_cache_config(num_gpu_blocks, num_groups)
    scheduler, worker, kv_caches = build_halves(vllm_config, kv_cache_config, with_worker)
    return Engine(scheduler, worker, kv_caches, groups_of_layers(kv_cache_config))


def build_halves(
    vllm_config: Any, kv_cache_config: Any, with_worker: bool = True, scheduler_class: Any = None
) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    """vLLM's scheduler (`scheduler_class`, default `Scheduler`), which builds the scheduler
    side of the configured connector, and the worker side with CPU KV tensors registered
    (None, and no tensors, without `with_worker`)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    scheduler = (scheduler_class or Scheduler)(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )
    worker = None
    kv_caches: dict[str, torch.Tensor] = {}
    if with_worker:
        worker = KVConnectorFactory.create_connector(
            config=vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config
        )
        kv_caches = make_kv_caches(kv_cache_config)
        worker.register_kv_caches(kv_caches)
    return scheduler, worker, kv_caches


def groups_of_layers(kv_cache_config: Any) -> dict[str, int]:
    """Each layer's KV-cache group."""
    return {n: g for g, grp in enumerate(kv_cache_config.kv_cache_groups) for n in grp.layer_names}


class ZeroAfterFence:
    """Wraps a worker connector's `handle_preemptions`: once `armed`, the device KV is zeroed
    right after the next fence, since the blocks a reset freed are fair game from then on."""

    def __init__(self, worker: Any, kv_caches: dict[str, torch.Tensor]) -> None:
        self._handle = worker.handle_preemptions
        self._kv_caches = kv_caches
        self.armed = False
        worker.handle_preemptions = self

    def __call__(self, meta: Any) -> None:
        self._handle(meta)
        if self.armed:
            self.armed = False
            for t in self._kv_caches.values():
                t.zero_()
