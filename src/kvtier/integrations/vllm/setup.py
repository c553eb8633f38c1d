"""What kvtier needs to know about a vLLM engine, read once at start-up from its configs.

Both connector halves build a `VllmSetup` in their constructors, so a bad
`kv_connector_extra_config` key or value fails when the engine starts. Each half reads its own
KV-cache config: vLLM gives the scheduler the first worker's, so a pipeline stage with more
layers than the first computes fewer slots from `cpu_bytes_to_use`, and grows its pool to the
scheduler's count before its first job (`KVTierWorkerSide.fit_pool`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    RSWASpec,
    UniformTypeKVCacheSpecs,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)

from kvtier.config import ConfigError, KVTierConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec


def _layer_pages(kv_cache_config: KVCacheConfig) -> dict[str, int]:
    """Each layer's page bytes as its `KVCacheTensor` places it: the smaller of its strides
    (layer-outer: `block_stride`; block-outer: `layer_stride`), or `block_stride` alone."""
    pages: dict[str, int] = {}
    for t in kv_cache_config.kv_cache_tensors:
        stride = min(t.layer_stride, t.block_stride) if t.layer_stride > 0 else t.block_stride
        for name in t.layers:
            pages[name] = int(stride)
    return pages


def _group_page_bytes(group: KVCacheGroupSpec, layer_pages: dict[str, int]) -> int:
    """Bytes of one device block across the group's layers (vLLM's own page accounting)."""
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return int(spec.page_size_bytes)
    pages = [layer_pages.get(name) for name in group.layer_names]
    if len(set(pages)) > 1 and None not in pages:
        # The scheduler's copy of a group whose layers differ in page size (a worker's
        # UniformTypeKVCacheSpecs): vLLM keeps one layer's spec for it
        # (generate_scheduler_kv_cache_config), so that spec times the layer count would
        # size the host tier for other pages than the workers hold. The tensors still tell.
        return sum(p for p in pages if p is not None)
    return int(spec.page_size_bytes) * len(group.layer_names)


@dataclass(frozen=True, slots=True)
class VllmSetup:
    """kvtier's settings resolved against one vLLM engine.

    `groups` are vLLM's KV-cache group indices (all of them are offloaded), `num_slots` the
    host slots of `blocks_per_chunk` device blocks each, `num_workers` the workers that must
    report every job, `events` whether KV events go to vLLM's publisher, `rswa` whether a
    group is vLLM's `RSWASpec`, whose manager frees a running request's blocks of generated
    tokens once they fall out of its window, `proof_chunks` the chunks after a loaded one that
    must hit too (1 where a group holds EAGLE/MTP drafter layers, whose KV at a position
    depends on the next token; `OffloadingScheduler`). `self_describing` says whether KV
    events carry each chunk's block hashes, parent hash and token ids
    (`self_describing_kv_events`, with `events` on), `group_kinds` each group's KV-cache spec
    kind and sliding window, as vLLM classifies them for those events.
    """

    config: KVTierConfig
    tokens_per_block: int
    blocks_per_chunk: int
    groups: tuple[int, ...]
    page_bytes: tuple[int, ...]
    num_slots: int
    num_workers: int
    num_device_blocks: int
    events: bool = False
    rswa: bool = False
    proof_chunks: int = 0
    self_describing: bool = False
    group_kinds: tuple[tuple[str | None, int | None], ...] = ()

    @property
    def slot_bytes(self) -> int:
        """Host bytes of one slot: a chunk of the group with the largest page."""
        return self.blocks_per_chunk * max(self.page_bytes)


def resolve_setup(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> VllmSetup:
    """Check kvtier's extra config against the engine and size the host tier.

    Raises `ConfigError` (a `ValueError`) naming the key or the engine feature at fault.
    """
    transfer = vllm_config.kv_transfer_config
    extra: dict[str, Any] = dict(transfer.kv_connector_extra_config or {}) if transfer else {}
    config = KVTierConfig.from_vllm_extra_config(extra)
    events = _resolve_events(vllm_config, config, "enable_events" in extra)

    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise ConfigError("the vLLM engine has no KV-cache groups; nothing to offload")
    rswa = False
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        specs = (
            list(spec.kv_cache_specs.values())
            if isinstance(spec, UniformTypeKVCacheSpecs)
            else [spec]
        )
        for layer_spec in specs:
            # A FullAttentionSpec with `sliding_window` or `attention_chunk_size` is a local
            # attention layer that vLLM allocates as full attention (hybrid manager off, or
            # page sizes it cannot unify): every token's KV stays in its blocks, and vLLM's
            # own prefix cache serves those blocks by hash, so kvtier can too.
            if not isinstance(layer_spec, FullAttentionSpec):
                raise ConfigError(
                    f"KV-cache group {index} uses {type(layer_spec).__name__}; kvtier offloads "
                    "groups whose KV vLLM keeps for every token (FullAttentionSpec and its "
                    "subclasses, including sliding-window layers vLLM allocates as full "
                    "attention); sliding-window groups that drop old blocks and Mamba "
                    "layers are not supported yet"
                )
            if layer_spec.non_causal:
                # Prefix-LM layers attend both ways over the prompt: a block's KV depends on
                # the tokens after it, which its block hash does not cover. Serving it to
                # another request with the same prefix would give that request wrong KV.
                raise ConfigError(
                    f"KV-cache group {index} is non-causal ({type(layer_spec).__name__} with "
                    "non_causal=True, Prefix LM attention): a block's KV depends on the tokens "
                    "after it, so its block hash does not identify it, and vLLM turns its own "
                    "prefix caching off for this model; kvtier offloads causal attention only"
                )
            if isinstance(layer_spec, RSWASpec):
                rswa = True
                if not config.offload_prompt_only:
                    # vLLM's RSWAManager frees (and hands to other requests) the blocks of
                    # generated tokens behind the window while the request runs, with no
                    # connector call: a store planned or in flight then reads another
                    # request's KV or the null block, under this request's block hashes.
                    raise ConfigError(
                        f"KV-cache group {index} uses RSWASpec (reference sliding-window "
                        f"attention, rswa_window={layer_spec.rswa_window}) and "
                        "offload_prompt_only=False (from vLLM kv_connector_extra_config): vLLM "
                        "frees a running request's generated-token blocks outside the window, "
                        "so kvtier offloads only the prompt there; expected "
                        "offload_prompt_only=true"
                    )
    block_sizes = {int(g.kv_cache_spec.block_size) for g in groups}
    if len(block_sizes) != 1:
        raise ConfigError(
            f"KV-cache groups have different block sizes {sorted(block_sizes)}; kvtier expects "
            "one device block size for every group"
        )
    tokens_per_block = block_sizes.pop()
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    if dcp != 1:
        raise ConfigError(
            f"decode_context_parallel_size={dcp}: kvtier supports 1 only (blocks of one worker "
            "hold all tokens of a block)"
        )
    _, tokens_per_hash = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    if tokens_per_hash != tokens_per_block:
        # With several KV-cache groups the hash size is vLLM's prefix_match_unit when set (a
        # user's setting, which the message must name), else the groups' common block size.
        unit = vllm_config.cache_config.prefix_match_unit
        cause = (
            f"prefix_match_unit={unit} (vLLM --prefix-match-unit) sets the hashed block; "
            f"expected it unset or {tokens_per_block}"
            if unit is not None and unit != tokens_per_block
            else "expected every KV-cache group to hash its own device blocks"
        )
        raise ConfigError(
            f"vLLM hashes blocks of {tokens_per_hash} tokens but KV blocks hold "
            f"{tokens_per_block}; kvtier needs one block hash per device block: {cause}"
        )
    if config.chunk_tokens is not None and "block_size" in extra:
        blocks, rest = divmod(config.chunk_tokens, tokens_per_block)
        if rest:
            # In vLLM's terms, for vLLM's users (resolve_blocks_per_chunk says it in kvtier's).
            raise ConfigError(
                f"block_size={extra['block_size']!r} (from vLLM kv_connector_extra_config): "
                f"expected a multiple of vLLM's KV block size ({tokens_per_block} tokens), "
                f"such as {(blocks + 1) * tokens_per_block}; or set blocks_per_chunk instead"
            )
    blocks_per_chunk = config.resolve_blocks_per_chunk(tokens_per_block)
    layer_pages = _layer_pages(kv_cache_config)
    page_bytes = tuple(_group_page_bytes(g, layer_pages) for g in groups)
    slot_bytes = blocks_per_chunk * max(page_bytes)
    # A chunk takes one slot in every KV-cache group (it hits only if all groups hold it):
    # fewer slots than groups store nothing, ever, and the engine ran on as if offloading.
    num_groups = len(groups)
    if config.num_slots is not None:
        num_slots = config.num_slots
        if num_slots < num_groups:
            raise ConfigError(
                f"num_slots={extra.get('num_slots', num_slots)!r} (from vLLM "
                f"kv_connector_extra_config) holds no chunk of the engine's {num_groups} "
                f"KV-cache groups (one slot each); expected at least {num_groups}"
            )
    elif config.cpu_bytes is not None:
        # The budget is the engine's, as in vLLM's own offloading: every worker (tensor and
        # pipeline ranks) keeps a pool of num_slots chunks of its own share of the KV, with
        # num_slots the scheduler's (from the first worker's pages; see fit_pool).
        world_size = vllm_config.parallel_config.world_size
        num_slots = config.cpu_bytes // (slot_bytes * world_size)
        if num_slots < num_groups:
            key = "cpu_bytes_to_use" if "cpu_bytes_to_use" in extra else "cpu_bytes"
            per_groups = f" in each of {num_groups} KV-cache groups" if num_groups > 1 else ""
            raise ConfigError(
                f"{key}={extra.get(key, config.cpu_bytes)!r} (from vLLM "
                f"kv_connector_extra_config) holds no chunk of {slot_bytes} bytes "
                f"({blocks_per_chunk} blocks x {max(page_bytes)} bytes){per_groups} on each "
                f"of {world_size} workers; expected at least "
                f"{slot_bytes * num_groups * world_size} bytes"
            )
    else:
        raise ConfigError(
            "kv_connector_extra_config sets neither cpu_bytes_to_use (alias cpu_bytes) nor "
            "num_slots; expected one of them, e.g. {'cpu_bytes_to_use': '64GiB'}"
        )
    return VllmSetup(
        config=config,
        tokens_per_block=tokens_per_block,
        blocks_per_chunk=blocks_per_chunk,
        groups=tuple(range(len(groups))),
        page_bytes=page_bytes,
        num_slots=num_slots,
        num_workers=vllm_config.parallel_config.world_size,
        num_device_blocks=int(kv_cache_config.num_blocks),
        events=events,
        rswa=rswa,
        proof_chunks=_proof_chunks(vllm_config, kv_cache_config),
        # As vLLM's OffloadingConnector: inert without KV events, which would publish nothing.
        self_describing=events and config.self_describing_kv_events,
        group_kinds=tuple(
            (
                get_kv_cache_spec_kind(g.kv_cache_spec).value,
                get_kv_cache_spec_sliding_window(g.kv_cache_spec),
            )
            for g in groups
        ),
    )


def _proof_chunks(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """1 where vLLM drops a prefix hit's last block for drafter groups (EAGLE, EAGLE3, MTP: a
    position's draft KV is built from the token after it), so kvtier drops a load's last chunk
    unless the chunk after it hits too; else 0. As vLLM's own offloading connector does, no
    group flagged as a drafter's (a drafter that shares the target's KV) means nothing to
    protect: the target model verifies every draft, and a hit is not given up for it."""
    spec = vllm_config.speculative_config
    if spec is None or not spec.use_eagle_block_drop():
        return 0
    return int(any(g.is_eagle_group for g in kv_cache_config.kv_cache_groups))


def _resolve_events(vllm_config: VllmConfig, config: KVTierConfig, explicit: bool) -> bool:
    """Whether kvtier emits KV events: it follows vLLM's `--kv-events-config`
    (`enable_kv_cache_events`), and `enable_events` in the extra config can only turn it off,
    since vLLM publishes connector events only when its own events are on."""
    events_config = vllm_config.kv_events_config
    vllm_events = bool(events_config is not None and events_config.enable_kv_cache_events)
    if not explicit:
        return vllm_events
    if config.enable_events and not vllm_events:
        raise ConfigError(
            "enable_events=True (from vLLM kv_connector_extra_config) while vLLM's KV events "
            "are off, so nothing would publish them; expected --kv-events-config "
            '\'{"enable_kv_cache_events": true, "publisher": "zmq"}\' (kvtier then emits '
            "events without this key), or enable_events=false"
        )
    return config.enable_events
