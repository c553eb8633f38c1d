"""Trace simulator: readers, replays through the real CPU-tier manager, OPT, reports."""

from kvtier.sim.advise import Advice, advise
from kvtier.sim.bounds import belady, opt_result
from kvtier.sim.readers import (
    infer_block_tokens,
    iter_trace,
    read_mooncake,
    read_token_prompts,
    read_trace,
)
from kvtier.sim.replay import DevicePrefixCache, make_manager, replay_engine, replay_flat
from kvtier.sim.result import RunResult
from kvtier.sim.runner import ReplayOptions, run_grid, run_one
from kvtier.sim.shapes import MODEL_PRESETS, ModelShape, parse_capacity, parse_model_shape
from kvtier.sim.trace import Request, Trace, TraceFormatError

__all__ = [
    "MODEL_PRESETS",
    "Advice",
    "DevicePrefixCache",
    "ModelShape",
    "ReplayOptions",
    "Request",
    "RunResult",
    "Trace",
    "TraceFormatError",
    "advise",
    "belady",
    "infer_block_tokens",
    "iter_trace",
    "make_manager",
    "opt_result",
    "parse_capacity",
    "parse_model_shape",
    "read_mooncake",
    "read_token_prompts",
    "read_trace",
    "replay_engine",
    "replay_flat",
    "run_grid",
    "run_one",
]
