"""Stop tokens (`stop_token_ids`): `generate_greedy` and `KVTierGenerator` end a reply at the
first stop token as transformers' `model.generate(eos_token_id=...)` does, store only the KV
the model computed, and let the next turn reuse the shortened reply.

The stop token is chosen from an unstopped run of the same prompt (these are random-weight
models), so each test knows where the reply must end.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

from helpers import random_ids

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.config import KVTierConfig  # noqa: E402
from kvtier.integrations.hf.generator import KVTierGenerator  # noqa: E402
from kvtier.integrations.hf.models import make_demo_model  # noqa: E402
from kvtier.integrations.hf.prefix import generate_greedy  # noqa: E402

BS = 16
VOCAB = 2048
_ids = functools.partial(random_ids, vocab=VOCAB)


@pytest.fixture(scope="module")
def model() -> Any:
    return make_demo_model("llama", seed=0)[0]


def _stop_at(tokens: Any, step: int) -> tuple[int, int]:
    """A stop token that first appears at `step` or earlier, and that first position."""
    stop = int(tokens[step])
    return stop, int((tokens == stop).nonzero()[0])


def test_generate_greedy_stops_like_transformers_generate(model: Any) -> None:
    prompt = _ids(40, seed=1).unsqueeze(0)
    full = generate_greedy(model, prompt, 20)
    stop, first = _stop_at(full.tokens[0], 9)
    out = generate_greedy(model, prompt, 20, stop_token_ids=[stop, VOCAB - 1])
    assert out.tokens.shape == (1, first + 1)
    assert torch.equal(out.tokens, full.tokens[:, : first + 1])
    assert out.logits.shape == (1, first + 1, VOCAB)
    assert out.lengths is not None and out.lengths.tolist() == [first + 1]
    # The stop token itself is not fed: the cache holds the prompt and the tokens before it.
    assert out.cache.get_seq_length() == 40 + first
    ref = model.generate(
        prompt, max_new_tokens=20, do_sample=False, eos_token_id=stop, pad_token_id=0
    )
    assert torch.equal(out.tokens[0], ref[0, 40:])
    # Without stop tokens every step runs, as before.
    assert generate_greedy(model, prompt, 20).lengths.tolist() == [20]  # type: ignore[union-attr]


def test_a_batch_runs_until_every_row_stopped(model: Any) -> None:
    prompt = torch.stack([_ids(24, seed=3), _ids(24, seed=4)])
    full = generate_greedy(model, prompt, 16).tokens
    stops = [int(full[0, 2]), int(full[1, 9])]

    def first(row: int) -> int:
        return next(i for i, t in enumerate(full[row].tolist()) if t in stops)

    ends = [first(0), first(1)]
    if ends[0] >= ends[1]:
        pytest.skip("these seeds do not make row 0 stop first")
    out = generate_greedy(model, prompt, 16, stop_token_ids=stops)
    # Row 0 stopped first but decoding went on until row 1 did; `lengths` says where each ended.
    assert out.tokens.shape == (2, ends[1] + 1)
    assert out.lengths is not None and out.lengths.tolist() == [ends[0] + 1, ends[1] + 1]
    assert torch.equal(out.tokens, full[:, : ends[1] + 1])


@pytest.mark.parametrize(
    "bad",
    [-1, VOCAB, True, 2.5, "2", [1, -3], torch.tensor(True), np.float64(3.0)],
    ids=repr,
)
def test_bad_stop_token_ids_are_refused_before_any_work(model: Any, bad: object) -> None:
    prompt = _ids(20, seed=5)
    with pytest.raises(ValueError, match=r"stop_token_ids has .*expected token ids"):
        generate_greedy(model, prompt.unsqueeze(0), 4, stop_token_ids=bad)  # type: ignore[arg-type]
    with KVTierGenerator(model, KVTierConfig(num_slots=32), max_blocks=16) as gen:
        with pytest.raises(ValueError, match="stop_token_ids has"):
            gen.generate_one(prompt, 4, stop_token_ids=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="stop_token_ids has"):
            gen.generate([prompt, prompt], 4, stop_token_ids=bad)  # type: ignore[arg-type]
        # Nothing ran, nothing is tracked, and the generator still works.
        assert gen.stats.requests == 0
        assert gen.scheduler.num_requests() == 0
        assert gen.generate_one(prompt, 4).tokens.numel() == 4


def test_a_stopped_reply_is_stored_up_to_its_computed_kv_and_reused(model: Any) -> None:
    prompt = _ids(40, seed=6)
    full = generate_greedy(model, prompt.unsqueeze(0), 30).tokens[0]
    stop, first = _stop_at(full, 27)
    if first < 10:
        pytest.skip("this seed repeats its stop token too early for a reply block")
    config = KVTierConfig(offload_prompt_only=False, num_slots=64)
    with KVTierGenerator(model, config, max_blocks=32) as gen:
        r1 = gen.generate_one(prompt, 30, stop_token_ids=stop)
        assert torch.equal(r1.tokens, full[: first + 1])
        gen.flush()
        # Held KV: the prompt and the reply without its stop token; its full blocks are stored.
        held = 40 + first
        assert gen.manager.get_stats().stores == held // BS
        # The next turn sends the stopped reply back: every block the first turn held loads.
        history = torch.cat([prompt, r1.tokens, _ids(10, seed=7)])
        r2 = gen.generate_one(history, 5, stop_token_ids=[stop])
        assert r2.hit_tokens == held // BS * BS
        ref = generate_greedy(model, history.unsqueeze(0), 5, stop_token_ids=stop)
        assert torch.equal(r2.tokens, ref.tokens[0])
        assert gen.stats.requests == 2
