"""Store and load throughput of the connector path: scheduler half, worker half, transfer engine.

KV tensors shaped as vLLM allocates them for a Llama-3-8B-like model (per layer
`(num_blocks, 2, block_size, kv_heads, head_dim)`, bf16; no model runs) are registered with
kvtier's transfer engine. A first wave of requests with distinct prompts is "prefilled" (the
scheduler plans eager stores of every full chunk, the worker half submits them after the step);
a second wave with the same prompts is admitted, the scheduler finds the hits and plans the
loads, and the worker half runs them. Each wave's bytes over its wall time (from the first
submit to the last completion) is its GB/s, next to one contiguous copy of the same bytes
between the same memories, measured in the same run. Medians over `--repeats` rounds.

    python benchmarks/worker_side.py                # CUDA where present, else CPU
    python benchmarks/worker_side.py --device cpu --layers 4 --requests 4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from typing import TypedDict

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from _bench import sync
from _cli import positive_int, progress, require_memory, require_writable, run_main, write_results
from kvtier.connector import OffloadingScheduler, OffloadingWorker, StepProgress
from kvtier.cpu import CPUOffloadingManager
from kvtier.transfer import HostPool, KVCacheRegistration, KVTensor, make_transfer_worker


class _CudaOptions(TypedDict, total=False):
    """What `make_transfer_worker` takes on CUDA beyond the registration and the pool."""

    copy_mode: str
    compiled: bool | None


def _hashes(name: str, n: int) -> list[bytes]:
    out, parent = [], b"root"
    for i in range(n):
        parent = hashlib.sha256(parent + name.encode() + i.to_bytes(4, "big")).digest()
        out.append(parent)
    return out


class Rig:
    """One device KV cache, host pool, manager, scheduler half and worker half."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device = args, device
        blocks_per_req = args.prompt_tokens // args.block_size
        self.stride = blocks_per_req + 1  # a request's blocks: its prompt's, one for the rest
        self.num_blocks = 2 * args.requests * self.stride
        shape = (self.num_blocks, 2, args.block_size, args.kv_heads, args.head_dim)
        self.layers = [torch.ones(shape, dtype=torch.bfloat16, device=device)
                       for _ in range(args.layers)]  # fmt: skip
        reg = KVCacheRegistration([KVTensor(t, "flashinfer") for t in self.layers])
        self.page_bytes = reg.page_bytes(0)
        num_slots = args.requests * blocks_per_req // args.blocks_per_chunk
        self.pool = HostPool(reg, args.blocks_per_chunk, num_slots=num_slots)
        kwargs: _CudaOptions = {}
        if device.type == "cuda":
            compiled = {"auto": None, "compiled": True}.get(args.cuda_path, False)
            kwargs = {"copy_mode": args.copy_mode, "compiled": compiled}
        self.transfer = make_transfer_worker(reg, self.pool, **kwargs)
        self.worker = OffloadingWorker(self.transfer)
        self.blocks_per_req = blocks_per_req
        self.round = 0
        self._scratch: torch.Tensor | None = None  # device side of `ceiling`'s copy

    def wave(self, load: bool) -> tuple[int, float]:
        """Admit every request, run one step; returns (bytes moved, seconds)."""
        a = self.args
        if not load:  # a fresh manager per round: the first wave always stores everything
            manager = CPUOffloadingManager(self.pool.num_slots, "lru")
            self.scheduler = OffloadingScheduler(
                manager, tokens_per_block=a.block_size, blocks_per_chunk=a.blocks_per_chunk
            )
            self.round += 1
        sched = self.scheduler
        progress = []
        for r in range(a.requests):
            req_id = f"{self.round}-{r}-{'load' if load else 'store'}"
            hashes = _hashes(f"{self.round}-{r}", self.blocks_per_req)
            sched.add_request(req_id, hashes, a.prompt_tokens + 1)
            matched = sched.get_num_new_matched_tokens(req_id, 0)
            assert matched == (a.prompt_tokens if load else 0), matched
            first = (r + (a.requests if load else 0)) * self.stride
            blocks = list(range(first, first + self.stride))
            sched.update_state_after_alloc(req_id, [blocks], matched or 0)
            computed = a.prompt_tokens if not load else 0
            progress.append(StepProgress(req_id, [blocks], computed))
        meta = sched.build_step_metadata(progress)
        jobs = meta.loads if load else meta.stores
        assert jobs, "the wave planned no transfers"
        sync(self.device)
        start = time.perf_counter()
        if load:
            self.worker.start_step(meta)
            self.worker.wait_for_loads(meta)
        else:
            self.worker.finish_step(meta)
            self.transfer.wait([j.job_id for j in jobs])
        sync(self.device)
        seconds = time.perf_counter() - start
        results = self.worker.get_finished()
        assert all(r.success for r in results), "a transfer failed"
        sched.on_worker_results(results)
        sched.take_finished()
        for p in progress:
            sched.request_finished(p.req_id)
        moved = sum(len(j.device_blocks) for j in jobs) * self.page_bytes
        return moved, seconds

    def ceiling(self, nbytes: int, store: bool) -> float:
        """One contiguous copy of `nbytes` between the device tensors and the pool."""
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = torch.ones(nbytes, dtype=torch.uint8, device=self.device)
        dev = self._scratch[:nbytes]
        host = self.pool.tensor.view(-1)[:nbytes]
        dst, src = (host, dev) if store else (dev, host)
        sync(self.device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(self.device)
        return time.perf_counter() - start

    def check_round_trip(self) -> None:
        """The loaded blocks hold the bytes that were stored (device blocks are all ones)."""
        a = self.args
        for r in range(a.requests, 2 * a.requests):
            first = r * self.stride
            for t in self.layers:
                if not bool(torch.all(t[first : first + self.blocks_per_req] == 1)):
                    raise AssertionError(f"loaded KV of request {r} differs from what was stored")

    def close(self) -> None:
        self.transfer.shutdown()
        self.pool.close()


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run the waves, print the table, write JSON if asked."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--layers", type=positive_int, default=32)
    ap.add_argument("--kv-heads", type=positive_int, default=8)
    ap.add_argument("--head-dim", type=positive_int, default=128)
    ap.add_argument("--block-size", type=positive_int, default=16, help="tokens per device block")
    ap.add_argument("--blocks-per-chunk", type=positive_int, default=16)
    ap.add_argument("--prompt-tokens", type=positive_int, default=4096,
                    help="a multiple of --block-size x --blocks-per-chunk")  # fmt: skip
    ap.add_argument("--requests", type=positive_int, default=8, help="requests per wave")
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--copy-mode", choices=["auto", "kernel", "dma"], default="auto",
                    help="CUDA only")  # fmt: skip
    ap.add_argument("--cuda-path", choices=["auto", "compiled", "torch"], default="auto",
                    help="CUDA: submit through the compiled engine (where it builds), or "
                    "through torch ops")  # fmt: skip
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    chunk = args.block_size * args.blocks_per_chunk
    if args.prompt_tokens % chunk:
        # Only whole chunks are stored, so the loads would not find the whole prompt.
        ap.error(f"--prompt-tokens {args.prompt_tokens} is invalid; expected a multiple of "
                 f"--block-size x --blocks-per-chunk = {chunk}")  # fmt: skip
    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    elif name == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device cuda: no CUDA device is visible to torch {torch.__version__}")
    # Else ignored on CPU, where the table does not show them: a run that seems to measure them.
    cuda_only = [flag for flag, given in (("--copy-mode", args.copy_mode != "auto"),
                 ("--cuda-path", args.cuda_path != "auto")) if given]  # fmt: skip
    if cuda_only and name != "cuda":
        ap.error(f"{', '.join(cuda_only)}: only with --device cuda; the device here is cpu")
    # As Rig allocates them: the layers' device blocks, the host pool, and the ceiling's device
    # scratch of a wave's bytes. All three are in this machine's memory on CPU; on a GPU, the
    # pool is.
    page = args.layers * 2 * args.block_size * args.kv_heads * args.head_dim * 2  # bfloat16
    blocks_per_req = args.prompt_tokens // args.block_size
    pool = args.requests * blocks_per_req * page
    dev = 2 * args.requests * (blocks_per_req + 1) * page
    require_memory(
        ap,
        dev + 2 * pool if name == "cpu" else pool,
        f"--layers {args.layers}, --kv-heads {args.kv_heads}, --head-dim {args.head_dim}, "
        f"--prompt-tokens {args.prompt_tokens}, --requests {args.requests}",
    )
    require_writable(ap, args.json)
    device = torch.device(name)
    rig = Rig(args, device)
    gbps: dict[str, list[float]] = {"store": [], "load": []}
    ceil: dict[str, list[float]] = {"store": [], "load": []}
    try:
        for i in range(args.repeats + 1):  # the first round warms up
            moved: dict[str, int] = {}
            for direction in ("store", "load"):
                if direction == "load":
                    for t in rig.layers:  # loads must bring the ones back
                        t[args.requests * rig.stride :].zero_()
                moved[direction], seconds = rig.wave(direction == "load")
                if i:
                    gbps[direction].append(moved[direction] / seconds / 1e9)
            rig.check_round_trip()
            # After the check: the ceiling copies overwrite the pool and device scratch.
            for direction, n in moved.items():
                c = rig.ceiling(n, direction == "store")
                if i:
                    ceil[direction].append(n / c / 1e9)
            progress(f"round {i} of {args.repeats}: done" + ("" if i else " (warm-up)"))
    finally:
        rig.close()
    rows = [
        {
            "device": name,
            "direction": d,
            "page_bytes": rig.page_bytes,
            "bytes_per_wave": args.requests * rig.blocks_per_req * rig.page_bytes,
            "gbps": statistics.median(gbps[d]),
            "ceiling_gbps": statistics.median(ceil[d]),
        }
        for d in ("store", "load")
    ]
    mode = f" ({args.copy_mode}, {args.cuda_path} path)" if name == "cuda" else ""
    table = Table(title=f"connector worker side on {name}{mode}: {args.layers} layers, "
                  f"{rig.page_bytes >> 10} KiB per block, {args.blocks_per_chunk} blocks/chunk, "
                  f"{args.requests} x {args.prompt_tokens} tokens per wave")  # fmt: skip
    for col in ("direction", "GiB/wave", "GB/s", "ceiling GB/s", "ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        g, c = float(r["gbps"]), float(r["ceiling_gbps"])
        table.add_row(str(r["direction"]), f"{int(r['bytes_per_wave']) / 2**30:.2f}",
                      f"{g:.2f}", f"{c:.2f}", f"{g / c:.0%}")  # fmt: skip
    Console().print(table)
    if args.json:
        write_results(args.json, json.dumps(rows, indent=1))


if __name__ == "__main__":
    np.random.seed(0)
    run_main(main)
