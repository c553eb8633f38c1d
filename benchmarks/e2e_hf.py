"""Time to first token with kvtier vs recompute on a transformers model, next to its bound.

Part 1, cached prefixes: for each prefix length P (1k, 4k, 8k tokens) a prompt is P cached
tokens plus a fresh `--tail`-token user message. Side by side in one run, alternating, with
medians over `--repeats`:

- recompute: `generate_greedy` over the whole prompt (plain transformers prefill);
- kvtier: `KVTierGenerator.generate_one` (hash, look up, load P tokens of KV from the host
  pool into the paged buffer the model's cache reads, prefill the tail), P stored beforehand;
- bound: the bytes kvtier loaded divided by the copy bandwidth measured in the same run (one
  contiguous `copy_` of that many bytes), plus the measured time of the forward pass over the
  tail alone on a (paged) cache that already holds the P tokens.

Part 2, the price when nothing repeats: `--rounds` rounds; each runs one new
`--fresh-tokens`-token prompt (no prefix ever repeats) generating `--new-tokens` tokens
through each of three variants, in rotating order: kvtier (look up, miss, prefill, decode,
store every full block, and wait for that store, so all of it is charged), plain
`generate_greedy` (transformers' `DynamicCache`), and the paged cache alone (no kvtier work).
"vs plain" compares medians of time per request (and TTFT, and process CPU time); "paired"
is the median of per-round ratios, steadier when the machine's speed drifts during the run;
"own work" is kvtier against the paged cache alone.

    python benchmarks/e2e_hf.py --json out/e2e_hf.json
    python benchmarks/e2e_hf.py --device cuda --dtype bfloat16 --size 1b   # on a GPU

On a GPU the bound's copy is from pinned host memory to the device (what a load moves), and
every time is taken after the device finishes.
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

import kvtier.integrations.hf.generator as generator_module
from _bench import sync
from _cli import (
    SEED_MAX,
    positive_int,
    progress,
    require_distinct,
    require_writable,
    run_main,
    seed_int,
    write_results,
)
from kvtier.config import KVTierConfig
from kvtier.demo import physical_memory
from kvtier.integrations.hf.generator import KVTierGenerator
from kvtier.integrations.hf.models import make_demo_model
from kvtier.integrations.hf.paged_cache import PagedKVBuffer
from kvtier.integrations.hf.prefix import generate_greedy, prefill

BS = 16


SIZES: dict[str, dict[str, int]] = {
    "demo": {},
    # Llama-3.2-1B's shape (16 layers, 8 KV heads of 64) with a small vocabulary: 32 KiB of KV
    # a token in bfloat16, as in the real model, without its 128k-row output matrix.
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
           "num_attention_heads": 32, "num_key_value_heads": 8},
}  # fmt: skip
"""`--size`: fields of `make_demo_model`; "demo" is the default demo model."""


def _copy_seconds(nbytes: int, device: torch.device) -> float:
    """One contiguous copy of `nbytes` into `device` from touched host memory (pinned where the
    device is a GPU): the bandwidth ceiling of a load."""
    src = torch.full((nbytes,), 3, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    sync(device)
    start = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    sync(device)
    return time.perf_counter() - start


def bench_prefix(model: Any, prefix_len: int, tail: int, repeats: int, seed: int) -> dict[str, Any]:
    """One row of part 1: median TTFTs of recompute, kvtier and the bound for one prefix."""
    vocab = model.config.vocab_size
    device = model.device
    rng = torch.Generator().manual_seed(seed + prefix_len)
    prefix = torch.randint(0, vocab, (prefix_len,), generator=rng)
    blocks = -(-(prefix_len + tail) // BS) + 1
    config = KVTierConfig(num_slots=blocks * (repeats + 2))
    times: dict[str, list[float]] = {"recompute": [], "kvtier": [], "tail": [], "copy": []}
    loaded: list[int] = []
    with KVTierGenerator(model, config, block_size=BS, max_blocks=blocks) as gen:
        gen.generate_one(prefix, 1)  # stores the prefix's blocks
        gen.flush()
        # The bound's forward runs on the same kind of cache as kvtier's: a paged buffer that
        # already holds the prefix's KV (computed once here), so it measures the model's work
        # on the tail and nothing kvtier could avoid.
        ref = PagedKVBuffer(model.config, blocks, BS, dtype=model.dtype, device=device)
        prefill(model, prefix.unsqueeze(0).to(device), ref.cache(0, blocks, 0))
        for r in range(repeats):
            prompt = torch.cat([prefix, torch.randint(0, vocab, (tail,), generator=rng)])
            ids = prompt.unsqueeze(0).to(device)

            def recompute(ids: torch.Tensor = ids) -> None:
                sync(device)
                t0 = time.perf_counter()
                out = generate_greedy(model, ids, 1)
                times["recompute"].append(out.first_token_time - t0)

            def kvtier(prompt: torch.Tensor = prompt) -> None:
                sync(device)
                before = gen.stats.bytes_loaded
                res = gen.generate_one(prompt, 1)
                if res.hit_tokens != prefix_len:
                    raise RuntimeError(f"kvtier loaded {res.hit_tokens} of {prefix_len} tokens")
                times["kvtier"].append(res.ttft_s)
                loaded.append(gen.stats.bytes_loaded - before)
                gen.flush()  # this request's stores end before the next measurement

            def tail_only(ids: torch.Tensor = ids) -> None:
                cache = ref.cache(0, blocks, prefix_len)  # the tail overwrites the last one's
                sync(device)
                t0 = time.perf_counter()
                prefill(model, ids, cache)
                sync(device)
                times["tail"].append(time.perf_counter() - t0)

            variants: list[Callable[[], None]] = [recompute, kvtier, tail_only]
            for fn in variants if r % 2 == 0 else variants[::-1]:
                fn()
            times["copy"].append(_copy_seconds(loaded[-1], device))
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


class _ModelTimer:
    """Stands in for the generator's `generate_greedy` and adds up the time spent in it, so
    what kvtier does outside the model (hashing, lookup, bookkeeping, the store and the wait
    for it) can be measured directly, without pairing noise."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return generate_greedy(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


POOL_REQUESTS = 8
"""Part 2's host pool holds this many requests' blocks: it fills during the warm-up, and every
measured store then evicts, the steady state of a workload that never repeats."""


def bench_fresh(
    model: Any,
    tokens: int,
    new_tokens: int,
    rounds: int,
    seed: int,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Part 2: time per request and TTFT when every prompt is new, kvtier on vs plain.

    Each round runs one new prompt through each of three variants, in an order that rotates
    between rounds: kvtier (`generate_one`, then a wait for that request's stores, so all of
    its store work is charged to it and none leaks into the next variant's time); plain
    `generate_greedy` (transformers' `DynamicCache`); and "paged", `generate_greedy` on the
    paged cache kvtier uses but with no kvtier work (no hashing, lookup, bookkeeping or
    store). kvtier vs plain is what a user pays or saves; kvtier vs paged is the price of
    kvtier's own work. "paired" is the median of per-round ratios. "CPU" is the process's
    CPU time over the request (every thread, the transfer thread's copies included): less
    disturbed than wall time by other processes on a shared machine.
    """
    vocab = model.config.vocab_size
    device = model.device
    rng = torch.Generator().manual_seed(seed)
    blocks = -(-(tokens + new_tokens) // BS)
    names = ("kvtier", "plain", "paged")
    total: dict[str, list[float]] = {k: [] for k in names}
    ttft: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    outside: list[float] = []
    timer = _ModelTimer()
    config = KVTierConfig(num_slots=blocks * POOL_REQUESTS)
    paged = PagedKVBuffer(model.config, blocks, BS, dtype=model.dtype, device=device)
    with KVTierGenerator(model, config, block_size=BS, max_blocks=2 * blocks) as gen:

        def kvtier(prompt: torch.Tensor) -> tuple[float, float]:
            sync(device)
            in_model = timer.seconds
            t0 = time.perf_counter()
            res = gen.generate_one(prompt, new_tokens)
            gen.flush()
            seconds = time.perf_counter() - t0
            if res.hit_tokens:
                raise RuntimeError("a fresh prompt hit: the workload repeats itself")
            outside.append(seconds - (timer.seconds - in_model))
            return seconds, res.ttft_s

        def plain(prompt: torch.Tensor) -> tuple[float, float]:
            sync(device)
            t0 = time.perf_counter()
            out = generate_greedy(model, prompt.unsqueeze(0).to(device), new_tokens)
            return time.perf_counter() - t0, out.first_token_time - t0

        def paged_only(prompt: torch.Tensor) -> tuple[float, float]:
            sync(device)
            t0 = time.perf_counter()
            ids = prompt.unsqueeze(0).to(device)
            out = generate_greedy(model, ids, new_tokens, paged.cache(0, blocks, 0))
            return time.perf_counter() - t0, out.first_token_time - t0

        def new_prompt() -> torch.Tensor:
            return torch.randint(0, vocab, (tokens,), generator=rng)

        original = generator_module.__dict__["generate_greedy"]
        setattr(generator_module, "generate_greedy", timer)  # noqa: B010 (not re-exported)
        for _ in range(POOL_REQUESTS):  # warm-up: fill the pool, warm the allocator
            kvtier(new_prompt())
        plain(new_prompt())
        paged_only(new_prompt())
        stored_before = gen.stats.bytes_stored
        outside.clear()
        variants = list(zip(names, (kvtier, plain, paged_only), strict=True))
        for r in range(rounds):
            k = r % len(variants)
            for name, fn in variants[k:] + variants[:k]:
                prompt = new_prompt()
                c0 = time.process_time()
                seconds, first = fn(prompt)
                cpu[name].append(time.process_time() - c0)
                total[name].append(seconds)
                ttft[name].append(first)
            if log is not None and ((r + 1) % max(1, rounds // 10) == 0 or r + 1 == rounds):
                log(f"nothing repeats: round {r + 1} of {rounds} done")
        setattr(generator_module, "generate_greedy", original)  # noqa: B010
        stored = gen.stats.bytes_stored - stored_before
        evictions = gen.manager.get_stats().evictions

    def overhead(d: dict[str, list[float]], base: str) -> tuple[float, float]:
        ratios = [k / p for k, p in zip(d["kvtier"], d[base], strict=True)]
        return statistics.median(d["kvtier"]) / statistics.median(d[base]) - 1, (
            statistics.median(ratios) - 1
        )

    out: dict[str, Any] = {
        "rounds": rounds,
        "prompt_tokens": tokens,
        "new_tokens": new_tokens,
        "bytes_stored_per_request": stored / rounds,
        "evictions": evictions,
        "kvtier_outside_model_s": statistics.median(outside),
    }
    for key, d in (("request", total), ("ttft", ttft), ("cpu", cpu)):
        for name in names:
            out[f"{key}_{name}_s"] = statistics.median(d[name])
        out[f"{key}_overhead"], out[f"{key}_overhead_paired"] = overhead(d, "plain")
        out[f"{key}_own_work"], out[f"{key}_own_work_paired"] = overhead(d, "paged")
    return out


def _kv_bytes(args: argparse.Namespace, prefixes: list[int]) -> int:
    """The most KV memory either part holds at once (host pool, paged buffers, the plain
    cache and the copy test), from the arguments alone: a huge --prefixes or --fresh-tokens
    would otherwise fail allocating, with a traceback, or swap for hours."""
    from transformers import LlamaConfig

    from kvtier.integrations.hf.kv_blocks import kv_layout
    from kvtier.integrations.hf.models import _DEFAULT_SIZE  # make_demo_model's shape

    layout = kv_layout(LlamaConfig(**{**_DEFAULT_SIZE, **SIZES[args.size]}))
    itemsize = int(torch.empty(0, dtype=getattr(torch, args.dtype)).element_size())
    token = 2 * layout.num_layers * layout.kv_heads * layout.head_dim * itemsize
    part1 = 0
    for p in prefixes:
        blocks = -(-(p + args.tail) // BS) + 1
        # pool, the generator's and the bound's buffers, recompute's cache, the copy test
        part1 = max(part1, (blocks * (args.repeats + 4)) * BS * token + 3 * p * token)
    blocks = -(-(args.fresh_tokens + args.new_tokens) // BS)
    part2 = blocks * (POOL_REQUESTS + 4) * BS * token  # pool, 2x buffer, paged, plain
    need: int = max(part1, part2)  # the arguments are untyped (argparse)
    return need


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def main() -> None:
    """Run both parts, print the tables, write `--json`."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefixes", default="1024,4096,8192", help="cached prefix lengths")
    ap.add_argument("--tail", type=positive_int, default=64,
                    help="uncached tokens after the prefix")  # fmt: skip
    ap.add_argument("--repeats", type=positive_int, default=7)
    ap.add_argument("--rounds", type=positive_int, default=48,
                    help="part 2 rounds (a prompt per variant)")  # fmt: skip
    ap.add_argument("--fresh-tokens", type=positive_int, default=1024)
    ap.add_argument("--new-tokens", type=positive_int, default=16)
    ap.add_argument("--seed", type=seed_int, default=0)
    ap.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, cuda:N")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--size", choices=list(SIZES), default="demo", help="the model's shape")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    try:
        device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device {args.device}: expected cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device is visible to torch {torch.__version__}")
    if device.type == "cuda" and device.index is not None:
        count = torch.cuda.device_count()
        if device.index >= count:
            # Else the model's move fails deep in torch, after the host-side set-up.
            ap.error(f"--device {args.device}: torch sees {count} CUDA device(s), 0..{count - 1}")
    if device.type not in ("cpu", "cuda"):
        ap.error(f"--device {args.device}: expected cpu, cuda or cuda:N")
    try:
        prefixes = [int(p) for p in args.prefixes.split(",") if p]
    except ValueError:
        prefixes = [0]
    # kvtier stores whole blocks only: a prefix that ends inside a block is never all loaded.
    if any(p < 1 or p % BS for p in prefixes):
        ap.error(f"--prefixes {args.prefixes!r} is invalid; expected comma-separated token "
                 f"counts, each a positive multiple of the block size ({BS})")  # fmt: skip
    require_distinct(ap, "--prefixes", prefixes, "length")  # else rows print twice
    # Part 1 seeds each prefix's prompts with seed + prefix length: it must stay a torch seed.
    if args.seed + max(prefixes, default=0) > SEED_MAX:
        ap.error(f"--seed {args.seed} plus the longest of --prefixes {args.prefixes!r} is past "
                 "2**64 - 1 (part 1's torch seed); expected a smaller seed or prefix")  # fmt: skip
    require_writable(ap, args.json)
    need, ram = _kv_bytes(args, prefixes), physical_memory()
    if ram is not None and need > ram:
        ap.error(f"--prefixes {args.prefixes!r}, --tail {args.tail}, --repeats {args.repeats}, "
                 f"--fresh-tokens {args.fresh_tokens}, --new-tokens {args.new_tokens} with "
                 f"--size {args.size}: the runs' KV may need {need / 2**30:,.1f} GiB, more than "
                 f"this machine's {ram / 2**30:,.1f} GiB; expected smaller values")  # fmt: skip
    longest = max(prefixes, default=0) + args.tail + args.new_tokens
    model, _ = make_demo_model(
        "llama", args.seed, max_position_embeddings=max(4096, longest), **SIZES[args.size]
    )
    model = model.to(device=device, dtype=getattr(torch, args.dtype))
    console = Console(width=120)
    rows = []
    for p in prefixes:
        rows.append(bench_prefix(model, p, args.tail, args.repeats, args.seed))
        progress(f"prefix {p}: done")  # stderr: stdout keeps the tables
    fresh = bench_fresh(model, args.fresh_tokens, args.new_tokens, args.rounds, args.seed, progress)
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
    for col in ("", "plain", "kvtier on", "vs plain", "paired", "paged", "own work", "paired"):
        t2.add_column(col, justify="right")
    labels = (
        ("per request (ms)", "request"),
        ("TTFT (ms)", "ttft"),
        ("CPU per request (ms)", "cpu"),  # shown with _ms like the others
    )
    for label, key in labels:
        t2.add_row(
            label,
            _ms(fresh[f"{key}_plain_s"]),
            _ms(fresh[f"{key}_kvtier_s"]),
            f"{fresh[f'{key}_overhead']:+.1%}",
            f"{fresh[f'{key}_overhead_paired']:+.1%}",
            _ms(fresh[f"{key}_paged_s"]),
            f"{fresh[f'{key}_own_work']:+.1%}",
            f"{fresh[f'{key}_own_work_paired']:+.1%}",
        )
    console.print(t2)
    outside = fresh["kvtier_outside_model_s"]
    console.print(
        f"kvtier's work outside the model (hash, lookup, bookkeeping, store and its wait): "
        f"{_ms(outside)} ms a request (median), "
        f"{outside / fresh['request_kvtier_s']:.1%} of its median request time; "
        f"{fresh['bytes_stored_per_request'] / 2**20:.1f} MiB stored a request"
    )
    if args.json:
        doc = {
            "args": vars(args),
            "torch_threads": torch.get_num_threads(),
            "prefix": rows,
            "fresh": fresh,
        }
        write_results(args.json, json.dumps(doc, indent=2))


if __name__ == "__main__":
    run_main(main)
