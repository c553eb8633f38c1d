"""KVTierGenerator fixes from the 2026-11-27 review of the HF integration: each test failed
before its fix."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from helpers import assert_generator_clean, random_ids

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtier.integrations.hf.generator import KVTierGenerator  # noqa: E402
from kvtier.integrations.hf.prefix import generate_greedy  # noqa: E402

BS = 4
VOCAB = 512
_ids = functools.partial(random_ids, vocab=VOCAB)


def _functional_dropout_models() -> list[Any]:
    """Causal LMs whose dropout is `F.dropout(x, p=self.dropout, training=self.training)`
    with a float rate (0.1 by default) and no Dropout module, built from a config: in
    training mode."""
    small = {"vocab_size": VOCAB, "max_position_embeddings": 64, "bos_token_id": 0}
    small |= {"eos_token_id": 0, "pad_token_id": 1}
    return [
        # GPT-2's is a Dropout module, found before this review.
        transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
            eos_token_id=0,
        ),
        transformers.OPTConfig(
            hidden_size=64, ffn_dim=128, word_embed_proj_dim=64, num_hidden_layers=2,
            num_attention_heads=4, **small,
        ),
        transformers.XGLMConfig(
            d_model=64, ffn_dim=128, attention_heads=4, num_layers=2, **small
        ),
        transformers.BioGptConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            **small,
        ),
    ]  # fmt: skip


@pytest.mark.parametrize("config", _functional_dropout_models(), ids=lambda c: c.model_type)
def test_functional_dropout_in_training_mode_is_refused(config: Any) -> None:
    """Before: accepted, and two runs of one prompt gave logits 0.2 to 0.6 apart (noise KV
    stored for every later prompt with the prefix)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert model.training
    prompt = _ids(20, 4)
    with KVTierGenerator(model, block_size=BS, max_blocks=16) as gen:
        with pytest.raises(ValueError, match=r"training mode and .*(dropout=|p=)0\.1.*model\.eval"):
            gen.generate_one(prompt, 3)
        assert gen.stats.requests == 0
        assert_generator_clean(gen)
        model.eval()
        result = gen.generate_one(prompt, 3)
        assert torch.equal(result.tokens, generate_greedy(model, prompt.unsqueeze(0), 3).tokens[0])


@pytest.fixture(scope="module")
def model() -> Any:
    from kvtier.integrations.hf.models import make_demo_model

    small = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128}
    return make_demo_model("llama", seed=4, num_hidden_layers=2, **small)[0]


@pytest.mark.parametrize("max_new_tokens", [0, -1, 2.5, "3"])
def test_generate_of_no_prompts_still_checks_max_new_tokens(
    model: Any, max_new_tokens: Any
) -> None:
    """Before: `generate([], 0)` returned [] (the value was only checked per prompt)."""
    with KVTierGenerator(model, block_size=BS, max_blocks=8) as gen:
        with pytest.raises(ValueError, match=rf"max_new_tokens={max_new_tokens!r} is invalid"):
            gen.generate([], max_new_tokens)
        assert gen.generate([], 2) == []
        assert gen.stats.requests == 0
        assert_generator_clean(gen)
    with pytest.raises(RuntimeError, match="closed"):
        gen.generate([], 2)


def test_ids_on_the_meta_device_are_refused_naming_it(model: Any) -> None:
    """Before: torch's NotImplementedError "Cannot copy out of meta tensor; no data!" (and
    `generate_greedy` a bare `.item()` RuntimeError), naming neither the ids nor the fix."""
    ids = torch.zeros(5, dtype=torch.int64, device="meta")
    with KVTierGenerator(model, block_size=BS, max_blocks=8) as gen:
        with pytest.raises(ValueError, match=r"prompt is a tensor on the meta device.*expected"):
            gen.generate_one(ids, 2)
        with pytest.raises(ValueError, match=r"prompts\[1\]: prompt is a tensor on the meta"):
            gen.generate([_ids(5, 1), ids], 2)
        assert gen.stats.requests == 0
        assert_generator_clean(gen)
    with pytest.raises(ValueError, match=r"input_ids is a tensor on the meta device.*expected"):
        generate_greedy(model, ids.unsqueeze(0), 2)


@pytest.mark.parametrize(
    "prompt",
    [
        [[5, True]],  # one (1, seq_len) row
        [5, "bool tensor"],
        ["int tensor", "bool tensor"],
        [[5, "bool tensor"]],
    ],
    ids=["nested-list", "0-d-tensor", "tensors", "nested-tensor"],
)
def test_bool_ids_nested_or_as_tensors_are_refused(model: Any, prompt: Any) -> None:
    """Before: torch read each of these as the ids 5, 1 and the generator ran them."""

    def real(p: Any) -> Any:
        if isinstance(p, list):
            return [real(t) for t in p]
        return {"bool tensor": torch.tensor(True), "int tensor": torch.tensor(5)}.get(p, p)

    with KVTierGenerator(model, block_size=BS, max_blocks=8) as gen:
        with pytest.raises(TypeError, match=r"token id (True|tensor\(True\)) at position 1"):
            gen.generate_one(real(prompt), 2)
        with pytest.raises(TypeError, match=r"prompts\[0\]: prompt has token id"):
            gen.generate([real(prompt)], 2)
        assert gen.stats.requests == 0
        assert_generator_clean(gen)
        # Integer ids in the same shapes still run.
        row: Any = [[5, 1]]  # one (1, seq_len) row as a list
        assert gen.generate_one(row, 2).tokens.shape == (2,)
        assert gen.generate_one([5, torch.tensor(1)], 2).tokens.shape == (2,)


def _raise_once(obj: Any, name: str) -> list[bool]:
    """Make `obj.<name>` raise RuntimeError on its next call only; returns the arming flag."""
    original = getattr(obj, name)
    armed = [True]

    def call(*args: Any) -> Any:
        if armed and armed.pop():
            raise RuntimeError(f"{name} failed")
        return original(*args)

    setattr(obj, name, call)
    return armed


def _hold_reports_from_the_end(gen: KVTierGenerator) -> list[bool]:
    """Hold the worker's reports from the next request's end until the flag is cleared, so
    its stores are still in flight when `generate_one` returns."""
    held = [False]
    finished, get = gen.scheduler.request_finished, gen.worker.get_finished

    def request_finished(req_id: str, *, release: bool = False) -> bool:
        held[0] = True
        return finished(req_id, release=release)

    gen.scheduler.request_finished = request_finished  # type: ignore[method-assign]
    gen.worker.get_finished = lambda: [] if held[0] else get()  # type: ignore[method-assign]
    return held


@pytest.mark.parametrize(
    ("method", "late"), [("on_request_finished", False), ("on_request_finished", True),
                         ("touch", False)]
)  # fmt: skip
def test_a_policy_raising_as_the_request_ends_frees_its_blocks(
    model: Any, method: str, late: bool
) -> None:
    """The cache policy raises inside `request_finished` (its `touch` of the reused prefix,
    or `on_request_finished`) with the request's stores in flight. Before: the request's
    blocks were neither held nor freed, the stores' `sending` report then raised KeyError in
    every `flush()`, and a prompt needing those blocks failed for good. The connector ends a
    request in the policy when its last store completes: inside `generate_one`, or (`late`)
    in the `flush` that completes stores still running when it returned."""
    first = _ids(30, 1)
    prompt = torch.cat([first, _ids(10, 2)])  # reuses `first`'s 7 blocks, stores 2 more
    with KVTierGenerator(model, block_size=BS, max_blocks=16) as gen:
        gen.generate_one(first, 2)
        gen.flush()
        armed = _raise_once(gen.manager, method)
        held = _hold_reports_from_the_end(gen) if late else [False]
        with pytest.raises(RuntimeError, match=f"{method} failed"):
            gen.generate_one(prompt, 2)
            if late:
                assert armed  # not called yet: the stores are in flight
                held[0] = False
            gen.flush()
        assert not armed
        assert_generator_clean(gen)
        result = gen.generate_one(prompt, 2)
        assert result.hit_tokens == 36
        assert torch.equal(result.tokens, generate_greedy(model, prompt.unsqueeze(0), 2).tokens[0])
        assert_generator_clean(gen)


def test_a_policy_raising_as_a_request_with_no_transfers_ends_frees_its_blocks(
    model: Any,
) -> None:
    """As above with nothing loaded or stored (a prompt shorter than a block). Before: its
    blocks stayed taken for good (no report would ever free them)."""
    with KVTierGenerator(model, block_size=BS, max_blocks=4) as gen:
        _raise_once(gen.manager, "on_request_finished")
        with pytest.raises(RuntimeError, match="on_request_finished failed"):
            gen.generate_one(_ids(3, 1), 2)
        gen.flush()
        assert bool(gen._free.all())
        prompt = _ids(14, 2)  # needs all 4 blocks
        result = gen.generate_one(prompt, 3)
        assert torch.equal(result.tokens, generate_greedy(model, prompt.unsqueeze(0), 3).tokens[0])


def test_a_policy_raising_as_the_request_starts_leaves_it_untracked(model: Any) -> None:
    """The scheduler tracks a request before the policy's `on_new_request`, which raises.
    Before: the request stayed tracked (finished by nobody) for the generator's lifetime."""
    prompt = _ids(30, 1)
    with KVTierGenerator(model, block_size=BS, max_blocks=16) as gen:
        _raise_once(gen.manager, "on_new_request")
        with pytest.raises(RuntimeError, match="on_new_request failed"):
            gen.generate_one(prompt, 2)
        assert gen.stats.requests == 0
        assert_generator_clean(gen)
        result = gen.generate_one(prompt, 2)
        assert torch.equal(result.tokens, generate_greedy(model, prompt.unsqueeze(0), 2).tokens[0])
        assert_generator_clean(gen)


@pytest.mark.parametrize("cache", [(), [], {}], ids=["tuple", "list", "dict"])
def test_a_cache_that_is_not_a_transformers_cache_is_refused(model: Any, cache: Any) -> None:
    """Before: AttributeError "'tuple' object has no attribute 'layers'"."""
    ids = _ids(10, 3).unsqueeze(0)
    with pytest.raises(TypeError, match=rf"cache is a {type(cache).__name__}; expected a "):
        generate_greedy(model, ids, 2, cache=cache)


def test_ids_of_a_vocabulary_resized_after_the_generator_was_built_run() -> None:
    """Before: the vocabulary size was read once, when the generator was built, so after
    `resize_token_embeddings(600)` (new special tokens) id 550 was refused as outside a
    512-row embedding, while recompute ran it."""
    from kvtier.integrations.hf.models import make_demo_model

    small = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128}
    model = make_demo_model("llama", seed=4, num_hidden_layers=2, **small)[0]
    with KVTierGenerator(model, block_size=BS, max_blocks=8) as gen:
        model.resize_token_embeddings(600, mean_resizing=False)
        prompt = torch.tensor([3, 550, 7, 9, 599])
        result = gen.generate_one(prompt, 2)
        assert torch.equal(result.tokens, generate_greedy(model, prompt.unsqueeze(0), 2).tokens[0])
        with pytest.raises(IndexError, match=r"token id 600 .*600-row input embedding"):
            gen.generate_one(torch.tensor([3, 600]), 2)
        assert_generator_clean(gen)
