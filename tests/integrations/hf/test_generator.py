"""KVTierGenerator reuses stored prefix blocks and matches recompute (integrations.hf.generator).

Uses `InProcessBlockStore`, the test stand-in for the connector.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.integrations.hf.generator import InProcessBlockStore, KVTierGenerator  # noqa: E402
from kvtier.integrations.hf.models import make_demo_model  # noqa: E402
from kvtier.integrations.hf.prefix import generate_greedy  # noqa: E402

LOGIT_ATOL = 1e-4  # reasoning in test_prefix.py


@pytest.fixture(scope="module")
def model() -> Any:
    return make_demo_model("qwen2", seed=2)[0]


def test_chat_turns_hit_earlier_turns_blocks_and_match_recompute(model: Any) -> None:
    gen = KVTierGenerator(model, block_size=16, max_blocks=32, namespace="demo-qwen2")
    rng = torch.Generator().manual_seed(11)
    history = torch.empty(0, dtype=torch.int64)
    hits, prefills = [], []
    for _ in range(3):
        history = torch.cat([history, torch.randint(0, 2048, (40,), generator=rng)])
        result = gen.generate_one(history, 8)
        ref = generate_greedy(model, history.unsqueeze(0), 8)
        assert torch.equal(result.tokens, ref.tokens[0])
        assert (result.logits - ref.logits[0]).abs().max().item() <= LOGIT_ATOL
        hits.append(result.hit_tokens)
        prefills.append(result.prefill_tokens)
        history = torch.cat([history, result.tokens])
    # Turn 2 reuses turn 1's 47 cached tokens as 2 blocks; turn 3 reuses 5 blocks (95 tokens).
    assert hits == [0, 32, 80]
    assert prefills == [40, 88 - 32, 136 - 80]


def test_repeated_prompt_loads_all_of_it(model: Any) -> None:
    gen = KVTierGenerator(model, block_size=16, max_blocks=8)
    prompt = torch.randint(0, 2048, (48,), generator=torch.Generator().manual_seed(12))
    first, again = gen.generate([prompt, prompt], 4)
    assert (first.hit_tokens, again.hit_tokens) == (0, 48)
    assert again.prefill_tokens == 1  # the last prompt token runs again for its logits
    assert torch.equal(first.tokens, again.tokens)


def test_namespaces_do_not_share_blocks(model: Any) -> None:
    a = KVTierGenerator(model, block_size=16, max_blocks=8, namespace="a")
    b = KVTierGenerator(model, block_size=16, max_blocks=8, namespace="b", pages=a.pages)
    store = a.store
    assert isinstance(store, InProcessBlockStore)
    b.store = store  # one store, two models' namespaces
    prompt = torch.randint(0, 2048, (40,), generator=torch.Generator().manual_seed(13))
    a.generate_one(prompt, 4)
    assert b.generate_one(prompt, 4).hit_tokens == 0
    assert a.generate_one(prompt, 4).hit_tokens == 32


def test_too_long_request_is_refused_before_any_work(model: Any) -> None:
    gen = KVTierGenerator(model, block_size=16, max_blocks=2)
    store = gen.store
    assert isinstance(store, InProcessBlockStore)
    with pytest.raises(ValueError, match="needs 3 blocks; the page buffer holds 2"):
        gen.generate_one(list(range(40)), 10)
    assert not store.blocks
