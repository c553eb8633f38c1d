"""Random trace families, drawn after kvaware's design was fixed: where does each policy fall
below LRU?

kvaware promises to be no worse than LRU on traffic it was not designed on; the Mooncake
traces, the synthetic families of policy_hit_ratios.py and the stress families of
policy_stress.py are fixed sets. Here every seed draws a family (shared-prefix popularity,
multi-turn chat, agents, documents reused in bursts, a loop among one-off requests, or phases
of these) and its parameters at random, so the check covers shapes nobody chose. Flat mode
(or `--engine`) through the real `CPUOffloadingManager`, at 1/5/10/25% of each trace's
unique blocks. Prints every cell below LRU with the parameters that reproduce it, then per
policy: cells below LRU, their losses summed, the worst, and the mean difference.

    python benchmarks/policy_fuzz.py [--seeds 0:60] [--policies lru,arc,s3fifo,sieve,kvaware]
        [--engine eager|on-evict] [--jobs 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypedDict

from _cli import progress, require_distinct, require_writable, worker_pool, write_results
from kvtier.policies import registered_policies
from policy_hit_ratios import FRACTIONS, as_trace, replay
from policy_stress import ChainIds

# A trace and the parameters that drew it (a JSON record, different for each family).
Draw = tuple[list[list[int]], Mapping[str, Any]]


class PrefixParams(TypedDict):
    prefixes: int
    prefix_blocks: int
    zipf: float
    drift: float
    own_blocks: int


class ChatParams(TypedDict):
    live: int
    system_blocks: int
    first_blocks: int
    turn_blocks: int
    end: float
    skew: float


class DocumentParams(TypedDict):
    live: int
    blocks: tuple[int, int]
    questions: tuple[int, int]


class LoopParams(TypedDict):
    loop_requests: int
    request_blocks: int
    loop_share: float


def _zipf(rng: random.Random, n: int, a: float) -> Callable[[], int]:
    """A sampler of ranks 0..n-1 with weight 1 / (rank + 1) ** a."""
    cum = list(itertools.accumulate(1.0 / (r + 1) ** a for r in range(n)))
    return lambda: bisect.bisect_left(cum, rng.random() * cum[-1])


def prefixes(rng: random.Random, accesses: int) -> tuple[list[list[int]], PrefixParams]:
    """Zipf-popular shared prefixes, each request ending in a few blocks of its own; the
    popularity ranking may drift to new prefixes."""
    p: PrefixParams = {
        "prefixes": rng.choice([20, 100, 500, 2000]),
        "prefix_blocks": rng.randint(1, 30),
        "zipf": round(rng.uniform(0.3, 1.3), 2),
        "drift": rng.choice([0.0, 0.001, 0.01, 0.05]),
        "own_blocks": rng.randint(0, 10),
    }
    ids, rank = ChainIds(), _zipf(rng, p["prefixes"], p["zipf"])
    out: list[list[int]] = []
    shift = n = total = 0
    while total < accesses:
        shift += rng.random() < p["drift"]
        prefix = rank() + shift
        chain = ids.chain([("p", prefix, i) for i in range(p["prefix_blocks"])])
        chain += ids.chain(
            [("own", n, i) for i in range(rng.randint(0, p["own_blocks"]))], chain[-1]
        )
        out.append(chain)
        total += len(chain)
        n += 1
    return out, p


def chat(
    rng: random.Random, accesses: int, *, agent: bool = False
) -> tuple[list[list[int]], ChatParams]:
    """Live sessions behind a shared system prompt; a turn resends the session's context and
    adds its reply and the next message. Sessions end after any turn with a fixed chance. Chat
    picks the next speaker with a skew toward the longest-lived sessions; agents rotate
    through a few sessions with short turns."""
    p: ChatParams = {
        "live": rng.choice([3, 8, 20, 60] if agent else [2, 4, 10, 40, 200, 1000]),
        "system_blocks": rng.randint(0, 8),
        "first_blocks": rng.randint(1, 60),
        "turn_blocks": 4 if agent else rng.randint(1, 12),
        "end": round(rng.uniform(0.02, 0.4), 2),
        "skew": round(rng.uniform(0.0, 1.5), 2),
    }
    ids = ChainIds()
    system = ids.chain([("sys", i) for i in range(p["system_blocks"])])
    sessions: list[list[Any]] = []  # [session id, context chain, turns]
    out: list[list[int]] = []
    made = total = 0
    while total < accesses:
        while len(sessions) < p["live"]:
            made += 1
            first = [("first", made, i) for i in range(rng.randint(1, p["first_blocks"]))]
            sessions.append([made, system + ids.chain(first, system[-1] if system else 0), 0])
        k = min(len(sessions) - 1, int(len(sessions) * rng.random() ** (1 + p["skew"])))
        s = sessions[k]
        out.append(list(s[1]))
        total += len(s[1])
        turn = [("turn", s[0], s[2], i) for i in range(rng.randint(1, p["turn_blocks"]))]
        s[1] = s[1] + ids.chain(turn, s[1][-1])
        s[2] += 1
        if rng.random() < p["end"]:
            sessions.pop(k)
        elif agent:
            sessions.append(sessions.pop(k))
    return out, p


def documents(rng: random.Random, accesses: int) -> tuple[list[list[int]], DocumentParams]:
    """Documents in use a few at a time, each asked about a few times and then dropped."""
    p: DocumentParams = {
        "live": rng.choice([1, 3, 5, 10, 30]),
        "blocks": (rng.randint(5, 50), rng.randint(50, 400)),
        "questions": (1, rng.randint(2, 10)),
    }
    ids = ChainIds()
    docs: list[list[int]] = []  # [doc id, blocks, questions left]
    out: list[list[int]] = []
    made = n = total = 0
    while total < accesses:
        if not docs or (len(docs) < p["live"] and rng.random() < 0.3):
            made += 1
            docs.append([made, rng.randint(*p["blocks"]), rng.randint(*p["questions"])])
        doc = rng.choice(docs)
        chain = ids.chain(["sys0", "sys1"])
        chain += ids.chain([("doc", doc[0], i) for i in range(doc[1])], chain[-1])
        out.append(chain + ids.chain([("question", n)], chain[-1]))
        total += len(out[-1])
        n += 1
        doc[2] -= 1
        if doc[2] == 0:
            docs.remove(doc)
    return out, p


def loop(rng: random.Random, accesses: int) -> tuple[list[list[int]], LoopParams]:
    """A fixed cycle of requests (a scan longer or shorter than the cache), interleaved with
    one-off requests of the same size."""
    p: LoopParams = {
        "loop_requests": rng.randint(10, 300),
        "request_blocks": rng.randint(1, 50),
        "loop_share": round(rng.uniform(0.1, 0.9), 2),
    }
    ids = ChainIds()
    out: list[list[int]] = []
    total = pos = n = 0
    while total < accesses:
        size = p["request_blocks"]
        if rng.random() < p["loop_share"]:
            out.append(ids.chain([("loop", pos, i) for i in range(size)]))
            pos = (pos + 1) % p["loop_requests"]
        else:
            out.append(ids.chain([("once", n, i) for i in range(size)]))
        total += size
        n += 1
    return out, p


FAMILIES: dict[str, Callable[[random.Random, int], Draw]] = {
    "prefixes": prefixes,
    "chat": chat,
    "agent": lambda rng, accesses: chat(rng, accesses, agent=True),
    "documents": documents,
    "loop": loop,
}


def draw(seed: int) -> Draw:
    """The trace of one seed: a family and its parameters at 15,000-60,000 block accesses, or
    2-4 phases of families one after another, each phase with blocks of its own."""
    rng = random.Random(seed)
    kind = rng.choice([*FAMILIES, "phases"])
    if kind != "phases":
        requests, params = FAMILIES[kind](rng, rng.randint(15_000, 60_000))
        return requests, {"family": kind, **params}
    requests, phases = [], []
    for phase in range(rng.randint(2, 4)):
        sub = rng.choice(list(FAMILIES))
        part, params = FAMILIES[sub](rng, rng.randint(15_000, 60_000))
        offset = (phase + 1) << 40
        requests += [[b + offset for b in r] for r in part]
        phases.append({"family": sub, **params})
    return requests, {"family": "phases", "phases": phases}


def _run(task: tuple[int, tuple[str, ...], str | None]) -> list[dict[str, Any]]:
    """One seed's trace, drawn once and replayed at every capacity: one row per capacity."""
    seed, names, engine = task
    requests, params = draw(seed)
    unique = len({b for r in requests for b in r})
    trace = as_trace(requests, f"seed-{seed}")
    rows = []
    for frac in FRACTIONS:
        capacity = max(8, int(frac * unique))
        ratios = {n: replay(n, trace, capacity, engine) for n in names}
        rows.append(
            {
                "seed": seed,
                "frac": frac,
                "capacity_blocks": capacity,
                "hit_ratio": ratios,
                "params": params,
            }
        )
    return rows


def _seeds(text: str) -> range:
    start, sep, stop = text.partition(":")
    try:
        seeds = range(int(start), int(stop)) if sep else range(int(start), int(start) + 1)
    except ValueError:
        seeds = range(0)
    # random.Random(-s) draws what random.Random(s) does: a negative seed would repeat another
    # seed's trace under its own name.
    if not seeds or seeds.start < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid; expected START:STOP, 0 <= START < STOP"
        )
    return seeds


def main() -> None:
    """Print the losses to LRU and the per-policy summary; optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=_seeds, default=range(60), help="START:STOP (0:60)")
    parser.add_argument("--policies", default="lru,arc,s3fifo,sieve,kvaware")
    parser.add_argument(
        "--engine",
        choices=("eager", "on-evict"),
        help="replay behind a device cache of 1%% of the unique blocks",
    )
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--json", type=Path, help="write one row per cell to this file")
    args = parser.parse_args()
    names = tuple(args.policies.split(","))
    unknown = [n for n in names if n not in registered_policies()]
    if unknown or "lru" not in names:
        parser.error(f"--policies={args.policies!r}: expected registered policies including lru")
    require_distinct(parser, "--policies", names)
    if args.jobs < 1:
        parser.error(f"--jobs={args.jobs} is invalid; expected >= 1")
    require_writable(parser, args.json)
    tasks = [(s, names, args.engine) for s in args.seeds]
    others = [n for n in names if n != "lru"]
    rows = []
    with worker_pool(args.jobs) as pool:
        for done, seed_rows in enumerate(pool.map(_run, tasks), 1):
            rows += seed_rows
            for row in seed_rows:
                ratios = row["hit_ratio"]
                for n in others:
                    if ratios[n] < ratios["lru"]:
                        print(
                            f"seed {row['seed']} at {row['frac']:.0%} ({row['capacity_blocks']} "
                            f"blocks): {n} {ratios[n]:.2f} < lru {ratios['lru']:.2f}  "
                            f"{json.dumps(row['params'])}",
                            flush=True,
                        )
            if done % 5 == 0 or done == len(tasks):
                progress(f"[{done}/{len(tasks)} seeds]")  # stderr: stdout keeps the results
    mode = f"engine mode ({args.engine})" if args.engine else "flat mode"
    print(
        f"\nseeds {args.seeds.start}:{args.seeds.stop}, {len(rows)} cells, {mode}; "
        "policy - lru in points"
    )
    print(f"{'policy':<10}{'below':>7}{'losses':>9}{'worst':>8}{'mean':>8}")
    for n in others:
        gaps = [r["hit_ratio"][n] - r["hit_ratio"]["lru"] for r in rows]
        losses = [g for g in gaps if g < 0]
        print(
            f"{n:<10}{len(losses):>7}{sum(losses):>9.2f}{min(gaps):>8.2f}"
            f"{sum(gaps) / len(gaps):>+8.2f}"
        )
    if args.json:
        write_results(args.json, json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
