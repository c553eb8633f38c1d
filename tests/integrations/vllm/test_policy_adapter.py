"""kvtier's cache policies inside vLLM's own `CPUOffloadingManager` (`KVTierPolicyAdapter`),
driven through the manager's public calls as vLLM's `OffloadingConnector` makes them.

vLLM completes a transfer job with the job's keys as a `set`: the adapter must not let that
order decide what is evicted. Each kvtier policy must pick the same victims behind vLLM's
manager as behind kvtier's own, and no call may evict a pinned, pending or protected chunk,
overfill the tier, or find no room where there is some.
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Iterator
from typing import Any, cast

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

MODULE = "kvtier.integrations.vllm.policy"
POLICIES = ["lru", "arc", "s3fifo", "sieve", "kvaware"]
TOKENS = 16


@pytest.fixture(scope="module")
def vllm_loaded() -> Iterator[None]:
    import vllm.v1.kv_offload.cpu.manager  # noqa: F401

    import kvtier.integrations.vllm.policy  # noqa: F401

    yield


def _key(tag: str, group: int = 0) -> Any:
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(tag.encode().ljust(32, b"."), group)


def _begin(manager: Any, req_id: str, tags: list[str]) -> tuple[Any, list[Any]]:
    """A new request of `manager` for the chunks named by `tags`: its context and keys, each
    key placed at its chunk's end in tokens."""
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id)
    manager.on_new_request(ctx)
    keys = [_key(t) for t in tags]
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, TOKENS * (i + 1))
    return ctx, keys


def _leading_hits(manager: Any, keys: list[Any], ctx: Any) -> list[Any]:
    """The keys before the first that `manager` does not hold ready."""
    hits = []
    for k in keys:
        if manager.lookup(k, ctx).name != "HIT":
            break
        hits.append(k)
    return hits


def _vllm_manager(capacity: int, policy: str) -> Any:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return CPUOffloadingManager(capacity, f"kvtier_{policy}", MODULE)


@pytest.mark.parametrize("policy", ["lru", "kvaware"])
@pytest.mark.parametrize("tail_first", [False, True])
def test_a_stored_prefix_loses_its_tail_first_whatever_order_vllm_completes_it(
    vllm_loaded: None, policy: str, tail_first: bool
) -> None:
    """vLLM's connector calls complete_store with a set of keys, so a job's chunks reach the
    policy in hash order. kvtier's LRU (and kvaware, LRU until its shadows say otherwise)
    keeps a prefix's head longest, as vLLM's own LRU does: whatever the order, the first
    victim is the tail."""
    from vllm.v1.kv_offload.base import ReqContext

    manager = _vllm_manager(4, policy)
    ctx, keys = _begin(manager, "a", [f"a{i}" for i in range(4)])
    out = manager.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == keys
    manager.complete_store(keys[::-1] if tail_first else keys, ctx)
    manager.on_request_finished(ctx)

    ctx = ReqContext("b")
    manager.on_new_request(ctx)
    ctx.set_offload_key_position(_key("b0"), TOKENS)
    out = manager.prepare_store([_key("b0")], ctx)
    assert out is not None
    assert out.evicted_keys == [keys[-1]]


def _prefixes(rng: random.Random, n: int) -> list[list[str]]:
    """`n` requests over a few shared prefix trees (tags name a chunk and its whole prefix)."""
    out = []
    for _ in range(n):
        path = [f"t{rng.randrange(5)}"]
        for depth in range(rng.randint(0, 5)):
            path.append(f"{path[-1]}.{rng.randrange(2) if depth >= 1 else 0}")
        out.append(path)
    return out


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("groups", [1, 2])
def test_each_kvtier_policy_evicts_as_under_kvtiers_own_manager(
    vllm_loaded: None, policy: str, groups: int
) -> None:
    """One request after another (a prefix loaded where it hits, the rest stored; some stores
    fail) through vLLM's manager with `kvtier_<policy>` and through kvtier's own manager with
    the same policy, fed as kvtier's connector feeds it (a job's keys by group, head first;
    the request's reuses touched at its end). vLLM completes each job with its keys in a
    random order; the victims must be the same, request by request."""
    from vllm.v1.kv_offload.base import ReqContext as VReqContext

    from kvtier.base import ReqContext
    from kvtier.cpu import CPUOffloadingManager as KVTierManager

    for seed in range(6):
        rng = random.Random(seed)
        capacity = rng.choice([2, 3, 5, 8, 13])
        ours = _vllm_manager(capacity * groups, policy)
        ref = KVTierManager(capacity * groups, policy)
        for r, tags in enumerate(_prefixes(rng, 150)):
            vctx = VReqContext(f"r{r}")
            ours.on_new_request(vctx)
            ctx = ReqContext(f"r{r}")
            ref.on_new_request(ctx)
            # Group-major, head first, as both connectors offer a request's chunks.
            keys = [_key(t, g) for g in range(groups) for t in tags]
            for i, k in enumerate(keys):
                pos = TOKENS * (i % len(tags) + 1)
                vctx.set_offload_key_position(k, pos)
                ctx.key_positions[k] = pos
            hit_chunks = 0
            for c in range(len(tags)):
                found = [ours.lookup(keys[g * len(tags) + c], vctx).name for g in range(groups)]
                assert found == [
                    ref.lookup(keys[g * len(tags) + c], ctx).name for g in range(groups)
                ]
                if found != ["HIT"] * groups:
                    break
                hit_chunks += 1
            hits = [keys[g * len(tags) + c] for g in range(groups) for c in range(hit_chunks)]
            if hits:
                ours.prepare_load(hits, vctx)
                shuffled = hits[:]
                rng.shuffle(shuffled)
                ours.complete_load(shuffled, vctx)
                for g in range(groups):
                    group_hits = hits[g * hit_chunks : (g + 1) * hit_chunks]
                    ref.prepare_load(group_hits, ctx)
                    ref.complete_load(group_hits, ctx)
            offer = [k for k in keys if k not in hits]
            reused = set(hits) | {k for k in offer if ref.lookup(k, ctx).name == "HIT"}
            a = ours.prepare_store(offer, vctx)
            b = ref.prepare_store(offer, ctx)
            assert (a is None) == (b is None), (seed, r)
            if a is not None and b is not None:
                assert sorted(a.evicted_keys) == sorted(b.evicted_keys), (seed, r, tags)
                assert sorted(a.keys_to_store) == sorted(b.keys_to_store)
                success = rng.random() < 0.9
                shuffled = list(a.keys_to_store)
                rng.shuffle(shuffled)
                ours.complete_store(set(shuffled), vctx, success=success)
                for g in range(groups):
                    group_keys = [k for k in b.keys_to_store if k[-4:] == keys[g * len(tags)][-4:]]
                    ref.complete_store(group_keys, ctx, success=success)
            ours.on_request_finished(vctx)
            for g in range(groups):
                used = [k for k in keys[g * len(tags) : (g + 1) * len(tags)] if k in reused]
                if used:
                    ref.touch(used, ctx)
            ref.on_request_finished(ctx)


@pytest.mark.parametrize("policy", POLICIES)
def test_random_interleavings_keep_vllms_manager_consistent(vllm_loaded: None, policy: str) -> None:
    """Requests that overlap, jobs that complete late, out of order, or fail, loads still in
    flight when their request ends, resets: after every call the adapter holds exactly vLLM's
    chunks and the kvtier policy exactly the evictable ones; no call evicts a chunk it was
    offered, overfills the tier, or returns None while enough evictable chunks exist."""

    for seed in range(4):
        rng = random.Random(seed)
        capacity = rng.choice([1, 3, 6])
        manager = _vllm_manager(capacity, policy)
        adapter = manager._policy
        contexts: dict[str, Any] = {}
        live: dict[str, list[Any]] = {}
        stores: list[tuple[str, list[Any]]] = []
        loads: list[tuple[str, list[Any]]] = []
        for step in range(400):
            op = rng.random()
            if op < 0.2 or not live:
                rid = f"r{step}"
                contexts[rid], live[rid] = _begin(manager, rid, _prefixes(rng, 1)[0])
            elif op < 0.45:
                rid = rng.choice(list(live))
                ctx, keys = contexts[rid], live[rid]
                hits = _leading_hits(manager, keys, ctx)
                if hits and rng.random() < 0.7:
                    manager.prepare_load(hits, ctx)
                    loads.append((rid, hits))
                offer = keys if rng.random() < 0.3 else keys[len(hits) :]
                if not offer:
                    continue
                evictable = {k for k, c in adapter.chunks.items() if c.ref_cnt == 0}
                need = sum(1 for k in offer if adapter.get(k) is None)
                room = manager._get_num_free_chunks() + len(evictable - set(offer))
                out = manager.prepare_store(offer, ctx)
                if out is None:
                    assert need > room, (seed, step, need, room)
                else:
                    assert not set(out.evicted_keys) & set(offer)
                    assert set(out.evicted_keys) <= evictable
                    if out.keys_to_store:
                        stores.append((rid, list(out.keys_to_store)))
            elif op < 0.65 and stores:
                rid, keys = stores.pop(rng.randrange(len(stores)))
                rng.shuffle(keys)
                manager.complete_store(set(keys), contexts[rid], success=rng.random() < 0.85)
            elif op < 0.8 and loads:
                rid, keys = loads.pop(rng.randrange(len(loads)))
                rng.shuffle(keys)
                manager.complete_load(set(keys), contexts[rid])
            elif op < 0.97:
                rid = rng.choice(list(live))
                del live[rid]
                manager.on_request_finished(contexts[rid])
            else:
                # vLLM's scheduler drops every job in flight at a reset: none completes later.
                manager.reset_cache()
                stores.clear()
                loads.clear()
            chunks = adapter.chunks
            assert len(chunks) <= capacity
            ready = {k for k, c in chunks.items() if c.ref_cnt == 0}
            assert manager._num_evictable_cache_chunks == len(ready)
            # Candidates: the evictable chunks, and pinned ones no request's access claimed
            # (a reload of chunks the request already offered), which evict passes over.
            held = adapter._held
            assert all(chunks[k].ref_cnt > 0 for k in held)
            inner = adapter.inner
            assert len(inner) == len(ready) + len(held)
            assert all(k in inner for k in ready | held)


def test_kvtier_lru_evicts_what_vllms_lru_evicts(vllm_loaded: None) -> None:
    """One request after another: its prefix loaded where it hits, its new chunks stored and
    completed as vLLM's connector completes them (a set). kvtier's LRU and vLLM's pick the same
    victims when no request offers again a chunk the tier still holds past a miss (there
    kvtier, by design, refreshes only the reused chunk: docs/vllm.md)."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    def run(manager: Any, seed: int) -> list[list[Any] | None]:
        rng = random.Random(seed)
        evicted: list[list[Any] | None] = []
        for r, tags in enumerate(_prefixes(random.Random(seed), 200)):
            ctx, keys = _begin(manager, f"r{r}", tags)
            hits = _leading_hits(manager, keys, ctx)
            if hits:
                manager.prepare_load(hits, ctx)
                manager.complete_load(set(hits), ctx)
            new = [k for k in keys[len(hits) :] if manager.lookup(k, ctx).name == "MISS"]
            if new:
                out = manager.prepare_store(new, ctx)
                evicted.append(None if out is None else sorted(out.evicted_keys))
                if out is not None:
                    shuffled = list(out.keys_to_store)
                    rng.shuffle(shuffled)
                    manager.complete_store(set(shuffled), ctx)
            manager.on_request_finished(ctx)
        return evicted

    for seed in range(4):
        for capacity in (2, 5, 11):
            expected = run(CPUOffloadingManager(capacity, "lru"), seed)
            assert run(_vllm_manager(capacity, "lru"), seed) == expected, (seed, capacity)


class _Region:
    """Stands in for the shared memory region of vLLM's primary tier (bytes are not moved)."""

    def create_kv_memoryview(self) -> memoryview:
        return memoryview(b"")


@pytest.mark.parametrize("policy", POLICIES)
def test_a_tiering_cascade_read_is_not_a_use(vllm_loaded: None, policy: str) -> None:
    """vLLM's tiering manager copies every stored chunk on to its secondary tiers, pinning it
    in the CPU tier meanwhile (`prepare_read` / `complete_read`); "cascade reads ... must not
    alter request-scoped recency". With or without those reads, the kvtier policy must pick
    the same victims (ARC would otherwise count every stored chunk as reused, SIEVE mark it
    visited, S3-FIFO and kvaware count it once more)."""
    from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager

    def run(cascade: bool, seed: int) -> list[list[Any] | None]:
        rng = random.Random(seed)
        manager = CPUPrimaryTierOffloadingManager(
            6,
            cast(Any, _Region()),
            cache_policy=f"kvtier_{policy}",
            cache_policy_module_path=MODULE,
        )
        reads: list[tuple[list[Any], Any]] = []
        evicted: list[list[Any] | None] = []
        for r, tags in enumerate(_prefixes(rng, 150)):
            ctx, keys = _begin(manager, f"r{r}", tags)
            hits = _leading_hits(manager, keys, ctx)
            if hits:
                manager.prepare_load(hits, ctx)
                manager.complete_load(hits, ctx)
            out = manager.prepare_write(keys[len(hits) :], ctx)
            evicted.append(None if out is None else sorted(out.evicted_keys))
            if out is not None and out.keys_to_store:
                manager.complete_write(out.keys_to_store, ctx)
                if cascade:
                    manager.prepare_read(out.keys_to_store, ctx)
                    reads.append((out.keys_to_store, ctx))
            manager.on_request_finished(ctx)
            # The cascade finishes after the request, before the next one needs the room.
            for done, done_ctx in reads:
                manager.complete_read(set(done), done_ctx)
            reads.clear()
        return evicted

    for seed in range(3):
        assert run(True, seed) == run(False, seed), seed


@pytest.mark.parametrize("name", POLICIES)
def test_a_tier_of_no_chunk_names_cpu_bytes_to_use(vllm_loaded: None, name: str) -> None:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    with pytest.raises(ValueError, match="holds 0 chunks: cpu_bytes_to_use"):
        CPUOffloadingManager(0, f"kvtier_{name}", MODULE)


def test_the_module_docstring_example_is_a_config_vllm_reads(vllm_loaded: None) -> None:
    import json

    import kvtier.integrations.vllm.policy as policy_module

    doc = policy_module.__doc__ or ""
    snippet = doc[doc.index('"kv_connector_extra_config"') : doc.index("}") + 1]
    extra = json.loads("{" + snippet + "}")["kv_connector_extra_config"]
    # vLLM's CPUOffloadingSpec sizes the tier with int(cpu_bytes_to_use): "64GiB" raised.
    assert int(extra["cpu_bytes_to_use"]) == 64 * 2**30
    assert extra["cache_policy_module_path"] == MODULE
    assert extra["eviction_policy"].startswith(policy_module.PREFIX)
    assert hasattr(policy_module, extra["eviction_policy"])
