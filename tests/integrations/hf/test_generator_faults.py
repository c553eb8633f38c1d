"""KVTierGenerator under faults and bad input (kvtier.integrations.hf.generator): an error or
interrupt while a finished generation hands its stores to the worker, prompts that are not one
sequence of token ids, and sizes that cannot work.

After a fault: no request left tracked, no job left in flight, every device block free, no pin
held, and the same prompt runs again with the same tokens as recompute.
"""

from __future__ import annotations

import functools
import signal
from typing import Any

import numpy as np
import pytest

from helpers import assert_generator_clean, pool_closes, random_ids

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.config import ConfigError, KVTierConfig  # noqa: E402
from kvtier.connector import StepMetadata  # noqa: E402
from kvtier.integrations.hf.generator import KVTierGenerator  # noqa: E402
from kvtier.integrations.hf.models import make_demo_model  # noqa: E402
from kvtier.integrations.hf.prefix import generate_greedy  # noqa: E402

BS = 16
SMALL = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}


@pytest.fixture(scope="module")
def model() -> Any:
    return make_demo_model("llama", seed=4, **SMALL)[0]


_ids = functools.partial(random_ids, vocab=512)


def _assert_matches_recompute(model: Any, gen: KVTierGenerator, prompt: Any) -> int:
    result = gen.generate_one(prompt, 3)
    ref = generate_greedy(model, prompt.unsqueeze(0), 3)
    assert torch.equal(result.tokens, ref.tokens[0])
    return result.hit_tokens


def test_an_interrupt_while_the_stores_are_handed_over_leaks_nothing(model: Any) -> None:
    """Ctrl-C after the model ran, while the planned stores go to the worker: the stores must
    still reach it (their slots are reserved and their keys pending), or every later prompt
    with this prefix would wait for them forever, and the request and blocks must be freed."""
    prompt = _ids(70, 1)
    with KVTierGenerator(model, block_size=BS, max_blocks=5) as gen:
        original = gen.worker.finish_step
        interrupts = [KeyboardInterrupt()]  # one Ctrl-C

        def interrupted(meta: StepMetadata) -> None:
            if meta.stores and interrupts:
                raise interrupts.pop()
            original(meta)

        with pytest.raises(KeyboardInterrupt), pytest.MonkeyPatch.context() as mp:
            mp.setattr(gen.worker, "finish_step", interrupted)
            gen.generate_one(prompt, 3)
        assert_generator_clean(gen)
        # The stores were made (the KV was complete): the prompt's full blocks are loaded, and
        # a prompt that needs all 5 device blocks runs.
        assert _assert_matches_recompute(model, gen, prompt) == 64
        _assert_matches_recompute(model, gen, torch.cat([prompt, _ids(8, 2)]))
        assert_generator_clean(gen)


def test_an_error_while_the_stores_are_planned_leaks_nothing(model: Any) -> None:
    prompt = _ids(40, 3)
    with KVTierGenerator(model, block_size=BS, max_blocks=4) as gen:
        original = gen.scheduler.build_step_metadata

        def failing(progress: Any = ()) -> StepMetadata:
            if progress:
                raise KeyboardInterrupt
            return original(progress)

        with pytest.raises(KeyboardInterrupt), pytest.MonkeyPatch.context() as mp:
            mp.setattr(gen.scheduler, "build_step_metadata", failing)
            gen.generate_one(prompt, 3)
        assert_generator_clean(gen)
        # Every block came back: a prompt that needs all 4 of them runs.
        _assert_matches_recompute(model, gen, _ids(60, 4))
        assert_generator_clean(gen)


# A bookkeeping call after which a real SIGINT arrives (the handler runs as the call returns,
# before its caller keeps the result), and which call of it: the stores' plan is the second
# build_step_metadata of a prompt whose prefix is loaded.
SIGINT_AFTER = [
    ("scheduler", "add_request", 0),
    ("scheduler", "build_step_metadata", 1),
    ("worker", "get_finished", 0),
    ("scheduler", "take_finished", 0),
    ("worker", "finish_step", 0),
]


@pytest.mark.parametrize(("owner", "name", "nth"), SIGINT_AFTER)
def test_ctrl_c_as_a_bookkeeping_call_returns_loses_nothing(
    model: Any, owner: str, name: str, nth: int
) -> None:
    """Ctrl-C can land between any two bytecodes: as `build_step_metadata` returns the planned
    stores, before the generator keeps them, the stores were never handed over and their keys
    stayed pending (a later prompt with that prefix waited forever); as `get_finished` or
    `take_finished` returns, the results were dropped. The generator holds SIGINT back
    outside the model and delivers it when its bookkeeping is consistent."""
    prompt = _ids(70, 5)
    with KVTierGenerator(model, block_size=BS, max_blocks=8) as gen:
        gen.generate_one(prompt[:40], 3)  # a stored prefix: the next prompt loads it
        gen.flush()
        target = getattr(gen, owner)
        original = getattr(target, name)
        calls = [0]

        def then_ctrl_c(*args: Any) -> Any:
            result = original(*args)
            calls[0] += 1
            if calls[0] == nth + 1:
                signal.raise_signal(signal.SIGINT)
            return result

        with pytest.raises(KeyboardInterrupt), pytest.MonkeyPatch.context() as mp:
            mp.setattr(target, name, then_ctrl_c)
            gen.generate_one(prompt, 3)
        assert calls[0] > nth, "the interrupt was never sent"
        assert_generator_clean(gen)
        assert gen.manager.get_stats().pending_writes == 0
        # The prefix still loads (nothing waits for a store that never comes), and the output
        # is the recomputed one.
        assert _assert_matches_recompute(model, gen, prompt) >= 32
        assert_generator_clean(gen)


def test_ctrl_c_in_the_model_stops_it_at_once(model: Any) -> None:
    """SIGINT is held back only around the bookkeeping: in the model's forward passes it
    stops generation at the next bytecode, not after the last token."""
    prompt = _ids(40, 6)
    with KVTierGenerator(model, block_size=BS, max_blocks=8) as gen:
        original = model.forward
        calls = [0]

        def forward(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1:
                signal.raise_signal(signal.SIGINT)
            return original(*args, **kwargs)

        with pytest.raises(KeyboardInterrupt), pytest.MonkeyPatch.context() as mp:
            mp.setattr(model, "forward", forward)
            gen.generate_one(prompt, 5)
        assert calls[0] == 1
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert_generator_clean(gen)
        _assert_matches_recompute(model, gen, prompt)


def test_a_batch_of_prompts_is_not_run_as_one_prompt(model: Any) -> None:
    """A (2, T) tensor (a tokenizer's batch) flattened would silently generate for the two
    prompts concatenated."""
    with KVTierGenerator(model, block_size=BS, max_blocks=8) as gen:
        with pytest.raises(ValueError, match=r"shape \(2, 20\).*generate\(\)"):
            gen.generate_one(torch.stack([_ids(20, 5), _ids(20, 6)]), 3)
        # One row, as a tokenizer returns it for one text, is one prompt.
        row = _ids(20, 7)
        result = gen.generate_one(row.unsqueeze(0), 3)
        assert torch.equal(result.tokens, generate_greedy(model, row.unsqueeze(0), 3).tokens[0])
        assert gen.stats.requests == 1
        assert_generator_clean(gen)


@pytest.mark.parametrize(
    "prompt", [[1.7, 2.2, 3.9], torch.tensor([1.5, 2.5]), torch.tensor([True, False])]
)
def test_token_ids_that_are_not_integers_are_refused(model: Any, prompt: Any) -> None:
    """Not truncated to other token ids."""
    with KVTierGenerator(model, block_size=BS, max_blocks=8) as gen:
        with pytest.raises(TypeError, match="expected integer token ids"):
            gen.generate_one(prompt, 3)
        assert gen.stats.requests == 0 and gen.scheduler.num_requests() == 0


def test_sizes_that_cannot_work_are_clear_errors(model: Any) -> None:
    with pytest.raises(ValueError, match=r"max_blocks=0 is invalid"):
        KVTierGenerator(model, block_size=BS, max_blocks=0)
    with pytest.raises(ValueError, match=r"max_blocks=8\.0 is invalid"):
        KVTierGenerator(model, block_size=BS, max_blocks=8.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"block_size=16\.0 is invalid"):
        KVTierGenerator(model, block_size=16.0, max_blocks=8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"config=\{'num_slots': 8\} has type dict; expected a"):
        KVTierGenerator(model, {"num_slots": 8}, block_size=BS)  # type: ignore[arg-type]
    KVTierGenerator(model, block_size=np.int64(BS), max_blocks=np.int64(8)).close()  # type: ignore[arg-type]
    # A chunk larger than the whole page buffer can never be stored: refused, instead of a
    # pool of 0 slots or a cache that silently never stores.
    for config in (
        KVTierConfig(blocks_per_chunk=16),
        KVTierConfig(blocks_per_chunk=9, num_slots=4),
    ):
        with pytest.raises(ValueError, match=r"blocks_per_chunk=\d+ .*max_blocks=8"):
            KVTierGenerator(model, config, block_size=BS, max_blocks=8)


@pytest.mark.parametrize(
    ("arch", "size"),
    [
        ("llama", {"head_dim": 32}),  # head_dim != hidden_size / heads (64 / 4)
        ("qwen2", {"num_key_value_heads": 1}),  # multi-query attention
        # Full and sliding layers in one model (layer 0 full, layer 1 a 24-token window).
        ("qwen2", {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1}),
        ("mistral", {"sliding_window": 24}),
    ],
)
def test_edge_prompts_match_recompute_on_each_layout(arch: str, size: dict[str, Any]) -> None:
    """One-token prompt, a prompt of exactly two blocks and then that prompt again (all of it
    cached: its last block is computed), a longer prompt with one new token."""
    model = make_demo_model(arch, seed=5, **{**SMALL, **size})[0]
    two_blocks = _ids(2 * BS, 8)
    longer = torch.cat([two_blocks, _ids(13, 9)])
    cases = [(_ids(1, 7), 2, 0), (two_blocks, 3, 0), (two_blocks, 3, BS), (longer, 1, 2 * BS)]
    config = KVTierConfig(offload_prompt_only=False)
    with KVTierGenerator(model, config, block_size=BS, max_blocks=6) as gen:
        for prompt, new, hit in cases:
            result = gen.generate_one(prompt, new)
            ref = generate_greedy(model, prompt.unsqueeze(0), new)
            assert result.hit_tokens == hit
            assert result.prefill_tokens == prompt.numel() - hit
            assert torch.equal(result.tokens, ref.tokens[0])
            assert (result.logits - ref.logits[0]).abs().max().item() <= 1e-4
            gen.flush()
        assert_generator_clean(gen)


def test_a_transfer_setting_this_machine_cannot_honour_is_a_config_error(model: Any) -> None:
    # The model's KV is on the host: the CUDA backend cannot copy it. The error names the
    # setting, and the host pool made before it is unpinned, not left to the collector.
    config = KVTierConfig(transfer_backend="cuda")
    refused = pytest.raises(ConfigError, match=r"transfer_backend='cuda'.*on a CUDA device")
    with pool_closes() as closed, refused:
        KVTierGenerator(model, config, block_size=BS, max_blocks=8)
    assert len(closed) == 1


# -- a cpu_bytes too small for one host slot: a ConfigError naming the setting as the user gave
# it, as the vLLM connector's start-up check does


def _slot_bytes(model: Any, blocks_per_chunk: int) -> int:
    with KVTierGenerator(
        model, KVTierConfig(num_slots=1, blocks_per_chunk=blocks_per_chunk), block_size=BS
    ) as gen:
        return int(gen.pool.slot_bytes)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (
            KVTierConfig.load(env={"KVTIER_CPU_BYTES": "1KiB"}),
            "KVTIER_CPU_BYTES=1024 (from environment)",
        ),
        (KVTierConfig.from_dict({"cpu_bytes": 1000}), "cpu_bytes=1000 (from dict)"),
        (KVTierConfig(cpu_bytes=1), "cpu_bytes=1 (from KVTierConfig())"),
    ],
)
def test_a_budget_below_one_slot_is_a_config_error_naming_cpu_bytes(
    model: Any, config: KVTierConfig, named: str
) -> None:
    """It was a bare ValueError naming HostPool's `byte_budget`, a name the user never wrote."""
    slot = _slot_bytes(model, 1)
    with pytest.raises(ConfigError) as info:
        KVTierGenerator(model, config, block_size=BS, max_blocks=8)
    assert str(info.value) == (
        f"{named} holds no slot of {slot} bytes (1 blocks x {slot} bytes); "
        f"expected at least {slot} bytes"
    )


def test_the_slot_counts_every_block_of_a_chunk(model: Any) -> None:
    slot = _slot_bytes(model, 2)
    config = KVTierConfig(cpu_bytes=slot - 1, blocks_per_chunk=2)
    with pytest.raises(ConfigError, match=rf"holds no slot of {slot} bytes \(2 blocks x"):
        KVTierGenerator(model, config, block_size=BS, max_blocks=8)
    with KVTierGenerator(
        model, KVTierConfig(cpu_bytes=slot, blocks_per_chunk=2), block_size=BS
    ) as gen:
        assert gen.pool.num_slots == 1
