"""Time to first token with kvtier vs recompute on a transformers model, next to its bound.

Part 1, cached prefixes: for each prefix length P (1k, 4k, 8k tokens) a prompt is P cached
tokens plus a fresh `--tail`-token user message. Side by side in one run, alternating, with
medians over `--repeats`:

- recompute: `generate_greedy` over the whole prompt (plain transformers prefill);
- kvtier: `KVTierGenerator.generate_one` (hash, look up, load P tokens of KV from the host
  pool, build the cache, prefill the tail), P stored beforehand;
- bound: the bytes kvtier loaded divided by the copy bandwidth measured in the same run (one
  contiguous `copy_` of that many bytes), plus the measured time of the forward pass over the
  tail alone on a cache that already holds the P tokens.

Part 2, the price when nothing repeats: `--rounds` rounds, each of `--fresh-requests` prompts
of `--fresh-tokens` new tokens (no prefix ever repeats) generating `--new-tokens` tokens
through kvtier (look up, miss, prefill, store every block in the background, then wait for
the last stores) and as many other new prompts through plain `generate_greedy`; the two
alternate. "overhead" compares medians of per-request time (a round's time over its
requests) and of TTFT; "paired" is the median of per-round ratios (per-request for TTFT),
steadier when the machine's speed drifts during the run.

    python benchmarks/e2e_hf.py --json out/e2e_hf.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from transformers.cache_utils import DynamicCache

from kvtier.config import KVTierConfig
from kvtier.integrations.hf.generator import KVTierGenerator
from kvtier.integrations.hf.models import make_demo_model
from kvtier.integrations.hf.prefix import generate_greedy, prefill

BS = 16


def _clone_cache(ref: Any, config: Any) -> DynamicCache:
    """A new cache holding copies of `ref`'s KV (prefill extends a cache in place)."""
    cache = DynamicCache(config=config)
    for i, layer in enumerate(ref.layers):
        cache.update(layer.keys.clone(), layer.values.clone(), i)
    return cache


def _copy_seconds(nbytes: int) -> float:
    """One contiguous copy of `nbytes` between two touched buffers: the bandwidth ceiling."""
    src = torch.full((nbytes,), 3, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    start = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - start


def bench_prefix(model: Any, prefix_len: int, tail: int, repeats: int, seed: int) -> dict[str, Any]:
    """One row of part 1: median TTFTs of recompute, kvtier and the bound for one prefix."""
    vocab = model.config.vocab_size
    rng = torch.Generator().manual_seed(seed + prefix_len)
    prefix = torch.randint(0, vocab, (prefix_len,), generator=rng)
    blocks = -(-(prefix_len + tail) // BS) + 1
    config = KVTierConfig(num_slots=blocks * (repeats + 2))
    times: dict[str, list[float]] = {"recompute": [], "kvtier": [], "tail": [], "copy": []}
    loaded: list[int] = []
    with KVTierGenerator(model, config, block_size=BS, max_blocks=blocks) as gen:
        gen.generate_one(prefix, 1)  # stores the prefix's blocks
        gen.flush()
        ref = prefill(model, prefix.unsqueeze(0))[1]  # KV of the P prefix tokens, for the bound
        for r in range(repeats):
            prompt = torch.cat([prefix, torch.randint(0, vocab, (tail,), generator=rng)])
            ids = prompt.unsqueeze(0)

            def recompute(ids: torch.Tensor = ids) -> None:
                t0 = time.perf_counter()
                out = generate_greedy(model, ids, 1)
                times["recompute"].append(out.first_token_time - t0)

            def kvtier(prompt: torch.Tensor = prompt) -> None:
                before = gen.stats.bytes_loaded
                res = gen.generate_one(prompt, 1)
                if res.hit_tokens != prefix_len:
                    raise RuntimeError(f"kvtier loaded {res.hit_tokens} of {prefix_len} tokens")
                times["kvtier"].append(res.ttft_s)
                loaded.append(gen.stats.bytes_loaded - before)
                gen.flush()  # this request's stores end before the next measurement

            def tail_only(ids: torch.Tensor = ids) -> None:
                cache = _clone_cache(ref, model.config)
                t0 = time.perf_counter()
                prefill(model, ids, cache)
                times["tail"].append(time.perf_counter() - t0)

            variants: list[Callable[[], None]] = [recompute, kvtier, tail_only]
            for fn in variants if r % 2 == 0 else variants[::-1]:
                fn()
            times["copy"].append(_copy_seconds(loaded[-1]))
    med = {k: statistics.median(v) for k, v in times.items()}
    nbytes = statistics.median(loaded)
    bandwidth = nbytes / med["copy"]
    bound = nbytes / bandwidth + med["tail"]
    return {
        "prefix_tokens": prefix_len,
        "tail_tokens": tail,
        "ttft_recompute_s": med["recompute"],
        "ttft_kvtier_s": med["kvtier"],
        "bytes_loaded": int(nbytes),
        "copy_gbps": bandwidth / 1e9,
        "tail_forward_s": med["tail"],
        "bound_s": bound,
        "kvtier_over_bound": med["kvtier"] / bound,
        "speedup_vs_recompute": med["recompute"] / med["kvtier"],
    }


def bench_fresh(
    model: Any, requests: int, tokens: int, new_tokens: int, rounds: int, seed: int
) -> dict[str, Any]:
    """Part 2: per-request time and TTFT when every prompt is new, kvtier on vs plain.

    Each round runs `requests` new prompts through kvtier, back to back as a serving loop
    would (a request's stores overlap the next one's compute), then waits for the last
    stores, so all store work is charged; and `requests` other new prompts through plain
    `generate_greedy`. The order of the two alternates between rounds.
    """
    vocab = model.config.vocab_size
    rng = torch.Generator().manual_seed(seed)
    blocks = -(-(tokens + new_tokens) // BS)
    total: dict[str, list[float]] = {"plain": [], "kvtier": []}
    ttft: dict[str, list[float]] = {"plain": [], "kvtier": []}
    config = KVTierConfig(num_slots=blocks * requests * rounds + 1)
    with KVTierGenerator(model, config, block_size=BS, max_blocks=2 * blocks) as gen:

        def kvtier(prompts: list[torch.Tensor]) -> None:
            t0 = time.perf_counter()
            for prompt in prompts:
                res = gen.generate_one(prompt, new_tokens)
                if res.hit_tokens:
                    raise RuntimeError("a fresh prompt hit: the workload repeats itself")
                ttft["kvtier"].append(res.ttft_s)
            gen.flush()
            total["kvtier"].append((time.perf_counter() - t0) / len(prompts))

        def plain(prompts: list[torch.Tensor]) -> None:
            t0 = time.perf_counter()
            for prompt in prompts:
                s = time.perf_counter()
                out = generate_greedy(model, prompt.unsqueeze(0), new_tokens)
                ttft["plain"].append(out.first_token_time - s)
            total["plain"].append((time.perf_counter() - t0) / len(prompts))

        for r in range(rounds):
            new = [torch.randint(0, vocab, (tokens,), generator=rng) for _ in range(2 * requests)]
            pairs = [(kvtier, new[:requests]), (plain, new[requests:])]
            for fn, prompts in pairs if r % 2 == 0 else pairs[::-1]:
                fn(prompts)

    def overhead(d: dict[str, list[float]]) -> tuple[float, float]:
        ratios = [k / p for k, p in zip(d["kvtier"], d["plain"], strict=True)]
        return statistics.median(d["kvtier"]) / statistics.median(d["plain"]) - 1, (
            statistics.median(ratios) - 1
        )

    req_over, req_paired = overhead(total)
    ttft_over, ttft_paired = overhead(ttft)
    return {
        "requests": requests * rounds,
        "prompt_tokens": tokens,
        "new_tokens": new_tokens,
        "request_plain_s": statistics.median(total["plain"]),
        "request_kvtier_s": statistics.median(total["kvtier"]),
        "request_overhead": req_over,
        "request_overhead_paired": req_paired,
        "ttft_plain_s": statistics.median(ttft["plain"]),
        "ttft_kvtier_s": statistics.median(ttft["kvtier"]),
        "ttft_overhead": ttft_over,
        "ttft_overhead_paired": ttft_paired,
    }


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def main() -> None:
    """Run both parts, print the tables, write `--json`."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefixes", default="1024,4096,8192", help="cached prefix lengths")
    ap.add_argument("--tail", type=int, default=64, help="uncached tokens after the prefix")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--fresh-requests", type=int, default=4, help="prompts per round")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--fresh-tokens", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    prefixes = [int(p) for p in args.prefixes.split(",")]
    longest = max(prefixes) + args.tail + args.new_tokens
    model, _ = make_demo_model("llama", args.seed, max_position_embeddings=max(4096, longest))
    console = Console(width=120)
    rows = []
    for p in prefixes:
        rows.append(bench_prefix(model, p, args.tail, args.repeats, args.seed))
        console.log(f"prefix {p}: done")
    fresh = bench_fresh(
        model, args.fresh_requests, args.fresh_tokens, args.new_tokens, args.rounds, args.seed
    )
    table = Table(title=f"TTFT, cached prefix + {args.tail}-token tail (ms, medians)")
    for col in ("prefix", "recompute", "kvtier", "speedup", "MiB loaded", "copy GB/s",
                "tail fwd", "bound", "kvtier/bound"):  # fmt: skip
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(
            str(row["prefix_tokens"]),
            _ms(row["ttft_recompute_s"]),
            _ms(row["ttft_kvtier_s"]),
            f"{row['speedup_vs_recompute']:.1f}x",
            f"{row['bytes_loaded'] / 2**20:.1f}",
            f"{row['copy_gbps']:.1f}",
            _ms(row["tail_forward_s"]),
            _ms(row["bound_s"]),
            f"{row['kvtier_over_bound']:.2f}x",
        )
    console.print(table)
    t2 = Table(title=f"nothing repeats: {args.fresh_tokens}-token prompts, {args.new_tokens} new")
    for col in ("", "plain", "kvtier on", "overhead", "paired"):
        t2.add_column(col, justify="right")
    for label, key in (("per request (ms)", "request"), ("TTFT (ms)", "ttft")):
        t2.add_row(
            label,
            _ms(fresh[f"{key}_plain_s"]),
            _ms(fresh[f"{key}_kvtier_s"]),
            f"{fresh[f'{key}_overhead']:+.1%}",
            f"{fresh[f'{key}_overhead_paired']:+.1%}",
        )
    console.print(t2)
    if args.json:
        doc = {
            "args": vars(args),
            "torch_threads": torch.get_num_threads(),
            "prefix": rows,
            "fresh": fresh,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
