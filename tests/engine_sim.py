"""A deterministic step-by-step engine for connector tests.

A paged device pool made of CPU tensors, the real CPU transfer engine and the real manager. The
"model" writes into a block a pattern derived from the block's hash, so the right KV of any block
is known and every load can be checked byte for byte.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvtier.base import ReqContext, TransferResult, make_offload_key
from kvtier.connector import OffloadingScheduler, OffloadingWorker, StepMetadata, StepProgress
from kvtier.cpu import CPUOffloadingManager
from kvtier.transfer import HostPool, KVCacheRegistration, KVTensor, make_transfer_worker

TOKENS_PER_BLOCK = 4
BLOCK_SHAPE = (2, TOKENS_PER_BLOCK, 2, 8)  # K/V, tokens, heads, head dim


def block_hashes(name: str, num_blocks: int, head: list[bytes] | None = None) -> list[bytes]:
    """Chained hashes: `head` (a shared prefix) followed by `num_blocks` blocks named `name`."""
    out = list(head or [])
    parent = out[-1] if out else b"root"
    for i in range(num_blocks):
        parent = hashlib.sha256(parent + name.encode() + i.to_bytes(4, "big")).digest()
        out.append(parent)
    return out


def stored_manager(
    num_slots: int, hashes: list[bytes], groups: tuple[int, ...] = (0,)
) -> CPUOffloadingManager:
    """A manager holding the chunks of `hashes` (one block each) in every group of `groups`."""
    m = CPUOffloadingManager(num_slots)
    keys = [make_offload_key(h, g) for g in groups for h in hashes]
    assert m.prepare_store(keys, ReqContext("w")) is not None
    m.complete_store(keys, ReqContext("w"), True)
    return m


def sent_load(num_workers: int) -> tuple[CPUOffloadingManager, OffloadingScheduler, int]:
    """A manager and scheduler with two stored chunks: request b's load of one (sent, its job id
    returned) and c's of the other (planned, not sent)."""
    m = CPUOffloadingManager(8)
    s = OffloadingScheduler(m, tokens_per_block=TOKENS_PER_BLOCK, num_workers=num_workers)
    a, c = block_hashes("a", 3), block_hashes("c", 2)
    for rid, hashes, blocks in (("a0", a, [0, 1]), ("c0", c, [2, 3])):
        s.add_request(rid, hashes[:1], TOKENS_PER_BLOCK + 1)
        assert s.get_num_new_matched_tokens(rid, 0) == 0
        s.update_state_after_alloc(rid, [blocks], 0)
        (store,) = s.build_step_metadata([StepProgress(rid, [blocks], TOKENS_PER_BLOCK)]).stores
        for i in range(num_workers):
            s.on_worker_results([TransferResult(store.job_id, True)], worker=i)
    s.add_request("b", a, 3 * TOKENS_PER_BLOCK + 1)
    assert s.get_num_new_matched_tokens("b", 0) == TOKENS_PER_BLOCK
    s.update_state_after_alloc("b", [[4, 5, 6, 7]], TOKENS_PER_BLOCK)
    (load,) = s.build_step_metadata().loads
    s.add_request("c", c, 2 * TOKENS_PER_BLOCK + 1)
    assert s.get_num_new_matched_tokens("c", 0) == TOKENS_PER_BLOCK
    s.update_state_after_alloc("c", [[8, 9, 10]], TOKENS_PER_BLOCK)
    assert m.get_stats().pinned == 2
    return m, s, load.job_id


def kv_pattern(block_hash: bytes) -> torch.Tensor:
    """The KV the model computes for a block: a pure function of its hash."""
    seed = int.from_bytes(block_hash[:8], "big") & 0x7FFF_FFFF
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BLOCK_SHAPE, generator=g)


@dataclass
class Request:
    """One request: its block hashes and device blocks; prompt = every block plus one token."""

    req_id: str
    hashes: list[bytes]
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_loaded_tokens: int = 0
    waiting_for_load: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.hashes) * TOKENS_PER_BLOCK + 1


class Gate:
    """A fault injector that holds chosen jobs until released, or fails them."""

    def __init__(self) -> None:
        self.hold: dict[str, threading.Event] = {}
        self.fail_directions: set[str] = set()
        self.started: list[tuple[int, str]] = []

    def __call__(self, job_id: int, direction: str) -> None:
        self.started.append((job_id, direction))
        event = self.hold.get(direction)
        if event is not None:
            event.wait(timeout=10)
        if direction in self.fail_directions:
            raise RuntimeError(f"injected failure of {direction} job {job_id}")


class Engine:
    """Schedules requests, allocates device blocks, runs steps, checks every loaded byte."""

    def __init__(
        self,
        num_device_blocks: int = 64,
        num_slots: int = 32,
        blocks_per_chunk: int = 1,
        policy: str = "lru",
    ) -> None:
        self.kv = torch.zeros((num_device_blocks, *BLOCK_SHAPE))
        reg = KVCacheRegistration([KVTensor(self.kv, "flashinfer")])
        self.pool = HostPool(reg, blocks_per_chunk, num_slots=num_slots)
        self.gate = Gate()
        self.transfer = make_transfer_worker(reg, self.pool, "cpu", fault_injector=self.gate)
        self.manager = CPUOffloadingManager(num_slots, policy, enable_events=True)
        self.scheduler = OffloadingScheduler(
            self.manager, tokens_per_block=TOKENS_PER_BLOCK, blocks_per_chunk=blocks_per_chunk
        )
        self.worker = OffloadingWorker(self.transfer)
        self.free_blocks = list(range(num_device_blocks))[::-1]  # reuse freed blocks first
        self.held: dict[str, list[int]] = {}  # finished requests whose blocks transfers still use
        self.running: dict[str, Request] = {}
        self.load_mismatches = 0
        self.loaded_blocks = 0

    def close(self) -> None:
        self.transfer.shutdown()

    # -- engine operations ------------------------------------------------------------------

    def add(self, req: Request) -> int | None:
        """Admit a request: ask for external hits, allocate its blocks, plan the load."""
        self.scheduler.add_request(req.req_id, req.hashes, req.num_prompt_tokens)
        return self.admit(req)

    def admit(self, req: Request) -> int | None:
        n = self.scheduler.get_num_new_matched_tokens(req.req_id, 0)
        if n is None:
            return None
        need = len(req.hashes) + 1
        req.blocks = [self.free_blocks.pop() for _ in range(need)]
        self.scheduler.update_state_after_alloc(req.req_id, [req.blocks], n)
        req.num_loaded_tokens = n
        req.num_computed = 0
        req.waiting_for_load = n > 0
        self.running[req.req_id] = req
        return n

    def step(self, before_stores: Callable[[StepMetadata], None] | None = None) -> StepMetadata:
        """One engine step: loads, a forward pass that computes every missing block of every
        running request, then stores of what it computed."""
        progress = []
        for req in self.running.values():
            progress.append(
                StepProgress(req.req_id, [req.blocks], len(req.hashes) * TOKENS_PER_BLOCK)
            )
        meta = self.scheduler.build_step_metadata(progress)
        self.worker.start_step(meta)
        self.worker.wait_for_loads(meta)
        self.collect()
        for req in self.running.values():
            start = req.num_loaded_tokens // TOKENS_PER_BLOCK if not req.waiting_for_load else 0
            for b in range(start, len(req.hashes)):
                self.kv[req.blocks[b]] = kv_pattern(req.hashes[b])
            req.num_computed = len(req.hashes) * TOKENS_PER_BLOCK
        if before_stores is not None:
            before_stores(meta)
        self.worker.finish_step(meta)
        return meta

    def collect(self) -> None:
        """Feed worker results to the scheduler; verify loads; free held blocks."""
        self.scheduler.on_worker_results(self.worker.get_finished())
        done = self.scheduler.take_finished()
        for req_id in done.recving:
            req = self.running.get(req_id)
            if req is None:
                continue
            req.waiting_for_load = False
            if req_id in done.failed_loads:
                req.num_loaded_tokens = 0  # recompute everything
                continue
            for b in range(req.num_loaded_tokens // TOKENS_PER_BLOCK):
                self.loaded_blocks += 1
                if not torch.equal(self.kv[req.blocks[b]], kv_pattern(req.hashes[b])):
                    self.load_mismatches += 1
        for req_id in done.sending:
            self.free_blocks.extend(self.held.pop(req_id))
        self.last_finished = done

    def finish(self, req_id: str) -> bool:
        """The request ends (done or aborted); returns whether its blocks are held."""
        req = self.running.pop(req_id)
        hold = self.scheduler.request_finished(req_id)
        if hold:
            self.held[req_id] = req.blocks
        else:
            self.free_blocks.extend(req.blocks)
        return hold

    def preempt(self, req_id: str) -> Request:
        """Free a running request's blocks at once, as an engine under memory pressure does."""
        req = self.running.pop(req_id)
        self.scheduler.request_preempted(req_id)
        self.free_blocks.extend(req.blocks)
        req.blocks = []
        return req

    def drain(self) -> None:
        """Wait for every submitted job and collect the results."""
        self.transfer.wait(range(1, self.scheduler._next_job_id + 1))
        self.collect()


def assert_clean(e: Engine) -> None:
    """No pin, no pending write, no job, no held block, nothing leaked, no wrong byte."""
    e.drain()
    stats = e.manager.get_stats()
    assert (stats.pinned, stats.pending_writes) == (0, 0)
    assert e.scheduler.num_jobs_in_flight() == 0
    assert not e.held
    assert stats.used_slots == stats.ready
    assert e.load_mismatches == 0
