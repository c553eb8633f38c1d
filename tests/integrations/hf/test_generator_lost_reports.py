"""KVTierGenerator when a transfer's result is handed over by the worker but never applied: a
manager call raising while it is applied (a cache policy plugin's), or Ctrl-C while `close()`
waits for stores. Once no copy of theirs can run, such jobs must be finished (with their outcome
where every report is in) or failed: a store's keys left pending made every later prompt with
the prefix wait forever (with Ctrl-C held back), and a load's pins and device blocks stayed
held. `close()` also unpins the host pool."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import pytest

from helpers import assert_generator_clean, interrupt_once, pool_closes, random_ids
from kvtier.base import OffloadKey, ReqContext
from kvtier.policies.lru import LRUPolicy

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.config import KVTierConfig  # noqa: E402
from kvtier.integrations.hf.generator import KVTierGenerator  # noqa: E402
from kvtier.integrations.hf.models import make_demo_model  # noqa: E402
from kvtier.integrations.hf.prefix import generate_greedy  # noqa: E402

BS = 8
VOCAB = 128


class Flaky(LRUPolicy):
    """LRU whose `insert` or `unpin`, whichever `fail_in` names, raises once (a plugin's
    transient failure): the manager then leaves the keys pending, or pinned, as its contract
    says."""

    fail_in: str | None = None

    def _fail(self, method: str) -> None:
        if Flaky.fail_in == method:
            Flaky.fail_in = None
            raise MemoryError("transient")

    def insert(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        self._fail("insert")
        super().insert(keys, ctx)

    def unpin(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        self._fail("unpin")
        super().unpin(keys, ctx)


@pytest.fixture(scope="module")
def model() -> Any:
    return make_demo_model("llama", seed=3, vocab_size=VOCAB, num_hidden_layers=2)[0]


def _generator(model: Any) -> KVTierGenerator:
    config = KVTierConfig(cache_policy=f"{__name__}:Flaky")
    return KVTierGenerator(model, config, block_size=BS, max_blocks=12)


def _same_as_recompute(model: Any, gen: KVTierGenerator, prompt: Any) -> int:
    result = gen.generate_one(prompt, 3)
    assert torch.equal(result.tokens, generate_greedy(model, prompt.unsqueeze(0), 3).tokens[0])
    return result.hit_tokens


def _raises_once(calls: Iterable[Any]) -> None:
    with pytest.raises(MemoryError, match="transient"):
        for call in calls:
            call()


def test_a_store_whose_completion_raised_is_finished_not_left_pending(model: Any) -> None:
    prompt = random_ids(30, 1, vocab=VOCAB)
    gen = _generator(model)
    Flaky.fail_in = "insert"
    _raises_once([lambda: gen.generate_one(prompt, 3), gen.flush])
    assert_generator_clean(gen)
    assert gen.manager.get_stats().pending_writes == 0
    # The copies had succeeded: their completion, applied again, stores the chunks, and the
    # next prompt with the prefix loads them rather than waiting forever.
    assert _same_as_recompute(model, gen, prompt) == 24
    assert_generator_clean(gen)
    gen.close()


def test_a_load_whose_completion_raised_releases_its_pins_and_blocks(model: Any) -> None:
    prompt = random_ids(30, 2, vocab=VOCAB)
    gen = _generator(model)
    _same_as_recompute(model, gen, prompt)
    gen.flush()
    Flaky.fail_in = "unpin"
    _raises_once([lambda: gen.generate_one(prompt, 3), gen.flush])
    assert_generator_clean(gen)
    assert _same_as_recompute(model, gen, prompt) == 24
    gen.close()


def test_an_interrupted_close_still_applies_every_result_and_unpins_the_pool(model: Any) -> None:
    gate = threading.Event()

    def slow_stores(job_id: int, direction: str) -> None:
        if direction == "store":
            gate.wait(10)

    with pool_closes() as closed:
        gen = KVTierGenerator(model, block_size=BS, max_blocks=12, fault_injector=slow_stores)
        gen.generate_one(random_ids(30, 3, vocab=VOCAB), 3)  # its stores wait at the gate
        assert gen.scheduler.num_jobs_in_flight() > 0
        pool, transfer = gen.pool, gen.transfer  # close() releases them
        transfer.wait = interrupt_once(transfer.wait, "before")  # type: ignore[method-assign]
        threading.Timer(0.2, gate.set).start()  # the copies end while the worker shuts down
        with pytest.raises(KeyboardInterrupt):
            gen.close()
        gen.close()  # closing again does nothing
    assert closed == [pool]
    assert gen.scheduler.num_jobs_in_flight() == 0
    assert gen.scheduler.num_requests() == 0
    stats = gen.manager.get_stats()
    assert (stats.pending_writes, stats.pinned) == (0, 0)
    assert bool(gen._free.all())
    assert transfer.get_finished() == []


def test_close_unpins_the_host_pool(model: Any) -> None:
    with pool_closes() as closed, KVTierGenerator(model, block_size=BS, max_blocks=12) as gen:
        gen.generate_one(random_ids(30, 4, vocab=VOCAB), 3)
        pool = gen.pool  # close() releases it
    assert closed == [pool]
