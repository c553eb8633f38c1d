"""The outcome of one replay (a policy at a capacity) and its report row."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvtier.sim.shapes import ModelShape


@dataclass(slots=True)
class RunResult:
    """Counters of one replay of a trace.

    `hits` counts blocks served without recomputation (from the device cache or the CPU tier);
    `prefix_tokens` counts prompt tokens before each request's first miss, which is what an
    engine can actually skip; `prefill_tokens_saved` is the part of those the CPU tier served.
    """

    policy: str
    mode: str
    capacity_blocks: int
    capacity_frac: float
    store_threshold: int
    requests: int
    blocks: int
    tokens: int
    block_tokens: int
    hits: int
    prefix_tokens: int
    prefill_tokens_saved: int
    cpu_lookups: int
    cpu_hits: int
    loads: int
    stores: int
    evictions: int
    stores_skipped: int
    seconds: float
    device_blocks: int | None = None
    device_hits: int = 0
    store_on: str | None = None
    hits_as: str | None = None
    max_tracker_size: int | None = None
    """Keys the admission tracker held: `None` where no tracker was used (no reuse admission,
    or a bound)."""
    tracker_per_slot: float | None = None
    """The `Nx` setting `max_tracker_size` came from, if any."""

    @property
    def block_hit_ratio(self) -> float:
        """Share of block accesses served without recomputation."""
        return self.hits / self.blocks if self.blocks else 0.0

    @property
    def prefix_hit_ratio(self) -> float:
        """Token-weighted share of prompts served before each request's first miss."""
        return self.prefix_tokens / self.tokens if self.tokens else 0.0

    @property
    def cpu_hit_ratio(self) -> float:
        """Share of CPU-tier lookups that hit."""
        return self.cpu_hits / self.cpu_lookups if self.cpu_lookups else 0.0

    @property
    def blocks_per_s(self) -> float:
        """Replay speed: block accesses per second of wall time."""
        return self.blocks / self.seconds if self.seconds > 0 else 0.0

    def to_row(self, shape: ModelShape | None = None) -> dict[str, Any]:
        """A flat dict for JSON and CSV; byte counts are `None` without a model shape."""
        row = asdict(self)
        row["block_hit_ratio"] = self.block_hit_ratio
        row["prefix_hit_ratio"] = self.prefix_hit_ratio
        row["cpu_hit_ratio"] = self.cpu_hit_ratio
        row["blocks_per_s"] = self.blocks_per_s
        block_bytes = shape.block_bytes(self.block_tokens) if shape is not None else None
        row["model_shape"] = shape.name if shape is not None else None
        row["bytes_loaded"] = self.loads * block_bytes if block_bytes is not None else None
        row["bytes_stored"] = self.stores * block_bytes if block_bytes is not None else None
        row["capacity_bytes"] = (
            self.capacity_blocks * block_bytes if block_bytes is not None else None
        )
        # Put the identifying and headline fields first, the rest in declaration order.
        first = (
            "policy",
            "capacity_blocks",
            "capacity_frac",
            "block_hit_ratio",
            "prefix_hit_ratio",
        )
        # Fields added later go last, so existing CSV columns keep their positions.
        last = ("max_tracker_size", "tracker_per_slot")
        return (
            {k: row[k] for k in first}
            | {k: v for k, v in row.items() if k not in first and k not in last}
            | {k: row[k] for k in last}
        )
