"""kvtier side by side with vLLM 0.33's own offloading, in one run and one environment.

(a)/(b): the Mooncake conversation trace replayed through vLLM's `CPUOffloadingManager` and
kvtier's, with the same engine call sequence (benchmarks/manager_ops.py), policy and capacity.
(c)/(d): the trace scaled to 16-token blocks (each hash id becomes 16 token ids) as requests
through vLLM's real `Scheduler` with (c) vLLM's `OffloadingConnector` and (d) kvtier's
`KVTierConnector`, same capacity and policy, workers stubbed to complete every job at once.

    python benchmarks/vs_vllm.py --json out/vs_vllm.json

Needs vLLM 0.33.0 installed next to kvtier (see docs/vllm.md for the CPU-only recipe).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvtier.base import ReqContext
from kvtier.cpu import CPUOffloadingManager
from manager_ops import MOONCAKE, Workload, mooncake_workload, replay


def compare_managers(
    workload: Workload, policies: Sequence[str], num_slots: int, repeats: int
) -> dict[str, dict[str, float]]:
    """Calls/s and prefix hit ratio of both managers, alternating runs so noise hits both."""
    from vllm.v1.kv_offload.base import LookupResult as VLookup
    from vllm.v1.kv_offload.base import ReqContext as VReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VManager

    from kvtier.base import LookupResult

    out: dict[str, dict[str, float]] = {}
    for policy in policies:
        v_rates, k_rates = [], []
        v_hit = k_hit = 0.0
        for _ in range(repeats):
            vm = VManager(num_slots, cache_policy=policy, enable_events=True)
            calls, _, secs, v_hit = replay(workload, vm, VReqContext, VLookup.HIT)
            v_rates.append(calls / secs)
            km = CPUOffloadingManager(num_slots, policy, enable_events=True)
            calls, _, secs, k_hit = replay(workload, km, ReqContext, LookupResult.HIT)
            k_rates.append(calls / secs)
        v, k = statistics.median(v_rates), statistics.median(k_rates)
        out[policy] = {
            "vllm_calls_per_s": v,
            "kvtier_calls_per_s": k,
            "speedup": k / v,
            "vllm_hit_ratio": v_hit,
            "kvtier_hit_ratio": k_hit,
        }
    return out


SCHED_BLOCK = 16


def _scheduler_engine(
    connector: str, extra: dict[str, Any], module: str | None, blocks: int
) -> Any:
    """vLLM's Scheduler for a tiny local Llama config on CPU, with `connector`."""
    import tempfile

    import torch
    from transformers import LlamaConfig
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    model_dir = tempfile.mkdtemp(prefix="kvtier-bench-llama-")
    LlamaConfig(
        vocab_size=1 << 20,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1 << 16,
    ).save_pretrained(model_dir)
    max_len = 1 << 15
    model = ModelConfig(
        model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=max_len
    )
    cache = CacheConfig(block_size=SCHED_BLOCK, enable_prefix_caching=True)
    cache.num_gpu_blocks = blocks
    sched = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=8192,
        max_model_len=max_len,
        is_encoder_decoder=False,
    )
    transfer = KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path=module,
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )
    cfg = VllmConfig(
        model_config=model,
        cache_config=cache,
        scheduler_config=sched,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    spec = FullAttentionSpec(
        block_size=SCHED_BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32
    )
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    kv = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=spec.page_size_bytes * blocks,
                layers=[n],
                layer_stride=0,
                block_stride=spec.page_size_bytes,
            )
            for n in names
        ],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    return Scheduler(
        vllm_config=cfg,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=SCHED_BLOCK,
        log_stats=True,
    )


def _vllm_chunks(scheduler: Any) -> int:
    return int(scheduler.connector.connector_scheduler.manager._num_chunks)


def _vllm_engine_with_chunks(
    policy: str, num_slots: int, slot_guess: int, align: int, device_blocks: int
) -> Any:
    """vLLM's engine with exactly `num_slots` host chunks: vLLM sizes its pool from bytes with
    its own per-chunk size, so the first guess is corrected from the count it reports."""

    def build(chunk_bytes: int) -> Any:
        extra = {"cpu_bytes_to_use": num_slots * chunk_bytes, "eviction_policy": policy}
        return _scheduler_engine("OffloadingConnector", extra, None, device_blocks)

    engine = build(slot_guess)
    got = _vllm_chunks(engine)
    if got != num_slots:
        engine = build(num_slots * slot_guess // got // align * align)
        got = _vllm_chunks(engine)
    if got != num_slots:
        raise RuntimeError(f"vLLM sized its pool to {got} chunks; wanted {num_slots}")
    return engine


def _stub_worker_output(meta: Any) -> Any:
    """What workers that finish every job at once would report for `meta`."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvtier.integrations.vllm.metadata import KVTierConnectorMetadata, KVTierWorkerMetadata

    if isinstance(meta, KVTierConnectorMetadata):
        step = meta.step
        done = [(j.job_id, True) for j in step.loads] + [(j.job_id, True) for j in step.stores]
        return KVConnectorOutput(
            finished_recving={j.req_id for j in step.loads},
            finished_sending=set(meta.held),
            kv_connector_worker_meta=KVTierWorkerMetadata(done) if done else None,
        )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )

    worker_meta = OffloadingWorkerMetadata()
    for job_id in [*meta.load_jobs, *meta.store_jobs]:
        worker_meta.mark_completed(job_id)
    return KVConnectorOutput(
        finished_recving={j.req_id for j in meta.load_jobs.values()},
        kv_connector_worker_meta=worker_meta,
    )


def _run_scheduler(
    scheduler: Any, prompts: list[list[int]], max_running: int = 16
) -> tuple[int, float, float]:
    """Feed the prompts, keeping `max_running` in the engine; return (steps, seconds, external
    hit ratio = tokens the connector served / tokens it was asked for)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(SCHED_BLOCK, sha256)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    requests = [
        Request(str(i), p, params, None, block_hasher=hasher) for i, p in enumerate(prompts)
    ]
    nxt = steps = queries = hits = 0
    live: set[str] = set()
    start = time.perf_counter()
    while nxt < len(requests) or scheduler.has_requests():
        while nxt < len(requests) and len(live) < max_running:
            scheduler.add_request(requests[nxt])
            live.add(requests[nxt].request_id)
            nxt += 1
        so = scheduler.schedule()
        stats = scheduler.connector_prefix_cache_stats
        queries += stats.queries
        hits += stats.hits
        req_ids = list(so.num_scheduled_tokens)
        reqs = scheduler.requests
        out = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[
                [7] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in req_ids
            ],
            kv_connector_output=_stub_worker_output(so.kv_connector_metadata),
        )
        for eo in scheduler.update_from_output(so, out).values():
            for o in eo.outputs:
                if o.finish_reason is not None:
                    live.discard(o.request_id)
        steps += 1
    return steps, time.perf_counter() - start, hits / max(queries, 1)


def compare_schedulers(
    trace: Path, num_requests: int, policy: str, capacity: float, repeats: int
) -> dict[str, float]:
    """Scheduler steps/s and external hit ratio, OffloadingConnector vs KVTierConnector."""
    with trace.open() as f:
        chains = [
            json.loads(line)["hash_ids"] for _, line in zip(range(num_requests), f, strict=False)
        ]
    prompts = [[*(h * SCHED_BLOCK + j for h in c for j in range(SCHED_BLOCK)), 1] for c in chains]
    unique = len({h for c in chains for h in c})
    slot_bytes = 2 * 2 * 2 * SCHED_BLOCK * 32 * 4  # layers x K/V x heads x tokens x dim x fp32
    # vLLM aligns each chunk to its shared-region alignment; give both the same slot count.
    num_slots = max(16, int(capacity * unique))
    device_blocks = 256  # small, so reuse beyond the device prefix cache needs the host tier
    v_rates, k_rates = [], []
    v_hit = k_hit = 0.0
    for _ in range(repeats):
        from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

        align = CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT
        v_slot = -(-slot_bytes // align) * align
        vs = _vllm_engine_with_chunks(policy, num_slots, v_slot, align, device_blocks)
        steps, secs, v_hit = _run_scheduler(vs, prompts)
        v_rates.append(steps / secs)
        ks = _scheduler_engine(
            "KVTierConnector",
            {"num_slots": num_slots, "cache_policy": policy},
            "kvtier.integrations.vllm",
            device_blocks,
        )
        steps, secs, k_hit = _run_scheduler(ks, prompts)
        k_rates.append(steps / secs)
    v, k = statistics.median(v_rates), statistics.median(k_rates)
    return {
        "vllm_steps_per_s": v,
        "kvtier_steps_per_s": k,
        "speedup": k / v,
        "vllm_hit_ratio": v_hit,
        "kvtier_hit_ratio": k_hit,
        "num_slots": num_slots,
        "num_requests": len(prompts),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--policies", default="lru,arc")
    parser.add_argument("--capacity", type=float, default=0.10, help="share of unique blocks")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trace", type=Path, default=MOONCAKE)
    parser.add_argument(
        "--sched-requests",
        type=int,
        default=2000,
        help="trace requests replayed through vLLM's Scheduler (c)/(d)",
    )
    parser.add_argument("--sched-policy", default="lru")
    parser.add_argument("--skip-scheduler", action="store_true")
    parser.add_argument("--json", type=Path, help="write the results as JSON to this file")
    args = parser.parse_args(argv)

    workload = mooncake_workload(args.trace)
    unique = len({k for chain in workload for k in chain})
    num_slots = max(1, int(args.capacity * unique))
    manager = compare_managers(workload, args.policies.split(","), num_slots, args.repeats)
    print(f"manager, Mooncake trace, {num_slots} slots ({args.capacity:.0%} of unique blocks)")
    print(
        f"{'policy':<7} {'vLLM calls/s':>13} {'kvtier calls/s':>15} {'ratio':>6} "
        f"{'vLLM hit %':>10} {'kvtier hit %':>12}"
    )
    for policy, r in manager.items():
        print(
            f"{policy:<7} {r['vllm_calls_per_s']:>13,.0f} {r['kvtier_calls_per_s']:>15,.0f}"
            f" {r['speedup']:>5.2f}x {100 * r['vllm_hit_ratio']:>10.2f}"
            f" {100 * r['kvtier_hit_ratio']:>12.2f}"
        )
    result: dict[str, Any] = {"manager": manager}
    if not args.skip_scheduler:
        sched = compare_schedulers(
            args.trace, args.sched_requests, args.sched_policy, args.capacity, args.repeats
        )
        result["scheduler"] = sched
        print(
            f"\nscheduler, {sched['num_requests']} trace requests in 16-token blocks, "
            f"{sched['num_slots']} host slots, policy {args.sched_policy}, workers stubbed"
        )
        print(f"{'connector':<22} {'steps/s':>9} {'hit %':>7}")
        print(
            f"{'vLLM Offloading':<22} {sched['vllm_steps_per_s']:>9,.0f}"
            f" {100 * sched['vllm_hit_ratio']:>7.2f}"
        )
        print(
            f"{'kvtier KVTier':<22} {sched['kvtier_steps_per_s']:>9,.0f}"
            f" {100 * sched['kvtier_hit_ratio']:>7.2f}   ratio {sched['speedup']:.2f}x"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
