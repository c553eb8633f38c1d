"""KVTierConnector with an EAGLE-style drafter: a drafter layer's KV at a position is built from
the token after it, so a chunk stored by one request is served to another only if the chunk
after it hits too (the same next token), as vLLM's own prefix cache and offloading connector
drop a hit's last block for drafter groups.

No drafter can run here (vLLM cannot load an EAGLE head without its compiled ops), so the
`SpeculativeConfig` is built without its constructor's draft-model checks; the real vLLM
`Scheduler` runs with it and reads it as it would for a served EAGLE model."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import BLOCK_SIZE, make_engine, make_kv_cache_config, make_vllm_config, token_value
from test_vllm import EXTRA, MODULE, PROMPT, vllm_loaded

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm


def speculative_config(method: str, disable_block_drop: bool = False) -> Any:
    from vllm.config import SpeculativeConfig

    config = object.__new__(SpeculativeConfig)
    for f in dataclasses.fields(SpeculativeConfig):
        if f.default is not dataclasses.MISSING:
            object.__setattr__(config, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            object.__setattr__(config, f.name, f.default_factory())
    object.__setattr__(config, "method", method)
    object.__setattr__(config, "num_speculative_tokens", 2)
    object.__setattr__(config, "disable_eagle_block_drop", disable_block_drop)
    return config


def drafter_kv_cache_config(num_blocks: int, flagged: bool = True) -> Any:
    """A target group and a drafter group (vLLM's `is_eagle_group`)."""
    config = make_kv_cache_config(num_blocks, 2)
    config.kv_cache_groups[1].is_eagle_group = flagged
    return config


def set_speculative(method: str, disable_block_drop: bool = False) -> Any:
    def configure(vllm_config: Any) -> None:
        vllm_config.speculative_config = speculative_config(method, disable_block_drop)

    return configure


def test_a_chunk_is_loaded_only_when_the_chunk_after_it_hits_too(vllm_loaded: None) -> None:
    engine = make_engine(
        "KVTierConnector",
        EXTRA,
        num_groups=2,
        kv_cache_config=drafter_kv_cache_config(64),
        configure=set_speculative("eagle"),
    )
    side = engine.scheduler.connector.scheduler_side
    assert side.scheduler.proof_chunks == 1
    engine.add("a", PROMPT)  # 4 full blocks stored
    engine.run_until(["a"])
    assert side.manager.get_stats().stores == 2 * 4
    assert engine.scheduler.reset_prefix_cache()
    for t in engine.kv_caches.values():
        t.zero_()  # only a load from kvtier can bring the bytes back

    # b shares a's first three blocks, then differs: the third is unproven (its last
    # position's drafter KV was built from a's next token, not b's), so two are loaded.
    b_tokens = [*PROMPT[: 3 * BLOCK_SIZE], *range(500, 530)]
    # c extends a's whole prompt: a's fourth block is followed by a token of c's that kvtier
    # never stored, so three are loaded (without the proof: four).
    c_tokens = [*PROMPT, *range(700, 720)]
    for rid, tokens, loaded in (("b", b_tokens, 2), ("c", c_tokens, 3)):
        request = engine.add(rid, tokens)
        engine.step()
        assert request.status.name == "WAITING_FOR_REMOTE_KVS"
        assert request.num_computed_tokens == loaded * BLOCK_SIZE
        engine.step()
        table = engine.scheduler.kv_cache_manager.get_block_ids(rid)
        for name, t in engine.kv_caches.items():
            layer = int(name.split(".")[2])
            group = engine.group_of_layer[name]
            for p in range(loaded * BLOCK_SIZE):
                got = t[table[group][p // BLOCK_SIZE], :, p % BLOCK_SIZE, :]
                assert bool((got == token_value(tokens, p, layer)).all()), (rid, name, p)
        engine.run_until([rid])
    assert side.scheduler.num_jobs_in_flight() == 0
    assert side.manager.get_stats().pinned == 0


@pytest.mark.parametrize(
    ("method", "disable_block_drop", "flagged", "proof"),
    [
        ("eagle", False, True, 1),
        ("eagle3", False, True, 1),
        ("mtp", False, True, 1),
        ("eagle", True, True, 0),  # --speculative-config '{"disable_eagle_block_drop": true}'
        ("eagle", False, False, 0),  # no drafter group: a drafter sharing the target's KV
        ("ngram", False, True, 0),  # drafts from the prompt, no drafter KV
        ("dflash", False, True, 0),  # draft KV from the target's hidden state alone
    ],
)
def test_which_speculative_configs_need_the_proof(
    vllm_loaded: None, method: str, disable_block_drop: bool, flagged: bool, proof: int
) -> None:
    from kvtier.integrations.vllm.setup import resolve_setup

    vllm_config = make_vllm_config("KVTierConnector", EXTRA, 64, MODULE)
    set_speculative(method, disable_block_drop)(vllm_config)
    setup = resolve_setup(vllm_config, drafter_kv_cache_config(64, flagged))
    assert setup.proof_chunks == proof
