"""KVTierGenerator's state across many calls, some of which fail, and a model in training mode.

After every call (returned or raised): no job in flight, no request tracked, no pin, every
device block free once flushed; every later call gives recompute's tokens, and `gen.stats`
counts exactly the calls that returned.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from helpers import assert_generator_clean, random_ids

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtier.config import KVTierConfig  # noqa: E402
from kvtier.integrations.hf.generator import KVTierGenerator  # noqa: E402
from kvtier.integrations.hf.models import make_demo_model  # noqa: E402
from kvtier.integrations.hf.prefix import generate_greedy  # noqa: E402

BS = 8
VOCAB = 128


_ids = functools.partial(random_ids, vocab=VOCAB)


@pytest.fixture(scope="module")
def model() -> Any:
    return make_demo_model("llama", seed=3, vocab_size=VOCAB, num_hidden_layers=2)[0]


def test_failures_between_calls_leave_exact_state_and_stats(model: Any) -> None:
    faults: list[str] = []

    def inject(job_id: int, kind: str) -> None:
        if kind in faults:
            faults.remove(kind)
            raise RuntimeError(f"injected {kind} fault")

    base = _ids(30, 1)
    config = KVTierConfig(offload_prompt_only=False)
    expected = {"requests": 0, "prompt_tokens": 0, "hit_tokens": 0, "prefill_tokens": 0}
    with KVTierGenerator(model, config, block_size=BS, max_blocks=12, fault_injector=inject) as gen:
        bpc = config.resolve_blocks_per_chunk(BS)
        chunk_bytes = bpc * sum(t[:, :, 0].numel() * t.element_size() for t in gen.pages)
        original_forward = model.forward
        calls = [0]

        def forward_failing_at(n: int) -> Any:
            def forward(*args: Any, **kwargs: Any) -> Any:
                calls[0] += 1
                if calls[0] == n:
                    raise RuntimeError("model failed")
                return original_forward(*args, **kwargs)

            return forward

        def run(prompt: Any, n: int, hit: int, failed_loads: int = 0) -> Any:
            before = gen.stats.failed_loads
            result = gen.generate_one(prompt, n)
            ref = generate_greedy(model, prompt.unsqueeze(0), n)
            assert torch.equal(result.tokens, ref.tokens[0])
            assert (result.logits - ref.logits[0]).abs().max() <= 1e-4
            assert result.hit_tokens == hit
            assert result.prefill_tokens == prompt.numel() - hit
            assert gen.stats.failed_loads - before == failed_loads
            expected["requests"] += 1
            expected["prompt_tokens"] += prompt.numel()
            expected["hit_tokens"] += hit
            expected["prefill_tokens"] += prompt.numel() - hit
            gen.flush()
            return result

        def check() -> None:
            assert_generator_clean(gen)
            s = gen.stats
            assert (s.requests, s.prompt_tokens, s.hit_tokens, s.prefill_tokens) == tuple(
                expected.values()
            )
            assert len(s.ttft_s) == s.requests
            # Host slots: every used slot holds a stored chunk, none reserved or pinned, and
            # each was stored once (no eviction in this pool).
            m = gen.manager.get_stats()
            assert m.pending_writes == 0 and m.used_slots == m.ready and m.evictions == 0
            assert m.used_slots * chunk_bytes == s.bytes_stored

        first = run(base, 10, 0)  # holds 39 tokens: 4 blocks stored
        check()
        turn = torch.cat([base, first.tokens])  # the prompt plus its reply
        # The model fails in its 3rd forward (a decode step), after a load of 32 tokens.
        with pytest.raises(RuntimeError, match="model failed"), pytest.MonkeyPatch.context() as mp:
            mp.setattr(model, "forward", forward_failing_at(3))
            gen.generate_one(turn, 5)
        check()
        # A failed load: recomputed, counted once.
        faults.append("load")
        run(turn, 5, 0, failed_loads=1)
        check()
        # A failed store of a new prefix: the next call with it recomputes it.
        other = _ids(20, 2)
        faults.append("store")
        run(other, 3, 0)
        check()
        run(other, 3, 0)  # nothing was stored: computed again, and stored now
        check()
        run(other, 3, 16)
        check()
        # The stores of the failed-load call went through: the prefix up to its reply loads.
        run(torch.cat([turn, _ids(4, 3)]), 2, 40)
        check()
        # Bad input between calls changes nothing.
        with pytest.raises(IndexError):
            gen.generate_one([1, VOCAB], 2)
        with pytest.raises(ValueError):
            gen.generate_one(base, 0)
        check()
        run(base, 2, 24)
        check()
    with pytest.raises(RuntimeError, match="closed"):
        gen.generate_one(base, 2)
