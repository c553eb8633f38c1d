"""The offline reference policies behind docs/kvaware-evaluation.md's LIRS and LRU-2 figures."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from policy_hit_ratios import belady
from weak_locality import lirs, lru2


def test_lirs_keeps_most_of_a_loop_just_larger_than_the_cache() -> None:
    # LRU misses every access of a 101-block loop in 100 slots; LIRS holds its 98 LIR blocks.
    loop = [i % 101 for i in range(101 * 50)]
    assert lirs(loop, 100, hir_share=0.02) > 94.0
    assert lru2(loop, 100) == 0.0


def test_everything_fits_so_only_first_uses_miss() -> None:
    stream = [i % 10 for i in range(200)]
    assert lirs(stream, 20) == pytest.approx(95.0)
    assert lru2(stream, 20) == pytest.approx(95.0)


def test_lru2_evicts_the_oldest_second_to_last_use_not_the_oldest_last_use() -> None:
    # At access 4, block 1 was used last (3) but block 2's use before its last (1) is newer
    # than block 1's (0): LRU would evict 2, LRU-2 evicts 1, so 2 hits at access 5.
    assert lru2([1, 2, 2, 1, 3, 2], 2) == pytest.approx(100.0 * 3 / 6)


@pytest.mark.parametrize("seed", range(5))
def test_never_above_belady(seed: int) -> None:
    rng = random.Random(seed)
    stream = [rng.randrange(30) for _ in range(400)]
    for capacity in (4, 8, 16):
        bound = belady([stream], capacity)
        assert lirs(stream, capacity) <= bound + 1e-9
        assert lru2(stream, capacity) <= bound + 1e-9
