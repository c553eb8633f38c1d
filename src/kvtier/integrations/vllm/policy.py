"""kvtier's cache policies inside vLLM's own `OffloadingConnector` (vLLM's `CachePolicy`).

vLLM resolves `eviction_policy` in its registry first, then as a class of the module named by
`cache_policy_module_path`. This module answers `kvtier_<name>` for every kvtier policy
(vLLM's connector reads `cpu_bytes_to_use` as a plain number of bytes, here 64 GiB)::

    "kv_connector_extra_config": {"cpu_bytes_to_use": 68719476736,
        "cache_policy_module_path": "kvtier.integrations.vllm.policy",
        "eviction_policy": "kvtier_arc"}

vLLM's manager keeps ref counts in its `ChunkStatus` objects and tells the policy when a chunk
becomes evictable or not; the adapter maps that onto kvtier's insert / pin / unpin, so the
kvtier policy orders exactly the evictable chunks, as it does under kvtier's own manager.

vLLM completes a transfer job's keys one `mark_evictable` at a time, in the order of a `set`
(`TransferJobStatus.keys`); kvtier's policies take a call's keys head first and order them by
that (LRU keeps a prefix's head longest). The adapter therefore collects consecutive
completions and hands each request's run to the kvtier policy in one call, head first by the
request's token positions, before the policy is next asked or told anything. A load's keys
stay in one call when they name different readers (another request read the prefix's head
meanwhile) but one request read them all and its prefix holds them; another request's load
that ends in the same step stays its own call, with its own request, even where its keys lie
on that prefix. They keep their order when the request that read them ended first (aborted
with its load in flight).

A kvtier unpin counts as a use. vLLM also pins chunks that no request reads: a tiering
manager's cascade to a secondary tier (`prepare_read`), which must not change recency. The
adapter therefore pins a chunk in the kvtier policy only once a request's access follows the
pin (vLLM's `on_request_access`, which `prepare_load` makes right after pinning, with no
lookup of the chunk in between; a store offer of a chunk a cascade pinned looks it up first);
until then the chunk stays a kvtier candidate that `evict` passes over as protected, and its
unpin is no use.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import OffloadKey as VOffloadKey
from vllm.v1.kv_offload.base import ReqContext as VReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy as VCachePolicy
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

from kvtier.base import OffloadKey, ReqContext
from kvtier.config import VLLM_POLICY_PREFIX
from kvtier.policies import CachePolicy, get_policy_cls, registered_policies

PREFIX = VLLM_POLICY_PREFIX
"""`eviction_policy` names this module answers: `kvtier_` + a kvtier policy name."""


# A completion as `_flush` takes it: (is_store, key, context for the policy, context whose
# positions place the key, other requests that read it while it was pinned).
_Completion = tuple[bool, OffloadKey, ReqContext | None, ReqContext | None, Sequence[ReqContext]]
# (is_store, context for the policy, context placing the keys, keys, a load's completions)
_Run = tuple[bool, ReqContext | None, ReqContext | None, list[OffloadKey], list[_Completion]]


def _read_on(ctx: ReqContext, completion: _Completion) -> bool:
    """Whether request `ctx` read the completion's key and its prefix holds it: then the
    key's last unpin may end ctx's load, and goes to the kvtier policy with ctx's keys."""
    _, key, _, place, others = completion
    return key in ctx.key_positions and (place is ctx or any(r is ctx for r in others))


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
        if getattr(type(self), "policy", None) is None:
            # vLLM instantiates whatever class eviction_policy names in this module: the base
            # failed later with "'KVTierPolicyAdapter' object has no attribute 'policy'".
            raise TypeError(
                f"eviction_policy {type(self).__name__!r} is the base of kvtier's adapters, not "
                "a cache policy; expected one of: "
                + ", ".join(PREFIX + n for n in registered_policies())
            )
        super().__init__(cache_capacity)
        if isinstance(cache_capacity, int) and cache_capacity < 1:
            # vLLM sizes the tier as int(cpu_bytes_to_use) // bytes per chunk (all workers),
            # checking only that the setting is truthy: a negative one floors to a negative
            # count, which kvtier's policy refused naming its own `capacity`, not the key.
            raise ValueError(
                f"vLLM's CPU tier holds {cache_capacity} chunks: cpu_bytes_to_use "
                "(kv_connector_extra_config) is negative or smaller than one chunk's bytes on "
                "all workers together; expected a positive number of bytes, at least that"
            )
        self._inner: CachePolicy = self.policy(cache_capacity)
        self.chunks: dict[VOffloadKey, ChunkStatus] = {}
        # Chunks being written: they enter the kvtier policy when their store completes.
        self._pending: dict[VOffloadKey, ReqContext] = {}
        # Resident chunks a live request accessed -> its context. vLLM's mark_evictable names
        # no request; the unpin of a load is then that request's use, which its end-of-request
        # touch does not count again (kvaware counts a chunk once per request).
        self._readers: dict[VOffloadKey, ReqContext] = {}
        # Chunks a load still reads whose reader has ended (aborted mid-load) -> its context:
        # the unpin is no use of a live request, but the request's positions still order it.
        self._orphans: dict[VOffloadKey, ReqContext] = {}
        # Pinned chunks other live requests accessed before their reader in `_readers`: the
        # last unpin may end any of their loads, so `_flush` may hand it over with theirs.
        self._co_readers: dict[VOffloadKey, list[ReqContext]] = {}
        # Completions not yet given to the kvtier policy, in vLLM's order: (is_store, key,
        # context for the policy, context whose positions place the key, other requests that
        # read it). `_flush` hands them over, one call per run of one kind, request and group.
        self._completed: list[_Completion] = []
        # Chunks vLLM pinned that no request's access has claimed (a tiering cascade's read):
        # kvtier candidates still, never victims, and their unpin is no use.
        self._held: set[VOffloadKey] = set()
        # Pins since their key was last looked up: vLLM's prepare_load looks a key up, pins it
        # and reports the request's access next, while a store offer of a chunk a cascade
        # pinned earlier looks it up again first. Only these pins are a request's load.
        self._fresh: set[VOffloadKey] = set()

    def _flush(self) -> None:
        """Give the collected completions to the kvtier policy: stores as `insert`, loads as
        `unpin`, each run of one request by group and head first (as kvtier's own connector
        passes a job's keys), so that the order of vLLM's key sets does not decide what is
        evicted first."""
        completed = self._completed
        if not completed:
            return
        self._completed = []
        runs: list[_Run] = []
        for entry in completed:
            is_store, key, ctx, place, _ = entry
            if runs and runs[-1][0] is is_store:
                _, _, run_place, keys, loads = runs[-1]
                if place is run_place:
                    keys.append(key)
                    if not is_store:
                        loads.append(entry)
                    continue
                if not is_store:
                    # A load's keys carry the request that last read each; split by that,
                    # the order of vLLM's set would decide which part goes first. They stay
                    # one run while one request read them all and its prefix holds them, as
                    # one job's keys do; another request's load ending in the same step is
                    # not that request's use, even where its keys lie on that prefix.
                    if run_place is not None and _read_on(run_place, entry):
                        keys.append(key)
                        loads.append(entry)
                        continue
                    if place is not None and all(_read_on(place, e) for e in loads):
                        keys.append(key)
                        loads.append(entry)
                        runs[-1] = (False, ctx, place, keys, loads)
                        continue
            runs.append((is_store, ctx, place, [key], [] if is_store else [entry]))
        inner = self._inner
        for is_store, ctx, place, keys, _ in runs:
            if place is not None and len(keys) > 1:
                positions = place.key_positions
                if all(k in positions for k in keys):
                    # kvtier's connector completes one job per KV-cache group (the 4 bytes
                    # ending a key), its keys head first.
                    keys.sort(key=lambda k: (k[-4:], positions[k]))
            apply = inner.insert if is_store else inner.unpin
            first = 0
            for j in range(1, len(keys) + 1):
                if j == len(keys) or keys[j][-4:] != keys[first][-4:]:
                    apply(keys[first:j], ctx)
                    first = j

    @property
    def inner(self) -> CachePolicy:
        """The kvtier policy, up to date with every completion vLLM reported."""
        self._flush()
        return self._inner

    def get(self, key: VOffloadKey) -> ChunkStatus | None:
        if self._fresh:
            self._fresh.discard(key)
        return self.chunks.get(key)

    def insert(self, key: VOffloadKey, chunk: ChunkStatus, req_context: VReqContext) -> None:
        self.chunks[key] = chunk
        if chunk.ref_cnt == 0:
            self._flush()
            self._inner.insert([OffloadKey(key)], _ctx(req_context))
        else:
            self._pending[key] = _ctx(req_context)

    def remove(self, key: VOffloadKey) -> None:
        del self.chunks[key]
        self._readers.pop(key, None)
        self._orphans.pop(key, None)
        self._co_readers.pop(key, None)
        self._held.discard(key)
        self._fresh.discard(key)
        if self._pending.pop(key, None) is None:
            self._flush()
            self._inner.remove([OffloadKey(key)])

    def touch(self, keys: Iterable[VOffloadKey], req_context: VReqContext) -> None:
        self._flush()
        self._inner.touch([OffloadKey(k) for k in keys], _ctx(req_context))

    def on_store_miss(self, keys: Iterable[VOffloadKey], req_context: VReqContext) -> None:
        """kvtier policies learn from ghost hits when a key is inserted, not here."""

    def on_request_access(self, keys: Iterable[VOffloadKey], req_context: VReqContext) -> None:
        chunks, readers, held, ctx = self.chunks, self._readers, self._held, _ctx(req_context)
        fresh = self._fresh
        if fresh:  # claimed now or never
            self._fresh = set()
        loaded: list[OffloadKey] = []
        for k in keys:
            if k in chunks:
                earlier = readers.setdefault(k, ctx)
                if earlier is not ctx:
                    readers[k] = ctx
                    # Pinned, and not by this access alone (not fresh): maybe by earlier's load.
                    if chunks[k].ref_cnt > 0 and k not in fresh:
                        self._co_readers.setdefault(k, []).append(earlier)
                if k in fresh and k in held:
                    # The pin just before is this request's load: kvtier pins it, and its
                    # unpin will be the request's use. A cascade's pin that this access
                    # merely follows (a store offer of the chunk) stays no use.
                    held.discard(k)
                    loaded.append(OffloadKey(k))
        if loaded:
            self._flush()
            self._inner.pin(loaded)

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
        self._flush()
        if reused_keys:
            for keys in key_groups:
                used = [OffloadKey(k) for k in keys if k in reused_keys]
                if used:
                    self._inner.touch(used, ctx)
        readers, chunks = self._readers, self.chunks
        for keys in key_groups:
            for k in keys:
                if readers.get(k) is ctx:
                    del readers[k]
                    chunk = chunks.get(k)
                    if chunk is not None and chunk.ref_cnt > 0:
                        self._orphans[k] = ctx  # a load in flight: see _orphans
        self._inner.on_request_finished(ctx)

    def evict(
        self, n: int, protected: set[VOffloadKey]
    ) -> list[tuple[VOffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []
        self._flush()
        if self._held:
            protected = protected | self._held
        victims = self._inner.evict(n, protected)  # type: ignore[arg-type]
        if victims is None:
            return None
        for k in victims:
            self._readers.pop(VOffloadKey(k), None)
        return [(VOffloadKey(k), self.chunks.pop(VOffloadKey(k))) for k in victims]

    def clear(self) -> None:
        self.chunks.clear()
        self._pending.clear()
        self._readers.clear()
        self._orphans.clear()
        self._co_readers.clear()
        self._completed.clear()
        self._held.clear()
        self._fresh.clear()
        self._inner.clear()

    def mark_evictable(self, key: VOffloadKey) -> None:
        ctx = self._pending.pop(key, None)
        orphan = self._orphans.pop(key, None) if self._orphans else None
        if ctx is not None:
            self._completed.append((True, OffloadKey(key), ctx, ctx, ()))  # store completed
            return
        # Only a chunk read while pinned has co-readers (so no chunk being stored, and no
        # victim: its last unpin came here first).
        others = self._co_readers.pop(key, ()) if self._co_readers else ()
        if key in self._held:
            self._held.discard(key)  # a read no request made: no use, no move
            self._fresh.discard(key)
        else:
            # Last load completed: a use by the live request that read it, where known.
            ctx = self._readers.get(key)
            place = orphan if ctx is None else ctx
            self._completed.append((False, OffloadKey(key), ctx, place, others))

    def mark_non_evictable(self, key: VOffloadKey) -> None:
        # Pinned in the kvtier policy when a request's access claims the read.
        self._held.add(key)
        self._fresh.add(key)


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
