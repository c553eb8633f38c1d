"""`--advise`: the smallest capacity at which each policy reaches a share of the infinite cache."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.sim.runner import ReplayOptions, run_named
from kvtier.sim.trace import Trace


@dataclass(frozen=True, slots=True)
class Advice:
    """The capacity a policy needs to reach `target` block hit ratio, and what it reached.

    `capacity_blocks` is `None` when even a tier holding every block falls short (admission
    can cap the hit ratio below the infinite cache's).
    """

    policy: str
    target: float
    capacity_blocks: int | None
    capacity_frac: float | None
    block_hit_ratio: float | None
    replays: int


def advise(
    trace: Trace, policy: str, target: float, opts: ReplayOptions, resolution: int
) -> Advice:
    """Bisect the capacity (blocks) at which `policy` first reaches `target` block hit ratio.

    Assumes the hit ratio grows with capacity, which holds for LRU and OPT (stack algorithms)
    and holds closely, though not provably, for the others. The answer is exact to within
    `resolution` blocks, rounded up.
    """
    if resolution < 1:
        raise ValueError(f"resolution={resolution} is invalid; expected >= 1 block")
    unique = max(1, trace.num_unique_blocks)
    replays = 0
    seen: dict[int, float] = {}

    def ratio(capacity: int) -> float:
        nonlocal replays
        if capacity not in seen:
            replays += 1
            seen[capacity] = run_named(trace, policy, capacity, opts).block_hit_ratio
        return seen[capacity]

    if ratio(unique) < target:
        return Advice(policy, target, None, None, seen[unique], replays)
    lo, hi = 0, unique  # ratio(lo) < target (0 blocks hit nothing) and ratio(hi) >= target
    while hi - lo > resolution:
        mid = (lo + hi) // 2
        if ratio(max(1, mid)) >= target:
            hi = max(1, mid)
        else:
            lo = mid
    return Advice(policy, target, hi, hi / unique, seen[hi], replays)
