"""A replay through a manager that served traffic before counts only its own traffic; empty size
flags, `--hash xxh3_128` without xxhash and a device capacity that is not a block count are
clear errors."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli import main
from kvtier.cpu.manager import CPUOffloadingManager
from kvtier.sim.replay import make_manager, replay_engine, replay_flat
from kvtier.sim.result import RunResult
from kvtier.sim.trace import Trace

from .conftest import random_trace, write_mooncake

Replay = Callable[[Trace, CPUOffloadingManager, str], RunResult]


def _flat(t: Trace, m: CPUOffloadingManager, h: str) -> RunResult:
    return replay_flat(t, m, hits_as=h)


def _eager(t: Trace, m: CPUOffloadingManager, h: str) -> RunResult:
    return replay_engine(t, m, device_blocks=2, hits_as=h)


def _on_evict(t: Trace, m: CPUOffloadingManager, h: str) -> RunResult:
    return replay_engine(t, m, device_blocks=2, store_on="on-evict", hits_as=h)


@pytest.mark.parametrize("threshold", [0, 2])
@pytest.mark.parametrize("hits_as", ["touch", "load"])
@pytest.mark.parametrize("replay", [_flat, _eager, _on_evict], ids=["flat", "eager", "on-evict"])
def test_a_replay_counts_only_its_own_traffic(replay: Replay, hits_as: str, threshold: int) -> None:
    # A warm-up pass, then the measured pass on the same manager: the row of the second pass
    # counts the second pass, not the manager's lifetime (which gave cpu_hits above the hits).
    warm, other = random_trace(3, num_requests=60), random_trace(4, num_requests=60)
    mgr = make_manager("lru", 10, store_threshold=threshold)
    replay(warm, mgr, hits_as)
    second = replay(other, mgr, hits_as)
    assert second.cpu_hits == second.hits - second.device_hits
    assert second.loads == second.cpu_hits
    assert second.cpu_hit_ratio <= 1.0
    before = mgr.get_stats()
    third = replay(other, mgr, hits_as)
    after = mgr.get_stats()
    assert (third.stores, third.evictions, third.stores_skipped) == (
        after.stores - before.stores,
        after.evictions - before.evictions,
        after.stores_skipped - before.stores_skipped,
    )
    # The third pass through the warm manager is the second pass again, counter for counter.
    assert (third.cpu_lookups, third.cpu_hits, third.loads) == (
        second.cpu_lookups,
        after.hits - before.hits,
        third.cpu_hits,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--capacities", ""], "--capacities is empty"),
        (["--mode", "engine", "--device-capacity", ""], "capacity '' is invalid"),
    ],
)
def test_an_empty_size_flag_is_an_error_not_the_default(
    tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # `--capacities ''` ran the default grid and `--device-capacity ''` a 1% device, where a
    # blank (' ') was refused: an empty value (an unset shell variable) is not "not given".
    trace = write_mooncake(
        tmp_path / "t.jsonl",
        [{"input_length": 8, "hash_ids": [0, i]} for i in range(1, 30)],
    )
    assert main(["simulate", str(trace), "--policies", "lru", "-q", "--jobs", "1", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier simulate: error: ") and message in err


def test_xxh3_without_xxhash_is_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # xxhash is an optional extra: without it `--hash xxh3_128` ended in a traceback.
    monkeypatch.setitem(sys.modules, "xxhash", None)  # `import xxhash` raises ImportError
    trace = tmp_path / "prompts.jsonl"
    trace.write_text('{"token_ids": [1, 2, 3, 4, 5]}\n')
    args = ["simulate", str(trace), "--hash", "xxh3_128", "--block-tokens", "2", "-q"]
    assert main([*args, "--jobs", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier simulate: error: ") and "pip install kvtier[xxhash]" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("device", [2.5, "5", None, True])
def test_a_device_capacity_that_is_not_a_block_count_is_refused(device: Any) -> None:
    # 2.5 ran a device of "2.5 blocks" and reported it in the row; "5" and None failed on `<`.
    mgr = make_manager("lru", 4)
    with pytest.raises(ValueError, match=r"device capacity=.* is invalid; expected an integer"):
        replay_engine(random_trace(1), mgr, device_blocks=device)
