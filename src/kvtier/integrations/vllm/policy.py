"""kvtier's cache policies inside vLLM's own `OffloadingConnector` (vLLM's `CachePolicy`).

vLLM resolves `eviction_policy` in its registry first, then as a class of the module named by
`cache_policy_module_path`. This module answers `kvtier_<name>` for every kvtier policy::

    "kv_connector_extra_config": {"cpu_bytes_to_use": "64GiB",
        "cache_policy_module_path": "kvtier.integrations.vllm.policy",
        "eviction_policy": "kvtier_arc"}

vLLM's manager keeps ref counts in its `ChunkStatus` objects and tells the policy when a chunk
becomes evictable or not; the adapter maps that onto kvtier's insert / pin / unpin, so the
kvtier policy orders exactly the evictable chunks, as it does under kvtier's own manager.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import OffloadKey as VOffloadKey
from vllm.v1.kv_offload.base import ReqContext as VReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy as VCachePolicy
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

from kvtier.base import OffloadKey, ReqContext
from kvtier.policies import CachePolicy, get_policy_cls, registered_policies

PREFIX = "kvtier_"
"""`eviction_policy` names this module answers: `kvtier_` + a kvtier policy name."""


def _ctx(vctx: VReqContext) -> ReqContext:
    """kvtier's view of a vLLM request context, made once per request and kept in it."""
    ctx = vctx.get_state(ReqContext)
    if ctx is None:
        # Share vLLM's key -> end-token map, so positions recorded later are seen too.
        positions: dict[OffloadKey, int] = getattr(vctx, "_offload_key_positions", {})
        ctx = ReqContext(vctx.req_id, vctx.kv_transfer_params, positions)
        vctx.set_state(ctx)
    return ctx


class KVTierPolicyAdapter(VCachePolicy):
    """A kvtier `CachePolicy` behind vLLM's `CachePolicy` interface. Subclasses set `policy`."""

    policy: ClassVar[type[CachePolicy]]

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.inner: CachePolicy = self.policy(cache_capacity)
        self.chunks: dict[VOffloadKey, ChunkStatus] = {}
        # Chunks being written: they enter the kvtier policy when their store completes.
        self._pending: dict[VOffloadKey, ReqContext] = {}
        # Resident chunks a live request accessed -> its context. vLLM's mark_evictable names
        # no request; the unpin of a load is then that request's use, which its end-of-request
        # touch does not count again (kvaware counts a chunk once per request).
        self._readers: dict[VOffloadKey, ReqContext] = {}

    def get(self, key: VOffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: VOffloadKey, chunk: ChunkStatus, req_context: VReqContext) -> None:
        self.chunks[key] = chunk
        if chunk.ref_cnt == 0:
            self.inner.insert([OffloadKey(key)], _ctx(req_context))
        else:
            self._pending[key] = _ctx(req_context)

    def remove(self, key: VOffloadKey) -> None:
        del self.chunks[key]
        self._readers.pop(key, None)
        if self._pending.pop(key, None) is None:
            self.inner.remove([OffloadKey(key)])

    def touch(self, keys: Iterable[VOffloadKey], req_context: VReqContext) -> None:
        self.inner.touch([OffloadKey(k) for k in keys], _ctx(req_context))

    def on_store_miss(self, keys: Iterable[VOffloadKey], req_context: VReqContext) -> None:
        """kvtier policies learn from ghost hits when a key is inserted, not here."""

    def on_request_access(self, keys: Iterable[VOffloadKey], req_context: VReqContext) -> None:
        chunks, readers, ctx = self.chunks, self._readers, _ctx(req_context)
        for k in keys:
            if k in chunks:
                readers[k] = ctx

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[VOffloadKey]],
        insertion_only_keys: set[VOffloadKey],
        reused_keys: set[VOffloadKey],
        req_context: VReqContext,
    ) -> None:
        # vLLM reports a request's reuses only here (it never calls `touch`): chunks it
        # loaded, and chunks it hit in the device prefix cache and offered again. Touch them
        # as kvtier's own connector does at a request's end (head last, so most recent), or a
        # prefix served from the device cache would age as if never used.
        ctx = _ctx(req_context)
        if reused_keys:
            for keys in key_groups:
                used = [OffloadKey(k) for k in keys if k in reused_keys]
                if used:
                    self.inner.touch(used, ctx)
        readers = self._readers
        for keys in key_groups:
            for k in keys:
                if readers.get(k) is ctx:
                    del readers[k]
        self.inner.on_request_finished(ctx)

    def evict(
        self, n: int, protected: set[VOffloadKey]
    ) -> list[tuple[VOffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []
        victims = self.inner.evict(n, protected)  # type: ignore[arg-type]
        if victims is None:
            return None
        for k in victims:
            self._readers.pop(VOffloadKey(k), None)
        return [(VOffloadKey(k), self.chunks.pop(VOffloadKey(k))) for k in victims]

    def clear(self) -> None:
        self.chunks.clear()
        self._pending.clear()
        self._readers.clear()
        self.inner.clear()

    def mark_evictable(self, key: VOffloadKey) -> None:
        ctx = self._pending.pop(key, None)
        if ctx is not None:
            self.inner.insert([OffloadKey(key)], ctx)  # store completed
        else:
            # Last load completed: a use by the request that read it, where known.
            self.inner.unpin([OffloadKey(key)], self._readers.get(key))

    def mark_non_evictable(self, key: VOffloadKey) -> None:
        self.inner.pin([OffloadKey(key)])


_ADAPTERS: dict[str, type[KVTierPolicyAdapter]] = {}


def vllm_policy_class(name: str) -> type[KVTierPolicyAdapter]:
    """vLLM `CachePolicy` class for the kvtier policy `name` (a registered name or
    'package.module:Class'). Raises ValueError for an unknown policy."""
    cls = _ADAPTERS.get(name)
    if cls is None:
        inner = get_policy_cls(name)
        cls = type(
            f"{PREFIX}{inner.name or inner.__name__}",
            (KVTierPolicyAdapter,),
            {"policy": inner, "__doc__": f"kvtier's {name!r} policy for vLLM: {inner.__doc__}"},
        )
        _ADAPTERS[name] = cls
    return cls


def __getattr__(attr: str) -> Any:
    # vLLM does getattr(module, eviction_policy); answer kvtier_<registered policy>.
    if attr.startswith(PREFIX) and attr[len(PREFIX) :] in registered_policies():
        return vllm_policy_class(attr[len(PREFIX) :])
    raise AttributeError(
        f"module {__name__!r} has no attribute {attr!r}; kvtier policies are named "
        + ", ".join(PREFIX + n for n in registered_policies())
    )
