"""`--advise`: the smallest capacity at which each policy reaches a share of the infinite cache."""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Real
from typing import Final

from kvtier.base import checked_int
from kvtier.sim.runner import ReplayOptions, check_inputs, check_policy, run_named
from kvtier.sim.trace import Trace

_REL_TOL: Final = 1e-12
"""A ratio this close to the target (relative) reaches it: `0.95 * 20/53` rounds above `19/53`,
while a ratio truly below 95% of the infinite cache's falls short by far more."""


def reaches(ratio: float, target: float) -> bool:
    """Whether `ratio` reaches `target`, allowing for the rounding of a float target."""
    return ratio >= target - _REL_TOL * abs(target)


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

    Assumes the hit ratio grows with capacity, which holds for OPT and for LRU offered every
    miss at once without reuse admission (stack algorithms), and holds closely, though not
    provably, otherwise: LRU storing on device eviction or admitting on reuse can hit a few
    blocks less with more room. The answer is exact to within `resolution` blocks, rounded up.
    """
    # A float (2.5) bisected to a fraction of a block, a str failed deep in the search.
    resolution = checked_int("resolution", resolution)
    # A hit ratio lies in 0..1: NaN was never reached (answered "never"), a negative target
    # always (1 block), each without a word.
    if not (isinstance(target, Real) and not isinstance(target, bool) and 0 <= target <= 1):
        raise ValueError(f"target={target!r} is invalid; expected a block hit ratio from 0 to 1")
    if policy == "infinite":
        # It ignores the capacity (a slot per block), so any search would answer 1 block.
        raise ValueError("policy='infinite' is the target, not a policy to size")
    # Before the first replay, which would wrap a misspelt name in a `ReplayError`.
    check_inputs(trace, opts)
    check_policy(policy, opts)
    unique = max(1, trace.num_unique_blocks)
    replays = 0
    seen: dict[int, float] = {}

    def ratio(capacity: int) -> float:
        nonlocal replays
        if capacity not in seen:
            replays += 1
            seen[capacity] = run_named(trace, policy, capacity, opts).block_hit_ratio
        return seen[capacity]

    if target <= 0:
        # Every capacity reaches it (a trace without reuse); bisecting would stop anywhere
        # within `resolution` of 0 rather than at the smallest tier.
        return Advice(policy, target, 1, 1 / unique, ratio(1), replays)
    if not reaches(ratio(unique), target):
        return Advice(policy, target, None, None, seen[unique], replays)
    lo, hi = 0, unique  # ratio(lo) < target (0 blocks hit nothing) and ratio(hi) >= target
    while hi - lo > resolution:
        mid = (lo + hi) // 2
        if reaches(ratio(max(1, mid)), target):
            hi = max(1, mid)
        else:
            lo = mid
    if lo == 0 and hi > 1 and reaches(ratio(1), target):
        # Every tier tried reached the target (a device cache in front that reaches it alone):
        # the smallest tier does too. Stopping within `resolution` of 0 answered up to 0.5% of
        # the unique blocks (44 GiB of Llama-3-8B on the Mooncake trace) for none needed.
        hi = 1
    return Advice(policy, target, hi, hi / unique, seen[hi], replays)
