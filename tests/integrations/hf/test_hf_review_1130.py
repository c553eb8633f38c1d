"""HF integration fixes from the 2026-11-30 review: each test failed before its fix."""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import pytest

from helpers import assert_generator_clean, random_ids, tiny_model_size

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.config import KVTierConfig  # noqa: E402
from kvtier.integrations.hf.generator import GenerationResult, KVTierGenerator  # noqa: E402
from kvtier.integrations.hf.models import make_demo_model  # noqa: E402
from kvtier.integrations.hf.prefix import generate_greedy  # noqa: E402

BS = 8
VOCAB = 512
_ids = functools.partial(random_ids, vocab=VOCAB)
_SMALL = tiny_model_size(VOCAB)


@pytest.fixture(scope="module")
def model() -> Any:
    return make_demo_model("llama", seed=7, **_SMALL)[0]


def _run_in_thread(
    name: str, call: Any, results: dict[str, GenerationResult | BaseException]
) -> threading.Thread:
    def target() -> None:
        try:
            results[name] = call()
        except BaseException as e:  # reported by the test, not lost in the thread
            results[name] = e

    thread = threading.Thread(target=target, name=name)
    thread.start()
    return thread


def test_a_second_thread_cannot_take_a_requests_load(model: Any) -> None:
    """A step's metadata carries every request's unsent loads. Before: a thread whose prompt
    finished while another thread's request sat between its allocation and its load sent that
    load with its own stores; the other request then found no load to wait for and ran on its
    blocks while they still held an earlier prompt's KV (logits 13 off recompute)."""
    prefix, other, stale = _ids(64, 1), _ids(40, 2), _ids(100, 3)
    prompt = torch.cat([prefix, _ids(20, 4)])
    ref = generate_greedy(model, prompt.unsqueeze(0), 6)

    def slow_loads(job_id: int, kind: str) -> None:
        if kind == "load":
            time.sleep(0.5)  # still copying when the request would read its blocks

    other_done = threading.Event()
    config = KVTierConfig(num_slots=64)
    with KVTierGenerator(
        model, config, block_size=BS, max_blocks=64, fault_injector=slow_loads
    ) as gen:
        gen.generate_one(prefix, 1)
        gen.flush()
        gen.generate_one(stale, 1)  # the blocks the next request gets now hold other KV
        gen.flush()
        allocated = gen.scheduler.update_state_after_alloc

        def allocate_then_pause(*args: Any, **kwargs: Any) -> None:
            allocated(*args, **kwargs)
            if threading.current_thread().name == "A":
                # Where the race window is: let B run a whole prompt (it cannot, fixed).
                other_done.wait(timeout=1.0)

        gen.scheduler.update_state_after_alloc = allocate_then_pause  # type: ignore[method-assign]
        results: dict[str, GenerationResult | BaseException] = {}
        a = _run_in_thread("A", lambda: gen.generate_one(prompt, 6), results)
        time.sleep(0.05)

        def run_other() -> GenerationResult:
            try:
                return gen.generate_one(other, 2)
            finally:
                other_done.set()

        b = _run_in_thread("B", run_other, results)
        a.join()
        b.join()
        result = results["A"]
        assert isinstance(result, GenerationResult), result
        assert isinstance(results["B"], GenerationResult), results["B"]
        assert result.hit_tokens == 64
        assert float((result.logits - ref.logits[0]).abs().max()) <= 1e-4
        assert torch.equal(result.tokens, ref.tokens[0])
        assert_generator_clean(gen)


def test_close_from_another_thread_waits_for_the_generation(model: Any) -> None:
    """Before: `close()` in another thread shut the transfer worker down under a running
    generation, whose stores then failed on "the transfer worker is shut down" (a traceback
    logged, its blocks never stored); now close waits for it, and its stores complete."""
    prompt = _ids(48, 5)
    in_model = threading.Event()

    def pause_once(module: Any, args: Any) -> None:
        if threading.current_thread().name == "A" and not in_model.is_set():
            in_model.set()
            time.sleep(0.3)  # close() is called meanwhile

    gen = KVTierGenerator(model, KVTierConfig(num_slots=64), block_size=BS, max_blocks=64)
    block_bytes = gen.kv.registration().max_page_bytes  # close() releases the buffer
    handle = model.register_forward_pre_hook(pause_once)
    try:
        results: dict[str, GenerationResult | BaseException] = {}
        a = _run_in_thread("A", lambda: gen.generate_one(prompt, 3), results)
        assert in_model.wait(timeout=30)
        gen.close()
        a.join()
    finally:
        handle.remove()
        gen.close()
    assert isinstance(results["A"], GenerationResult), results["A"]
    assert gen.stats.bytes_stored == (48 // BS) * block_bytes  # every full prompt block
    assert gen.scheduler.num_jobs_in_flight() == 0
    assert bool(gen._free.all())
    with pytest.raises(RuntimeError, match="closed"):
        gen.generate_one(prompt, 1)


def test_a_generator_built_in_inference_mode_runs_outside_it(model: Any) -> None:
    """Before: built under `torch.inference_mode()`, the paged buffer was made of inference
    tensors, and the first generation outside inference mode failed inside the model's
    forward ("Inplace update to inference tensor outside InferenceMode is not allowed")."""
    prompt = _ids(40, 6)
    ref = generate_greedy(model, prompt.unsqueeze(0), 4)
    with torch.inference_mode():
        gen = KVTierGenerator(model, KVTierConfig(num_slots=64), block_size=BS, max_blocks=64)
    with gen:
        first = gen.generate_one(prompt, 4)
        gen.flush()
        with torch.inference_mode():
            again = gen.generate_one(prompt, 4)
        assert (first.hit_tokens, again.hit_tokens) == (0, 32)
        for result in (first, again):
            assert torch.equal(result.tokens, ref.tokens[0])
        assert_generator_clean(gen)


def test_a_python_copy_thread_can_write_a_pool_built_in_inference_mode(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the native copy library cannot be built, the copies run in a Python thread, which
    is never in inference mode. Before: a generator built and run in inference mode had a host
    pool and staging buffers of inference tensors, so every store failed in that thread and no
    prompt was ever reused."""
    import kvtier.transfer.factory as factory

    monkeypatch.setattr(factory, "library", lambda: None)  # as on a machine without it
    prompt = _ids(40, 7)
    ref = generate_greedy(model, prompt.unsqueeze(0), 4)
    with torch.inference_mode():
        config = KVTierConfig(num_slots=64)
        with KVTierGenerator(model, config, block_size=BS, max_blocks=64) as gen:
            assert type(gen.transfer).__name__ == "CPUTransferWorker"
            first = gen.generate_one(prompt, 4)
            gen.flush()
            again = gen.generate_one(prompt, 4)
            assert gen.stats.bytes_stored > 0
            assert again.hit_tokens == 32
            assert torch.equal(again.tokens, ref.tokens[0])
            assert torch.equal(first.tokens, ref.tokens[0])


def test_pages_allocated_in_inference_mode_take_blocks_outside_it(model: Any) -> None:
    """Before: `allocate_pages` under inference mode gave inference tensors, and
    `extract_blocks` outside it failed on its first write."""
    from kvtier.integrations.hf.kv_blocks import (
        allocate_pages,
        build_cache_from_blocks,
        extract_blocks,
    )

    with torch.inference_mode():
        pages = allocate_pages(model.config, num_blocks=4, block_size=BS)
    out = generate_greedy(model, _ids(17, 8).unsqueeze(0), 1)
    extract_blocks(out.cache, 0, 0, 2, BS, pages, [3, 1])
    rebuilt = build_cache_from_blocks(pages, [[3, 1]], 2 * BS, model.config)
    originals: list[Any] = list(out.cache.layers)
    rebuilt_layers: list[Any] = list(rebuilt.layers)
    for layer, original in zip(rebuilt_layers, originals, strict=True):
        assert torch.equal(layer.keys, original.keys[:, :, : 2 * BS])
        assert torch.equal(layer.values, original.values[:, :, : 2 * BS])


def test_autocast_to_another_dtype_is_named_before_any_work(model: Any) -> None:
    """Before: under `torch.autocast` the model's V came out in bfloat16 and the paged cache
    refused it mid-prefill, telling the user to build a `PagedKVBuffer` with the model's dtype
    (float32, the buffer's own): neither autocast nor what to do was named."""
    prompt = _ids(40, 9)
    ref = generate_greedy(model, prompt.unsqueeze(0), 3)
    with KVTierGenerator(model, KVTierConfig(num_slots=64), block_size=BS, max_blocks=64) as gen:
        forward_calls = [0]

        def count(module: Any, args: Any) -> None:
            forward_calls[0] += 1

        handle = model.register_forward_pre_hook(count)
        try:
            with (
                torch.autocast("cpu", dtype=torch.bfloat16),
                pytest.raises(ValueError, match=r"autocast is on for cpu with torch.bfloat16"),
            ):
                gen.generate_one(prompt, 3)
        finally:
            handle.remove()
        assert forward_calls == [0]
        assert gen.stats.requests == 0
        assert_generator_clean(gen)
        assert torch.equal(gen.generate_one(prompt, 3).tokens, ref.tokens[0])


def test_a_config_change_that_changes_the_kv_is_refused() -> None:
    """Before: after `model.config.sliding_window = 6` the generator served the blocks it had
    stored with full attention to a model that now attends within a window: logits 5.7 off
    recompute, greedy tokens wrong. Fields that leave the KV as it was still run."""
    model = make_demo_model("mistral", seed=3, **_SMALL)[0]
    prompt = _ids(48, 10)
    longer = torch.cat([prompt, _ids(1, 11)])
    with KVTierGenerator(model, KVTierConfig(num_slots=64), block_size=BS, max_blocks=64) as gen:
        gen.generate_one(prompt, 1)
        gen.flush()
        model.config.sliding_window = 6
        with pytest.raises(ValueError, match=r"config changed .*\(sliding_window None -> 6\)"):
            gen.generate_one(longer, 2)
        assert gen.stats.requests == 1
        assert_generator_clean(gen)
        model.config.sliding_window = None
        # Token ids, output switches and the attention kernel leave every K and V as it was.
        model.config.pad_token_id = 0
        model.config.use_cache = False
        model.set_attn_implementation("eager")
        got = gen.generate_one(longer, 2)
        ref = generate_greedy(model, longer.unsqueeze(0), 2)
        assert got.hit_tokens == 48
        assert float((got.logits - ref.logits[0]).abs().max()) <= 1e-4
        assert torch.equal(got.tokens, ref.tokens[0])
