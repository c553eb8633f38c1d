"""`kvtier demo`: a multi-turn chat workload with kvtier vs plain recomputation, on a small model.

The workload is the Mooncake conversation trace's shape, scaled down about 16x so it runs on
a laptop CPU: every request starts with one shared system prompt (Mooncake's block 0), each
conversation grows turn by turn (a turn's prompt is the whole conversation so far: earlier
prompts, the model's replies, then new user text), and turns of different conversations
arrive round-robin, as interleaved traffic would. User text is seeded random token ids.

Each request runs twice, back to back, once through `KVTierGenerator` (load the stored
prefix, prefill the rest) and once with full recomputation; which one goes first alternates,
so that machine noise falls on both alike. Both runs see the same prompts: a conversation
continues with recomputation's reply, the reference, so a reply of kvtier's that differs does
not make every later turn of its conversation a different prompt. The report compares prefix
hits, prefill tokens, time to first token and the bytes kvtier moved, and says whether the
greedy tokens are identical, which sets the exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

if TYPE_CHECKING:
    import torch

__all__ = ["DemoOptions", "DemoResult", "add_arguments", "run", "run_demo"]

BLOCK_SIZE = 16
VARIANTS = ("kvtier", "recompute")
# kvtier's logits may differ from recomputation's by float rounding (its prefill runs in
# chunks), not by more than this fraction of the largest |logit| (of 1 where all are smaller):
# more means the loaded KV is wrong, even where every greedy token happens to be the same.
LOGIT_RTOL = 1e-3
EXIT_HELP = (
    "exit status: 0 when kvtier's tokens equal recomputation's (and its logits, within "
    f"{LOGIT_RTOL:.0e} of the largest), 1 when they differ, "
    "2 on bad arguments or an output that cannot be written, 141 when the reader of "
    "standard output goes away (| head), 130 when interrupted (Ctrl-C), 70 when it crashes "
    "(a bug: the traceback is on stderr)"
)
# The seeds torch.Generator.manual_seed accepts.
SEED_RANGE = (-(2**63), 2**64 - 1)


@dataclass(frozen=True)
class DemoOptions:
    """The workload and model of one demo run (defaults: a few seconds on 2 CPU cores)."""

    conversations: int = 8
    turns: int = 4
    system_tokens: int = 64
    user_tokens: int = 96
    new_tokens: int = 16
    seed: int = 0
    model: Path | None = None

    def __post_init__(self) -> None:
        # bool is an int subclass: turns=True ran one turn, seed=True named "seed True".
        for name in ("conversations", "turns", "system_tokens", "user_tokens", "new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')}={value!r}; expected an int >= 1")
        low, high = SEED_RANGE
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not low <= seed <= high:
            raise ValueError(f"--seed={self.seed!r}; expected an int from -2**63 to 2**64 - 1")
        if isinstance(self.model, (str, os.PathLike)) and not isinstance(self.model, Path):
            # A str path, as callers often hold one; is_dir() below raised AttributeError.
            object.__setattr__(self, "model", Path(self.model))
        elif self.model is not None and not isinstance(self.model, Path):
            raise ValueError(f"--model {self.model!r}; expected a checkpoint directory path")
        if self.model is not None and not self.model.is_dir():
            raise ValueError(
                f"--model {self.model} is not a directory; expected a local checkpoint"
            )
        if self.model is not None and not (self.model / "config.json").is_file():
            raise ValueError(
                f"--model {self.model} has no config.json; expected a transformers checkpoint"
            )


@dataclass
class DemoResult:
    """What one demo run measured (also the `--json` document)."""

    model: str
    requests: int
    prompt_tokens: int
    identical_outputs: bool
    """Every generated token equal, and every logit within LOGIT_RTOL: the exit status."""
    max_logit_diff: float | None
    """Largest |logit| difference over each request's tokens up to and including its first
    differing one (later tokens follow different inputs); None where a request's logits were
    missing or not finite (NaN read as a difference of 0)."""
    differing_requests: int
    first_divergence: dict[str, int] | None
    """The first request whose tokens differ: its `request` (in run order), `conversation`,
    `turn` and the `token` position in the reply (all from 0); None when none does."""
    prefix_hit_ratio: float
    prefill_tokens: dict[str, int]
    prefill_tokens_saved: int
    ttft_median_s: dict[str, float]
    ttft_p90_s: dict[str, float]
    bytes_loaded: int
    bytes_stored: int
    failed_loads: int
    wall_s: float
    logit_mismatches: int = 0
    """Requests whose logits (up to the first differing token) are missing, not finite or
    further from recomputation's than LOGIT_RTOL allows: their run is not identical either."""
    options: dict[str, Any] = field(default_factory=dict)


def _demo_size(opts: DemoOptions) -> dict[str, Any]:
    """The demo model's size overrides: positions for the workload's longest conversation."""
    longest = opts.system_tokens + opts.turns * (2 * opts.user_tokens + opts.new_tokens)
    return {"max_position_embeddings": max(4096, 2 * longest)}


def _cannot_load(opts: DemoOptions, e: Exception) -> ValueError:
    # transformers' message for a non-causal-LM config lists every supported config class
    # (hundreds of names); its first line says what is wrong.
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ValueError(
        f"--model {opts.model}: cannot load it as a causal LM ({first}); expected a "
        "checkpoint AutoModelForCausalLM loads"
    )


def _model_config(opts: DemoOptions) -> Any:
    """The config of the model `_load_model` loads, read without its weights: the workload is
    checked against it before the model is built or loaded."""
    if opts.model is None:
        from kvtier.integrations.hf.models import demo_config

        return demo_config("llama", **_demo_size(opts))
    from transformers import AutoConfig

    auto: Any = AutoConfig  # untyped upstream
    try:
        return auto.from_pretrained(str(opts.model), local_files_only=True)
    except (ValueError, OSError, KeyError) as e:
        raise _cannot_load(opts, e) from None


def _weight_bytes(opts: DemoOptions, model_config: Any) -> int:
    """Bytes of the model's weights in float32 (as the demo loads them), found without
    reading or building them: the demo model's counted on the meta device, a checkpoint's
    from its files. 0 where they cannot be told (`_load_model` then says what is wrong)."""
    import torch

    if opts.model is None:
        from transformers import AutoModelForCausalLM

        auto: Any = AutoModelForCausalLM  # untyped upstream
        with torch.device("meta"):  # shapes only: no memory
            model: torch.nn.Module = auto.from_config(model_config)
        return 4 * sum(p.numel() for p in model.parameters())
    try:
        files, safetensors = _checkpoint_files(opts.model)
        if safetensors:
            shapes: dict[str, list[int]] = {}
            for f in files:
                shapes.update(_safetensors_shapes(f))
            return 4 * sum(math.prod(shape) for shape in _loaded(shapes, model_config).values())
        stored = sum(f.stat().st_size for f in files)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0  # an unreadable file: loading it says which
    dtype = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 4
    return stored * 4 // itemsize


def _checkpoint_files(directory: Path) -> tuple[list[Path], bool]:
    """The weight files `from_pretrained` loads from `directory`, in its order of preference,
    and whether they are safetensors. Only those: a directory may hold other weights too
    (Mistral's `consolidated.safetensors` beside the model's shards, a PEFT adapter), which
    counted as well made the model twice its size."""
    for name, safetensors in (("model.safetensors", True), ("pytorch_model.bin", False)):
        if (directory / name).is_file():
            return [directory / name], safetensors
        index = directory / f"{name}.index.json"
        if index.is_file():
            shards = json.loads(index.read_text())["weight_map"].values()
            return [directory / shard for shard in sorted(set(shards))], safetensors
    return [], False


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Each tensor's shape in a safetensors file, from its header (its first bytes)."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > 2**27:  # a header of 128 MiB is no header: a corrupt file
            raise ValueError(f"{path}: not a safetensors file")
        header = json.loads(f.read(size))
    return {k: list(t["shape"]) for k, t in header.items() if k != "__metadata__"}


def _loaded(shapes: dict[str, list[int]], model_config: Any) -> dict[str, list[int]]:
    """The tensors a model keeps of those stored: with tied word embeddings, an `lm_head`
    stored beside its embedding is the same memory once loaded (a checkpoint saved with both
    counted a 128k-token vocabulary's matrix twice)."""
    if not getattr(model_config, "tie_word_embeddings", False):
        return shapes
    head = shapes.get("lm_head.weight")
    if head is None or not any("embed" in k and v == head for k, v in shapes.items()):
        return shapes
    return {k: v for k, v in shapes.items() if k != "lm_head.weight"}


def _load_model(opts: DemoOptions) -> tuple[Any, str]:
    """(model, namespace): the local checkpoint, or the seeded random-weight Llama demo model."""
    import torch

    if opts.model is None:
        from kvtier.integrations.hf.models import make_demo_model

        model, _ = make_demo_model("llama", opts.seed, **_demo_size(opts))
        return model, f"kvtier-demo-llama-seed{opts.seed}"
    from transformers import AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM  # untyped upstream
    try:
        model = auto.from_pretrained(str(opts.model), local_files_only=True, dtype=torch.float32)
    except (ValueError, OSError, KeyError) as e:
        raise _cannot_load(opts, e) from None
    model.eval()
    return model, f"{opts.model.resolve()}:float32"


PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _cgroup_memory_limit() -> int | None:
    """The lowest memory limit of this process's cgroup and its ancestors (v2 `memory.max`,
    v1 `memory.limit_in_bytes`), or None where there is none: a container's limit, which
    SC_PHYS_PAGES (the host's RAM) does not show, and past which the OOM killer ends the run
    without a word (exit 137)."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    limits: list[int] = []
    for line in lines:
        parts = line.split(":", 2)  # "id:controllers:path"
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: "0::/path"
            base, name = CGROUP_ROOT, "memory.max"
            if not (base / "cgroup.controllers").is_file():
                base = CGROUP_ROOT / "unified"  # v2 beside v1 (hybrid layout)
        elif "memory" in controllers.split(","):
            base, name = CGROUP_ROOT / "memory", "memory.limit_in_bytes"
        else:
            continue
        directory = base / path.strip().lstrip("/")
        while True:
            # "max" (v2) is no limit; v1 writes a number near 2**63 for none, min() drops it.
            with contextlib.suppress(OSError, ValueError):
                limits.append(int((directory / name).read_text().strip()))
            if directory == base or base not in directory.parents:
                break
            directory = directory.parent
    return min(limits, default=None)


def physical_memory() -> int | None:
    """Bytes of memory this process may use: the machine's RAM, where the OS says, or its
    cgroup's (a container's) memory limit where that is lower."""
    try:
        ram: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        ram = None
    limit = _cgroup_memory_limit()
    if limit is None:
        return ram
    return limit if ram is None else min(ram, limit)


def _check_memory(opts: DemoOptions, model_config: Any, weight_bytes: int = 0) -> None:
    """Refuse a workload whose KV, with the model's `weight_bytes`, cannot fit in this
    machine's memory, before drawing it or building the model.

    Otherwise a large --user-tokens fails allocating its token ids with a traceback, a large
    --conversations or --turns allocates (or page-faults in) a host pool for hours, and a
    checkpoint too large for the machine swaps (or is killed) as it loads."""
    from kvtier.integrations.hf.kv_blocks import kv_layout

    try:
        layout = kv_layout(model_config)
    except ValueError as e:  # a hybrid model's recurrent layers: name the option that chose it
        raise ValueError(f"--model {opts.model}: {e}") from None
    u = opts.user_tokens
    # The most a conversation can reach: a first turn of up to 3u tokens (mean 2u, +50%),
    # later ones of up to 1.5u, and every reply.
    longest = opts.system_tokens + 3 * u + (opts.turns - 1) * (u + u // 2)
    longest += opts.turns * opts.new_tokens
    blocks = -(-longest // BLOCK_SIZE)
    block_bytes = 2 * layout.num_layers * layout.kv_heads * layout.head_dim * 4 * BLOCK_SIZE
    # The host pool holds every conversation's blocks; the generator's buffer one's more.
    need = (blocks * (opts.conversations + 1) + 1) * block_bytes
    ram = physical_memory()
    if ram is not None and need > ram:
        raise ValueError(
            f"--conversations {opts.conversations}, --turns {opts.turns}, --system-tokens "
            f"{opts.system_tokens}, --user-tokens {opts.user_tokens}, --new-tokens "
            f"{opts.new_tokens}: the workload's KV may need {_size(need)}, more than this "
            f"machine's {_size(ram)} of memory; expected a smaller workload"
        )
    if ram is not None and need + weight_bytes > ram:
        model = "the demo model" if opts.model is None else f"--model {opts.model}"
        raise ValueError(
            f"{model}: its weights ({_size(weight_bytes)} in float32) and the workload's KV "
            f"({_size(need)}) need {_size(need + weight_bytes)}, more than this machine's "
            f"{_size(ram)} of memory; expected a smaller model or workload"
        )


def _user_turn(opts: DemoOptions, vocab: int, turn: int, gen: torch.Generator) -> torch.Tensor:
    import torch

    # A first turn carries the long context Mooncake's first requests have (documents, code);
    # later turns add shorter messages. Lengths vary +-50% around the mean.
    mean = opts.user_tokens * (2 if turn == 0 else 1)
    n = int(torch.randint(mean // 2, mean + mean // 2 + 1, (1,), generator=gen))
    return torch.randint(0, vocab, (max(n, 1),), generator=gen)


class _Reply(NamedTuple):
    tokens: torch.Tensor
    logits: torch.Tensor
    ttft_s: float
    prefill_tokens: int


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least `q` of the values at or
    below it."""
    ordered = sorted(values)
    # Rounded first: 0.7 * 10 is 7.000000000000001 in floating point, whose ceiling is 8.
    rank = math.ceil(round(q * len(ordered), 9))
    return ordered[min(len(ordered), max(rank, 1)) - 1]


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """The first position where token sequences `a` and `b` differ, or None."""
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    if differ.numel():
        return int(differ[0, 0])
    return None if a.numel() == b.numel() else n


def _compare_logits(
    k: torch.Tensor, r: torch.Tensor, tokens: int, j: int | None
) -> tuple[float | None, bool]:
    """(largest |difference|, within LOGIT_RTOL) of kvtier's logits `k` and recomputation's
    `r` for a reply of `tokens` tokens that first differ at `j` (None: nowhere); None for a
    difference that cannot be measured (a row missing, a logit not finite)."""
    import torch

    # Logits past the first differing token follow different inputs; up to it (inclusive:
    # its logits chose it) they are comparable. With equal tokens every row must be there: a
    # missing row was one never compared.
    upto = tokens if j is None else min(j + 1, k.shape[0], r.shape[0])
    a, b = k[:upto], r[:upto]
    if a.shape != b.shape or a.shape[0] != upto:
        return None, False
    if not a.numel():
        return 0.0, True
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        # max() over a NaN difference returned the other operand: NaN logits read as 0.0.
        return None, False
    diff = float((a - b).abs().max())
    return diff, diff <= LOGIT_RTOL * max(1.0, float(b.abs().max()))


def run_demo(opts: DemoOptions, on_request: Callable[[], None] = lambda: None) -> DemoResult:
    """Run the workload with kvtier and with recomputation; `on_request` ticks per request."""
    import torch

    from kvtier.config import KVTierConfig
    from kvtier.integrations.hf.generator import KVTierGenerator
    from kvtier.integrations.hf.prefix import generate_greedy

    start = time.perf_counter()
    # Every refusal comes before the model is built or loaded (seconds to minutes, and more
    # memory than the machine has for a checkpoint too large for it).
    model_config = _model_config(opts)
    _check_memory(opts, model_config, _weight_bytes(opts, model_config))
    # A multimodal checkpoint's config (Gemma 3's) keeps these in its text config, as
    # kv_layout reads them: `model.config.vocab_size` ended the run in an AttributeError.
    text_config = (
        model_config.get_text_config(decoder=True)
        if hasattr(model_config, "get_text_config")
        else model_config
    )
    vocab = int(text_config.vocab_size)
    rng = torch.Generator().manual_seed(opts.seed)
    system = torch.randint(0, vocab, (opts.system_tokens,), generator=rng)
    users = [
        [_user_turn(opts, vocab, t, rng) for t in range(opts.turns)]
        for _ in range(opts.conversations)
    ]
    longest = max(opts.system_tokens + sum(u.numel() for u in conv) for conv in users)
    longest += opts.turns * opts.new_tokens
    # The model reads every token of the last conversation but its last reply's last one.
    positions = getattr(text_config, "max_position_embeddings", None)
    if isinstance(positions, int) and longest - 1 > positions:
        raise ValueError(
            f"--model {opts.model}: the workload's longest conversation needs {longest - 1} "
            f"positions, the model has {positions} (max_position_embeddings); expected fewer "
            "--turns, --user-tokens, --system-tokens or --new-tokens"
        )
    model, namespace = _load_model(opts)
    max_blocks = -(-longest // BLOCK_SIZE)
    # Replies are stored too (offload_prompt_only=False): in a chat the next turn's prompt
    # starts with this turn's reply, so its KV is as reusable as the prompt's. The pool holds
    # every block of the workload, so the demo shows reuse, not eviction.
    config = KVTierConfig(offload_prompt_only=False, num_slots=max_blocks * opts.conversations + 1)
    # One history for both runs, continued with recomputation's replies: every request's
    # prompt is then the same for both, even after kvtier's tokens differ.
    history = [system.clone() for _ in users]
    ttft: dict[str, list[float]] = {v: [] for v in VARIANTS}
    recompute_prefill = 0
    differing = 0
    mismatches = 0
    first: dict[str, int] | None = None
    worst: float | None = 0.0
    with KVTierGenerator(
        model, config, block_size=BLOCK_SIZE, max_blocks=max_blocks, namespace=namespace
    ) as gen:

        def with_kvtier(prompt: torch.Tensor) -> _Reply:
            res = gen.generate_one(prompt, opts.new_tokens)
            return _Reply(res.tokens, res.logits, res.ttft_s, res.prefill_tokens)

        def recompute(prompt: torch.Tensor) -> _Reply:
            t0 = time.perf_counter()
            out = generate_greedy(model, prompt.unsqueeze(0), opts.new_tokens)
            ttft_s = out.first_token_time - t0
            return _Reply(out.tokens[0], out.logits[0], ttft_s, out.prefill_tokens)

        runners = {"kvtier": with_kvtier, "recompute": recompute}
        for turn in range(opts.turns):
            for c, conv in enumerate(users):
                order = VARIANTS if (turn + c) % 2 == 0 else VARIANTS[::-1]
                prompt = torch.cat([history[c], conv[turn]])
                replies: dict[str, _Reply] = {}
                for v in order:
                    replies[v] = runners[v](prompt)
                    ttft[v].append(replies[v].ttft_s)
                k, r = replies["kvtier"], replies["recompute"]
                history[c] = torch.cat([prompt, r.tokens])
                recompute_prefill += r.prefill_tokens
                j = _first_difference(k.tokens, r.tokens)
                diff, close = _compare_logits(k.logits, r.logits, r.tokens.numel(), j)
                # Unmeasured once any request's was: a maximum over the rest understates it.
                worst = None if worst is None or diff is None else max(worst, diff)
                mismatches += not close
                if j is not None:
                    differing += 1
                    if first is None:
                        request = turn * len(users) + c
                        first = {"request": request, "conversation": c, "turn": turn, "token": j}
                on_request()
        stats = gen.stats
    return DemoResult(
        model=str(opts.model) if opts.model else f"random-weight llama (seed {opts.seed})",
        requests=stats.requests,
        prompt_tokens=stats.prompt_tokens,
        identical_outputs=differing == 0 and mismatches == 0,
        max_logit_diff=worst,
        differing_requests=differing,
        logit_mismatches=mismatches,
        first_divergence=first,
        prefix_hit_ratio=stats.prefix_hit_ratio,
        prefill_tokens={"kvtier": stats.prefill_tokens, "recompute": recompute_prefill},
        prefill_tokens_saved=recompute_prefill - stats.prefill_tokens,
        ttft_median_s={v: statistics.median(t) for v, t in ttft.items()},
        ttft_p90_s={v: _percentile(t, 0.9) for v, t in ttft.items()},
        bytes_loaded=stats.bytes_loaded,
        bytes_stored=stats.bytes_stored,
        failed_loads=stats.failed_loads,
        wall_s=time.perf_counter() - start,
        options={k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
    )


def _size(n: int) -> str:
    """`n` bytes in MiB (GiB from 1 GiB), or KiB / B where MiB to one decimal would read 0.0
    (a tiny workload)."""
    if n >= 2**30:
        return f"{n / 2**30:,.1f} GiB"
    if n >= 2**20 // 10:
        return f"{n / 2**20:.1f} MiB"
    if n >= 2**10:
        return f"{n / 2**10:.1f} KiB"
    return f"{n} B"


def result_table(r: DemoResult) -> Table:
    """The demo's report as a rich table: kvtier next to recomputation."""
    table = Table(title="kvtier demo: multi-turn chat", caption=f"model: {r.model}")
    table.add_column("")
    table.add_column("kvtier", justify="right")
    table.add_column("recompute", justify="right")
    saved = r.prefill_tokens_saved / r.prefill_tokens["recompute"]
    speedup = r.ttft_median_s["recompute"] / r.ttft_median_s["kvtier"]
    rows = [
        ("requests", str(r.requests), str(r.requests)),
        ("prefix hit", f"{r.prefix_hit_ratio:.1%}", "-"),
        ("prefill tokens", f"{r.prefill_tokens['kvtier']:,}", f"{r.prefill_tokens['recompute']:,}"),
        ("prefill tokens saved", f"{r.prefill_tokens_saved:,} ({saved:.0%})", "-"),
        (
            "TTFT median",
            f"{r.ttft_median_s['kvtier'] * 1e3:.1f} ms ({speedup:.1f}x)",
            f"{r.ttft_median_s['recompute'] * 1e3:.1f} ms",
        ),
        (
            "TTFT p90",
            f"{r.ttft_p90_s['kvtier'] * 1e3:.1f} ms",
            f"{r.ttft_p90_s['recompute'] * 1e3:.1f} ms",
        ),
        ("bytes loaded", _size(r.bytes_loaded), "-"),
        ("bytes stored", _size(r.bytes_stored), "-"),
    ]
    for row in rows:
        table.add_row(*row)
    return table


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Declare `kvtier demo`'s arguments on `p`."""
    d = DemoOptions()
    p.epilog = EXIT_HELP
    p.add_argument(
        "--conversations",
        type=int,
        default=d.conversations,
        help="conversations, their turns interleaved round-robin (default %(default)s)",
    )
    p.add_argument(
        "--turns", type=int, default=d.turns, help="turns per conversation (default %(default)s)"
    )
    p.add_argument(
        "--system-tokens",
        type=int,
        default=d.system_tokens,
        help="shared system prompt length (default %(default)s)",
    )
    p.add_argument(
        "--user-tokens",
        type=int,
        default=d.user_tokens,
        help="mean new user tokens per turn, twice that on the first (default %(default)s)",
    )
    p.add_argument(
        "--new-tokens",
        type=int,
        default=d.new_tokens,
        help="tokens generated per reply (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="workload and model seed (default 0)")
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="local transformers checkpoint directory (AutoModelForCausalLM, no download); "
        "default: a seeded random-weight Llama-architecture model",
    )
    p.add_argument(
        "--json",
        default=None,
        metavar="FILE",
        help="write the results as one JSON object (the table's numbers, whether and where "
        "the tokens differ, the options) to FILE; '-': to stdout, instead of the table",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar and no table")


def _check_writable(path: Path, model: Path | None = None) -> None:
    """Refuse `path` for `--json` unless a file can be written there and it is no file of the
    `model` checkpoint (its config.json, say, which the results would replace); leaves no new
    file."""
    if not path.parent.is_dir():
        raise ValueError(f"--json {path}: directory {path.parent} does not exist")
    existed = path.exists()
    if existed and model is not None:
        _check_not_in_checkpoint(path, model)
    # Through a dangling link, opening creates the link's target: that file is the one to
    # remove, not the user's link (unlinking `path` deleted the link and left an empty target).
    created = Path(os.path.realpath(path))
    try:
        with path.open("a"):
            pass
    except OSError as e:
        raise ValueError(f"--json {path}: cannot write there ({e.strerror or e})") from None
    if not existed:
        created.unlink()


def _check_not_in_checkpoint(path: Path, model: Path) -> None:
    """Refuse `path` when it is one of `model`'s files, also through a link (a Hugging Face
    cache snapshot links its files to blobs elsewhere)."""
    try:
        target = os.stat(path)
    except OSError:
        return  # refused by the write check that follows
    for root, _dirs, files in os.walk(model):
        for name in files:
            file = os.path.join(root, name)
            with contextlib.suppress(OSError):  # a dangling link is no file of ours
                if os.path.samestat(os.stat(file), target):
                    raise ValueError(
                        f"--json {path} is the checkpoint's {os.path.relpath(file, model)} "
                        f"(--model {model}); expected a file outside the checkpoint for the "
                        "results"
                    )


@contextlib.contextmanager
def _transformers_progress_off(off: bool) -> Iterator[None]:
    """Inside, with `off`: no transformers progress bar (its "Loading weights" bar), and
    afterwards the setting as it was."""
    if not off:
        yield
        return
    from transformers.utils import logging

    hf_logging: Any = logging  # untyped upstream
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _verdict(r: DemoResult) -> str:
    """The line under the table: whether the tokens are identical, and where they first
    differ."""
    if r.max_logit_diff is None:
        diff = "max logit difference not measured: logits missing or not finite"
    else:
        diff = f"max logit difference {r.max_logit_diff:.1e}"
    if r.first_divergence is None and r.logit_mismatches:
        return (
            "generated tokens: identical with and without kvtier, but their logits are NOT in "
            f"{r.logit_mismatches} of {r.requests} requests ({diff}; expected at most "
            f"{LOGIT_RTOL:.0e} of the largest |logit|, or missing or not finite)"
        )
    if r.first_divergence is None:
        return f"generated tokens: identical with and without kvtier ({diff})"
    d = r.first_divergence
    return (
        f"generated tokens: DIFFERENT with and without kvtier in {r.differing_requests} of "
        f"{r.requests} requests, first at request {d['request']} (conversation "
        f"{d['conversation']}, turn {d['turn']}), reply token {d['token']} ({diff} up to each "
        "request's first differing token)"
    )


def run(args: argparse.Namespace) -> int:
    """Run `kvtier demo`; 0 when outputs are identical, 1 when not, 2 on bad input."""
    from kvtier.cli import STDOUT, OutputError, print_rich, writing_stdout
    from kvtier.outputs import atomic_write

    opts = DemoOptions(
        conversations=args.conversations,
        turns=args.turns,
        system_tokens=args.system_tokens,
        user_tokens=args.user_tokens,
        new_tokens=args.new_tokens,
        seed=args.seed,
        model=args.model,
    )
    json_name: str | None = args.json
    to_stdout = json_name == "-"  # as `kvtier simulate --json -`: the JSON, not the table
    if json_name == "":
        raise ValueError("--json ''; expected a file path, or '-' for stdout")
    # Path() drops a trailing separator: `--json out/` wrote a file named `out`.
    if json_name is not None and json_name.endswith(tuple(s for s in (os.sep, os.altsep) if s)):
        raise ValueError(
            f"--json {json_name!r} ends in a path separator; expected a file path, e.g. "
            f"{json_name}demo.json"
        )
    if json_name is not None and not to_stdout:
        # Checked first: a run takes tens of seconds, and its results would be lost at the end.
        _check_writable(Path(json_name), opts.model)
    try:
        # Both: transformers imports without torch, and the run's `import torch` then failed
        # with a traceback and status 1, the status of "tokens differ".
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        print(
            "kvtier demo: needs torch and transformers: pip install 'kvtier[hf]'", file=sys.stderr
        )
        return 2
    requests = opts.conversations * opts.turns
    with (
        _transformers_progress_off(args.quiet),
        Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            # As `kvtier simulate`: off a terminal rich draws no bar, only a blank line.
            disable=args.quiet or not sys.stderr.isatty(),
            transient=True,
        ) as progress,
    ):
        task = progress.add_task("chat requests (kvtier + recompute)", total=requests)
        result = run_demo(opts, lambda: progress.advance(task))
    # The table first, so that a --json file that cannot be written does not cost it; a
    # failure to write stdout waits until the file holds the results.
    stdout_failed: OutputError | None = None
    if not args.quiet and not to_stdout:
        try:
            print_rich(
                result_table(result),
                f"{_verdict(result)}; wall time {result.wall_s:.0f} s",
                width=max(100, Console().width),
            )
        except OutputError as e:
            if e.where != STDOUT:
                raise
            stdout_failed = e
    if json_name is not None:
        document = json.dumps(asdict(result), indent=2) + "\n"
        if to_stdout:
            with writing_stdout():
                sys.stdout.write(document)
                sys.stdout.flush()
        else:
            try:
                # Whole or not at all: a full disk left a truncated file in place of an earlier
                # good one.
                with atomic_write(json_name) as f:
                    f.write(document)
            except OSError as e:
                raise OutputError(f"--json file {json_name!r}", e) from e
    if stdout_failed is not None:
        raise stdout_failed
    return 0 if result.identical_outputs else 1
