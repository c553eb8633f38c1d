"""End to end: a multi-turn chat through `KVTierGenerator` on the real manager, connector halves
and CPU transfer engine, against plain recompute.

Three things are checked on every request, on the default (Llama) demo model and a Qwen2 one:

- **bytes**: every block kvtier loads into the paged buffer is, bit for bit, the block that was
  in the paged buffer when its key was stored, and the host slot the load read holds exactly
  those bytes. `ByteAudit` snapshots the pages per block hash when the worker half submits a
  store, and compares after the worker half reports the load done. Keys come from the
  request's own hashes and block list, not from the manager, so a slot mix-up is caught too.
- **logits**: every generated step's logits agree with recompute within `LOGIT_ATOL = 1e-4`.
  Not bit for bit, because a stored reply block's KV came from one-token decode steps and
  recompute builds it inside one prefill matmul (another summation order, a few float32 ulps).
  Measured 0.9e-5 to 1.2e-5 on these models (tests/integrations/hf/test_prefix.py); 1e-4
  leaves ~10x, while one wrong block moves logits by > 0.1 (`test_wrong_block_is_caught`).
- **tokens**: the greedy tokens are identical.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.config import KVTierConfig  # noqa: E402
from kvtier.connector import StepMetadata  # noqa: E402
from kvtier.integrations.hf.generator import KVTierGenerator  # noqa: E402
from kvtier.integrations.hf.models import make_demo_model  # noqa: E402
from kvtier.integrations.hf.prefix import generate_greedy  # noqa: E402

LOGIT_ATOL = 1e-4
BS = 16


class ByteAudit:
    """Wraps a generator's scheduler and worker halves to prove loads return the stored bytes.

    Only public methods are wrapped (on the instances), and every wrapper calls through, so the
    generator runs unchanged. Assumes one device block per chunk (the default).
    """

    def __init__(self, gen: KVTierGenerator) -> None:
        assert gen.scheduler.blocks_per_chunk == 1
        self.gen = gen
        self.stored: dict[bytes, Any] = {}
        """Block hash -> the block's bytes (all layers) when its store was submitted."""
        self.slot_hash: dict[int, bytes] = {}
        """Host slot -> hash of the block last stored into it."""
        self.hashes: dict[str, Sequence[bytes]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.blocks_stored = 0
        self.blocks_loaded = 0
        sched, worker = gen.scheduler, gen.worker
        sched.add_request = self._wrap(sched.add_request, self._on_add)  # type: ignore[method-assign]
        sched.update_state_after_alloc = self._wrap(  # type: ignore[method-assign]
            sched.update_state_after_alloc, self._on_alloc
        )
        worker.finish_step = self._wrap(worker.finish_step, self._on_stores)  # type: ignore[method-assign]
        original_wait = worker.wait_for_loads

        def wait_for_loads(meta: StepMetadata) -> None:
            original_wait(meta)
            self._on_loads(meta)

        worker.wait_for_loads = wait_for_loads  # type: ignore[method-assign]

    @staticmethod
    def _wrap(fn: Callable[..., Any], before: Callable[..., None]) -> Callable[..., Any]:
        def wrapped(*args: Any) -> Any:
            before(*args)
            return fn(*args)

        return wrapped

    def _block_bytes(self, block: int) -> Any:
        """One device block of every layer, as raw bytes (so -0.0 and 0.0 differ)."""
        # Each layer's buffer is (2, kv_heads, blocks, ...): a block is K per head, V per head.
        return torch.cat(
            [p[:, :, block].reshape(-1).view(torch.uint8).cpu() for p in self.gen.pages]
        )

    def _on_add(self, req_id: str, hashes: Sequence[bytes], *_: Any) -> None:
        self.hashes[req_id] = hashes  # the generator extends this list with reply blocks

    def _on_alloc(self, req_id: str, block_ids: Sequence[Sequence[int]], *_: Any) -> None:
        self.blocks[req_id] = list(block_ids[0])

    def _hash_of(self, req_id: str, device_block: int) -> bytes:
        return self.hashes[req_id][self.blocks[req_id].index(device_block)]

    def _on_stores(self, meta: StepMetadata) -> None:
        for job in meta.stores:
            for block, slot in zip(job.device_blocks.tolist(), job.slots.tolist(), strict=True):
                h = self._hash_of(job.req_id, block)
                self.stored[h] = self._block_bytes(block).clone()
                self.slot_hash[slot] = h
                self.blocks_stored += 1

    def _on_loads(self, meta: StepMetadata) -> None:
        pool = self.gen.pool.tensor
        for job in meta.loads:
            assert job.skip_blocks == 0
            for block, slot in zip(job.device_blocks.tolist(), job.slots.tolist(), strict=True):
                h = self._hash_of(job.req_id, block)
                assert self.slot_hash[slot] == h, f"slot {slot} holds another block's KV"
                expected = self.stored[h]
                assert torch.equal(pool[slot], expected), f"host slot {slot} != stored bytes"
                assert torch.equal(self._block_bytes(block), expected), (
                    f"device block {block} after the load != the bytes stored for its key"
                )
                self.blocks_loaded += 1


def _interleaved_chat(
    model: Any,
    gen: KVTierGenerator,
    *,
    conversations: int = 2,
    turns: int = 3,
    system_tokens: int = 40,
    user_tokens: int = 36,
    new_tokens: int = 8,
    seed: int = 0,
) -> tuple[list[int], float]:
    """Round-robin turns of conversations sharing a system prompt; each turn's prompt is the
    conversation so far plus new user text. Returns (hit tokens per request, max logit diff)."""
    rng = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    system = torch.randint(0, vocab, (system_tokens,), generator=rng)
    history = [system.clone() for _ in range(conversations)]
    hits: list[int] = []
    worst = 0.0
    for _turn in range(turns):
        for c in range(conversations):
            user = torch.randint(0, vocab, (user_tokens,), generator=rng)
            prompt = torch.cat([history[c], user])
            result = gen.generate_one(prompt, new_tokens)
            ref = generate_greedy(model, prompt.unsqueeze(0).to(model.device), new_tokens)
            tokens = result.tokens.cpu()
            assert torch.equal(tokens, ref.tokens[0].cpu()), f"turn {_turn} conv {c}"
            worst = max(worst, (result.logits.cpu() - ref.logits[0].cpu()).abs().max().item())
            hits.append(result.hit_tokens)
            history[c] = torch.cat([prompt, tokens])
    return hits, worst


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_multi_turn_chat_loads_the_stored_bytes_and_matches_recompute(
    arch: str, device: str
) -> None:
    model, _ = make_demo_model(arch, seed=1)
    model = model.to(device)
    # Replies stored too, so a later turn reuses KV that one-token decode steps produced.
    config = KVTierConfig(offload_prompt_only=False)
    with KVTierGenerator(model, config, block_size=BS, max_blocks=64, namespace=arch) as gen:
        audit = ByteAudit(gen)
        hits, worst = _interleaved_chat(model, gen)
        stats = gen.stats
        # close() releases the pages: their size is read before.
        page_bytes = sum(p[:, :, 0].numel() * p.element_size() for p in gen.pages)
    # Conversation 0 turn 0 (76 tokens) starts cold; conversation 1 turn 0 reuses the 40-token
    # system prompt's 2 full blocks. Turn k+1 reuses every full block of turn k's cache (prompt
    # and reply but the last token): 76+8-1 = 83 tokens -> 5 blocks, then 120+8-1 -> 7 blocks.
    assert hits[:2] == [0, 32]
    assert all(h > 0 for h in hits[2:])
    assert hits[2:] == [80, 80, 112, 112]
    assert worst <= LOGIT_ATOL
    assert audit.blocks_loaded == sum(hits) // BS
    assert audit.blocks_stored > 0
    assert stats.failed_loads == 0
    assert stats.hit_tokens == sum(hits)
    # The byte totals agree with the audited blocks (each block is one page of every layer).
    assert stats.bytes_loaded == audit.blocks_loaded * page_bytes
    assert stats.bytes_stored == audit.blocks_stored * page_bytes


def test_prompt_only_offload_still_reuses_earlier_prompts() -> None:
    """The default config stores prompt blocks only; a later turn still reuses the blocks of
    the earlier turn's prompt (its reply is recomputed)."""
    model, _ = make_demo_model("llama", seed=1)
    with KVTierGenerator(model, block_size=BS, max_blocks=64) as gen:
        audit = ByteAudit(gen)
        hits, worst = _interleaved_chat(model, gen, conversations=1, turns=3)
    assert hits == [0, 64, 112]  # 76-token prompt -> 4 blocks; 120-token prompt -> 7
    assert worst <= LOGIT_ATOL
    assert audit.blocks_loaded == sum(hits) // BS


def test_audit_catches_a_corrupted_host_slot() -> None:
    """Negative control: one flipped byte in the host pool fails the byte check."""
    model, _ = make_demo_model("llama", seed=1)
    prompt = torch.randint(0, 2048, (50,), generator=torch.Generator().manual_seed(3))
    with KVTierGenerator(model, block_size=BS, max_blocks=16) as gen:
        audit = ByteAudit(gen)
        gen.generate_one(prompt, 2)
        gen.flush()
        slot = next(iter(audit.slot_hash))
        gen.pool.tensor[slot, 7] ^= 1
        with pytest.raises(AssertionError, match=f"host slot {slot}"):
            gen.generate_one(torch.cat([prompt, prompt]), 2)
