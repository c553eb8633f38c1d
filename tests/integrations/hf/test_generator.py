"""KVTierGenerator on the real manager, connector halves and CPU transfer engine
(kvtier.integrations.hf.generator): batches, failed loads, eviction, stats, bad input.

Every test compares with plain recompute (`generate_greedy` without a cache): tokens must be
identical, logits within `LOGIT_ATOL = 1e-4` (reasoning in test_prefix.py and test_e2e.py).
Byte-exactness of loads is checked in test_e2e.py.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
import pytest

from helpers import random_ids

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.config import KVTierConfig  # noqa: E402
from kvtier.integrations.hf.generator import GenerationResult, KVTierGenerator  # noqa: E402
from kvtier.integrations.hf.models import make_demo_model  # noqa: E402
from kvtier.integrations.hf.prefix import generate_greedy  # noqa: E402

LOGIT_ATOL = 1e-4
BS = 16


@pytest.fixture(scope="module")
def model() -> Any:
    return make_demo_model("qwen2", seed=2)[0]


_ids = functools.partial(random_ids, vocab=2048)


def _assert_matches_recompute(model: Any, prompt: Any, result: GenerationResult) -> None:
    ref = generate_greedy(model, prompt.unsqueeze(0), result.tokens.numel())
    assert torch.equal(result.tokens, ref.tokens[0])
    assert (result.logits - ref.logits[0]).abs().max().item() <= LOGIT_ATOL


def test_batch_of_prompts_with_a_shared_prefix(model: Any) -> None:
    system = _ids(64, 1)
    prompts = [torch.cat([system, _ids(20 + 7 * i, 10 + i)]) for i in range(4)]
    with KVTierGenerator(model, block_size=BS, max_blocks=32) as gen:
        results = gen.generate(prompts, 6)
        stats = gen.stats
    # The first prompt stores the system prompt's 4 blocks; the other three load them.
    assert [r.hit_tokens for r in results] == [0, 64, 64, 64]
    assert [r.prefill_tokens for r in results] == [p.numel() - r.hit_tokens for p, r in
                                                   zip(prompts, results, strict=True)]  # fmt: skip
    for prompt, result in zip(prompts, results, strict=True):
        _assert_matches_recompute(model, prompt, result)
        assert result.logits.shape == (6, 2048)
        assert result.ttft_s > 0
    assert stats.requests == 4
    assert stats.prompt_tokens == sum(p.numel() for p in prompts)
    assert stats.hit_tokens == 192
    assert stats.prefix_hit_ratio == pytest.approx(192 / stats.prompt_tokens)
    assert len(stats.ttft_s) == 4
    assert stats.bytes_loaded > 0 and stats.bytes_stored > 0


def test_repeated_prompt_computes_at_least_its_last_token(model: Any) -> None:
    prompt = _ids(48, 12)
    with KVTierGenerator(model, block_size=BS, max_blocks=8) as gen:
        first, again = gen.generate([prompt, prompt], 4)
    # 3 full blocks are stored, but the block holding the last prompt token is not loaded:
    # the engine must compute at least that token for the first new token's logits.
    assert (first.hit_tokens, again.hit_tokens) == (0, 32)
    assert again.prefill_tokens == 16
    assert torch.equal(first.tokens, again.tokens)


def test_failed_load_is_not_served_and_the_request_recomputes(model: Any) -> None:
    failures: list[int] = []

    def fail_first_load(job_id: int, direction: str) -> None:
        if direction == "load" and not failures:
            failures.append(job_id)
            raise OSError("injected load failure")

    prompt = _ids(70, 13)
    longer = torch.cat([prompt, _ids(30, 14)])
    with KVTierGenerator(model, block_size=BS, max_blocks=8, fault_injector=fail_first_load) as gen:
        gen.generate_one(prompt, 5)
        failed = gen.generate_one(longer, 5)
        assert failures, "the injector never ran: no load was attempted"
        assert failed.hit_tokens == 0
        assert failed.prefill_tokens == longer.numel()
        _assert_matches_recompute(model, longer, failed)
        assert gen.stats.failed_loads == 1
        assert gen.stats.hit_tokens == 0
        assert gen.stats.bytes_loaded == 0
        # Nothing leaked: the chunks are loadable again, and every device block came back (the
        # next request needs all 8).
        again = gen.generate_one(torch.cat([longer, _ids(27, 15)]), 2)
        assert again.hit_tokens > 0
        _assert_matches_recompute(model, torch.cat([longer, _ids(27, 15)]), again)
        assert gen.manager.get_stats().pinned == 0


def test_eviction_under_a_tiny_pool_keeps_outputs_identical(model: Any) -> None:
    config = KVTierConfig(num_slots=6, offload_prompt_only=False)
    with KVTierGenerator(model, config, block_size=BS, max_blocks=16) as gen:
        history = _ids(40, 16)
        hits = []
        for turn in range(4):
            result = gen.generate_one(history, 6)
            _assert_matches_recompute(model, history, result)
            hits.append(result.hit_tokens)
            history = torch.cat([history, result.tokens, _ids(30, 20 + turn)])
        gen.flush()
        manager = gen.manager.get_stats()
    assert manager.evictions > 0
    assert manager.used_slots <= 6
    assert manager.pinned == 0
    # Turns still load what survived eviction (a 148-token history needs 9 blocks, 6 fit).
    assert hits[0] == 0 and all(h > 0 for h in hits[1:])
    assert gen.stats.hit_tokens == sum(hits)


def test_namespaces_give_different_block_hashes(model: Any) -> None:
    a = KVTierGenerator(model, block_size=BS, max_blocks=4, namespace="model-a")
    b = KVTierGenerator(model, block_size=BS, max_blocks=4, namespace="model-b")
    try:
        ids = _ids(32, 17).numpy()
        assert set(a.hasher.hash_blocks(ids)).isdisjoint(b.hasher.hash_blocks(ids))
    finally:
        a.close()
        b.close()


def test_bad_input_is_refused_before_any_work(model: Any) -> None:
    with KVTierGenerator(model, block_size=BS, max_blocks=2) as gen:
        with pytest.raises(ValueError, match="needs 4 blocks; the page buffer holds 2"):
            gen.generate_one(list(range(40)), 10)
        with pytest.raises(ValueError, match="prompt is empty"):
            gen.generate_one([], 3)
        with pytest.raises(ValueError, match="max_new_tokens=0"):
            gen.generate_one([1, 2, 3], 0)
        with pytest.raises(ValueError, match=r"max_new_tokens=2\.5"):
            gen.generate_one([1, 2, 3], 2.5)  # type: ignore[arg-type]
        assert gen.stats.requests == 0
        assert gen.scheduler.num_requests() == 0
        # The generator still works after the refusals.
        result = gen.generate_one(list(range(20)), np.int64(3))  # type: ignore[arg-type]
        assert result.tokens.numel() == 3


def test_close_stops_the_transfer_worker(model: Any) -> None:
    with KVTierGenerator(model, block_size=BS, max_blocks=8) as gen:
        gen.generate_one(_ids(40, 18), 2)
        transfer = gen.transfer  # close() releases it
    assert gen.scheduler.num_jobs_in_flight() == 0
    with pytest.raises(RuntimeError, match="shut down"):
        transfer.submit_store(10_000, [0], [0])


def test_a_failed_generation_frees_its_blocks_and_request(model: Any) -> None:
    """The model itself fails: a token id past its vocabulary (kvtier hashes any id below
    2**32) makes the embedding lookup raise inside the forward pass."""
    with KVTierGenerator(model, block_size=BS, max_blocks=4) as gen:
        bad = _ids(40, 30)
        bad[-1] = model.config.vocab_size
        with pytest.raises(IndexError, match="index out of range"):
            gen.generate_one(bad, 3)
        assert gen.stats.requests == 0
        assert gen.scheduler.num_requests() == 0
        # All 4 blocks came back: a prompt that needs every one of them still runs.
        prompt = _ids(60, 31)
        _assert_matches_recompute(model, prompt, gen.generate_one(prompt, 5))


def test_an_interrupt_during_the_load_frees_its_blocks_and_request(model: Any) -> None:
    """Ctrl-C while a prefix loads must not strand the request or its device blocks."""
    with KVTierGenerator(model, block_size=BS, max_blocks=8) as gen:
        prompt = _ids(70, 32)
        gen.generate_one(prompt, 4)
        gen.flush()

        def interrupted(meta: Any) -> None:
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt), pytest.MonkeyPatch.context() as mp:
            mp.setattr(gen.worker, "wait_for_loads", interrupted)
            gen.generate_one(torch.cat([prompt, _ids(10, 33)]), 4)
        gen.flush()
        assert gen.scheduler.num_requests() == 0
        assert gen.manager.get_stats().pinned == 0
        assert bool(gen._free.all())
        # Every block came back: a prompt that needs all 8 of them still runs.
        longer = torch.cat([prompt, _ids(50, 34)])
        _assert_matches_recompute(model, longer, gen.generate_one(longer, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prompt_on_the_models_gpu(model: Any) -> None:
    """A prompt given on the model's device (as a tokenizer's output moved there) works."""
    gpu = make_demo_model("qwen2", seed=2)[0].to("cuda")
    prompt = _ids(40, 35)
    with KVTierGenerator(gpu, block_size=BS, max_blocks=8) as gen:
        gen.generate_one(prompt.cuda(), 3)
        gen.flush()
        again = gen.generate_one(prompt.cuda(), 3)
    assert again.hit_tokens == 32
    ref = generate_greedy(gpu, prompt.cuda().unsqueeze(0), 3)
    assert torch.equal(again.tokens.cpu(), ref.tokens[0].cpu())


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="thread affinity is Linux-only")
def test_transfer_avoid_submitter_cpu_reaches_the_worker(model: Any) -> None:
    from kvtier.transfer import NativeCPUTransferWorker
    from kvtier.transfer.native import library

    if library() is None:
        pytest.skip("the compiled engine cannot be built")
    for avoid in (True, False):
        config = KVTierConfig(transfer_avoid_submitter_cpu=avoid)
        with KVTierGenerator(model, config, block_size=BS, max_blocks=8) as gen:
            assert isinstance(gen.transfer, NativeCPUTransferWorker)
            assert gen.transfer.avoid_submitter_cpu is avoid
            prompt = _ids(40, 22)
            gen.generate_one(prompt, 2)
            gen.flush()
            _assert_matches_recompute(model, prompt, gen.generate_one(prompt, 2))


def test_transfer_cpus_place_the_copy_threads(model: Any) -> None:
    from kvtier.transfer import NativeCPUTransferWorker
    from kvtier.transfer.native import library

    if library() is None:
        pytest.skip("the compiled engine cannot be built")
    cpu = max(os.sched_getaffinity(0))
    before = set(os.listdir("/proc/self/task"))
    config = KVTierConfig(transfer_cpus=str(cpu))  # type: ignore[arg-type]  # a CPU-list string
    with KVTierGenerator(model, config, block_size=BS, max_blocks=8) as gen:
        started = set(os.listdir("/proc/self/task")) - before
        assert isinstance(gen.transfer, NativeCPUTransferWorker)
        assert started and all(os.sched_getaffinity(int(t)) == {cpu} for t in started)
        assert not gen.transfer.avoid_submitter_cpu
        prompt = _ids(40, 21)
        gen.generate_one(prompt, 2)
        gen.flush()
        _assert_matches_recompute(model, prompt, gen.generate_one(prompt, 2))
