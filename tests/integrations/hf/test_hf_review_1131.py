"""HF integration fixes from the 2026-11-31 review: each test failed before its fix.

Before, `close()` stopped the transfer worker but the generator kept the host pool and the paged
KV buffer alive as long as the object lived (a user who closed one generator and built another
held both pools), and `make_demo_model` took a misspelt config field (`hiden_size=8`) without a
word, building the default size."""

from __future__ import annotations

import functools
import gc
import threading
import weakref
from typing import Any

import pytest

from helpers import interrupt_once, random_ids, tiny_model_size

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.integrations.hf.generator import KVTierGenerator  # noqa: E402
from kvtier.integrations.hf.models import DEMO_ARCHS, make_demo_model  # noqa: E402

BS = 8
VOCAB = 512
_ids = functools.partial(random_ids, vocab=VOCAB)
_SMALL = tiny_model_size(VOCAB)


@pytest.fixture(scope="module")
def model() -> Any:
    return make_demo_model("llama", seed=8, **_SMALL)[0]


def test_close_releases_the_host_pool_and_the_kv_buffer(model: Any) -> None:
    """Weak references to the memory itself (the storages, which every view shares): they die
    once nothing holds the memory, while the closed generator is still referenced."""
    gen = KVTierGenerator(model, block_size=BS, max_blocks=8)
    gen.generate_one(_ids(40, 1), 3)
    pool = weakref.ref(gen.pool.tensor.untyped_storage())
    pages = [weakref.ref(t.untyped_storage()) for t in gen.pages]
    gen.close()
    gc.collect()
    assert (pool() is None) is True, "the host pool's memory outlived close()"
    assert all(p() is None for p in pages), "the KV buffer's memory outlived close()"
    assert gen.stats.requests == 1  # still readable


@pytest.mark.parametrize("part", ["pool", "kv", "pages", "transfer", "worker"])
def test_a_closed_generator_refuses_its_released_parts_clearly(model: Any, part: str) -> None:
    with KVTierGenerator(model, block_size=BS, max_blocks=8) as gen:
        getattr(gen, part)  # there while open
    with pytest.raises(RuntimeError, match=r"KVTierGenerator is closed and its .* was released"):
        getattr(gen, part)
    with pytest.raises(RuntimeError, match="closed"):
        gen.generate_one(_ids(20, 2), 2)
    gen.flush()  # nothing in flight: nothing to wait for
    gen.close()  # closing again does nothing


def test_a_new_generator_after_close_works_and_the_first_holds_nothing(model: Any) -> None:
    first = KVTierGenerator(model, block_size=BS, max_blocks=8)
    prompt = _ids(40, 3)
    expected = first.generate_one(prompt, 3)
    held = weakref.ref(first.pool.tensor.untyped_storage())
    first.close()
    with KVTierGenerator(model, block_size=BS, max_blocks=8) as second:
        gc.collect()
        assert (held() is None) is True, "the first pool's memory outlived close()"
        again = second.generate_one(prompt, 3)
    assert torch.equal(again.tokens, expected.tokens)


@pytest.mark.parametrize("arch", DEMO_ARCHS)
def test_a_misspelt_size_field_is_refused_naming_the_closest_field(arch: str) -> None:
    with pytest.raises(ValueError, match=r"hiden_size=8 is not a field of \w+Config") as e:
        make_demo_model(arch, 0, hiden_size=8, num_hidden_layers=1)
    assert f"(arch={arch!r}); did you mean 'hidden_size'?" in str(e.value)
    with pytest.raises(ValueError, match=r"num_layers=1 .* did you mean 'num_hidden_layers'"):
        make_demo_model(arch, 0, num_layers=1)


def test_a_field_of_another_architecture_is_refused_and_aliases_still_work() -> None:
    # Llama has no sliding window: transformers kept the attribute and attended to everything.
    with pytest.raises(ValueError, match=r"sliding_window=4 is not a field of LlamaConfig"):
        make_demo_model("llama", 0, sliding_window=4, **_SMALL)
    _, mistral = make_demo_model("mistral", 0, sliding_window=4, **_SMALL)
    assert mistral.sliding_window == 4
    # Keyword aliases the config class consumes are fields in all but name.
    _, llama = make_demo_model("llama", 0, rope_theta=5e5, **_SMALL)
    assert llama.rope_parameters["rope_theta"] == 5e5
    with pytest.raises(ValueError, match=r"vocab_sise=64 .* did you mean 'vocab_size'"):
        make_demo_model("qwen2", 0, vocab_sise=64)


def test_a_page_buffer_too_large_to_allocate_names_max_blocks(model: Any) -> None:
    """Before: torch's "DefaultCPUAllocator: can't allocate memory: you tried to allocate
    2048000000000000 bytes", naming no argument. 10**12 blocks are petabytes, past any address
    space, so the allocation fails at once even where memory is overcommitted."""
    with pytest.raises(MemoryError, match=r"num_blocks=1000000000000 blocks of 8 tokens x 2 lay"):
        KVTierGenerator(model, block_size=BS, max_blocks=10**12)


def test_ctrl_c_as_close_stops_the_worker_keeps_the_pool_until_closing_again(
    model: Any,
) -> None:
    # A pool now refuses to close while a worker on it may copy (`HostPool.close`): closing it
    # in a `finally` after an interrupted shutdown turned the Ctrl-C into that RuntimeError.
    # And the generator, marked closed, then had no way left to stop the worker.
    gate = threading.Event()

    def slow_stores(job: int, direction: str) -> None:
        if direction == "store":
            gate.wait(10)

    gen = KVTierGenerator(model, block_size=BS, max_blocks=12, fault_injector=slow_stores)
    gen.generate_one(_ids(30, 3), 3)  # its stores wait at the gate
    transfer, pool = gen.transfer, gen.pool
    transfer.shutdown = interrupt_once(transfer.shutdown, "before")  # type: ignore[method-assign]
    transfer.wait = interrupt_once(transfer.wait, "before")  # type: ignore[method-assign]
    try:
        with pytest.raises(KeyboardInterrupt):
            gen.close()
        assert not pool.closed  # copies may still run into it
        assert gen._pool is pool  # kept, not released under them
    finally:
        gate.set()
    gen.close()  # the user's second try: the one way left to stop the worker
    assert pool.closed, "the host pool stayed open (and pinned) after closing again"
    assert transfer._pool_jobs() is None, "the transfer worker was never shut down"
    assert not hasattr(gen, "_pool") and not hasattr(gen, "_transfer")  # released
    with pytest.raises(RuntimeError, match="closed and its host pool was released"):
        gen.pool  # noqa: B018
    assert gen.stats.requests == 1
    gen.close()  # done: closing again does nothing
