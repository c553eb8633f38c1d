"""Reports of a grid of replays: a table for people; JSON, CSV and a plot for programs."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from rich.cells import cell_len
from rich.markup import escape
from rich.table import Table

from kvtier.outputs import atomic_write
from kvtier.sim.advise import Advice
from kvtier.sim.result import RunResult
from kvtier.sim.shapes import ModelShape

_GIB = 2**30


def of_opt(results: Sequence[RunResult]) -> list[float | None]:
    """Each run's block hit ratio over OPT's at its capacity; `None` where no OPT run has
    that capacity or OPT hits nothing there."""
    opt = {r.capacity_blocks: r.block_hit_ratio for r in results if r.policy == "opt"}
    return [
        r.block_hit_ratio / best if (best := opt.get(r.capacity_blocks)) else None for r in results
    ]


def rows(results: Sequence[RunResult], shape: ModelShape | None = None) -> list[dict[str, Any]]:
    """One flat dict per run (the JSON and CSV form), with the table's `of OPT` as `of_opt`."""
    return [r.to_row(shape) | {"of_opt": x} for r, x in zip(results, of_opt(results), strict=True)]


def _whole_cells(table: Table, cells: Sequence[Sequence[str]]) -> Table:
    """Add `cells` as rows, and keep every column at least as wide as its widest cell and
    header word: rich elides what does not fit the console ("52,…"), and a number or a
    policy spec cut short misleads. Headers still wrap between words."""
    for i, column in enumerate(table.columns):
        words = [*str(column.header).split(), *(c[i] for c in cells)]
        column.min_width = max(cell_len(w) for w in words)
    for row in cells:
        table.add_row(*row)
    return table


def write_json(results: Sequence[RunResult], out: IO[str], shape: ModelShape | None) -> None:
    """Write the runs as a JSON list of rows."""
    json.dump(rows(results, shape), out, indent=2)
    out.write("\n")


def write_csv(results: Sequence[RunResult], out: IO[str], shape: ModelShape | None) -> None:
    """Write the runs as CSV, one row per run, with a header."""
    data = rows(results, shape)
    if not data:
        return
    writer = csv.DictWriter(out, fieldnames=list(data[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(data)


def results_table(
    results: Sequence[RunResult], shape: ModelShape | None, *, title: str = ""
) -> Table:
    """A rich table: one row per policy and capacity, with OPT's ratio at the same capacity."""
    ratios = of_opt(results)
    has_opt = any(r.policy == "opt" for r in results)
    engine = any(r.mode == "engine" for r in results)
    # The title names the trace, whose file name is text, not markup: `run[v2].jsonl` was
    # shown as `run.jsonl`.
    table = Table(title=escape(title) if title else None, show_lines=False)
    table.add_column("policy")
    table.add_column("capacity", justify="right")
    table.add_column("% uniq", justify="right")
    table.add_column("block hit %", justify="right")
    if has_opt:
        table.add_column("of OPT", justify="right")
    table.add_column("prefix hit %", justify="right")
    if engine:
        table.add_column("CPU hit %", justify="right")
    for name in ("loads", "stores", "evictions", "skipped"):
        table.add_column(name, justify="right")
    if shape is not None:
        table.add_column("GiB loaded", justify="right")
        table.add_column("GiB stored", justify="right")
        table.add_column("prefill saved", justify="right")
    table.add_column("blocks/s", justify="right")
    block_bytes = shape.block_bytes(results[0].block_tokens) if shape and results else 0
    body: list[list[str]] = []
    for r, ratio in zip(results, ratios, strict=True):
        cells = [r.policy, f"{r.capacity_blocks:,}", f"{100 * r.capacity_frac:.1f}"]
        cells.append(f"{100 * r.block_hit_ratio:.2f}")
        if has_opt:
            cells.append(f"{ratio:.2f}" if ratio is not None else "")
        cells.append(f"{100 * r.prefix_hit_ratio:.2f}")
        if engine:
            cells.append(f"{100 * r.cpu_hit_ratio:.2f}")
        cells += [f"{r.loads:,}", f"{r.stores:,}", f"{r.evictions:,}", f"{r.stores_skipped:,}"]
        if shape is not None:
            cells.append(f"{r.loads * block_bytes / _GIB:,.1f}")
            cells.append(f"{r.stores * block_bytes / _GIB:,.1f}")
            cells.append(f"{r.prefill_tokens_saved:,}")
        cells.append(f"{r.blocks_per_s:,.0f}")
        body.append(cells)
    return _whole_cells(table, body)


def advice_table(
    advice: Sequence[Advice], unique_blocks: int, infinite: float, block_bytes: int | None = None
) -> Table:
    """A rich table of `--advise` answers; with `block_bytes` (a model shape), the host memory
    each capacity takes."""
    table = Table(
        title=f"smallest capacity reaching {100 * advice[0].target:.2f}% block hits "
        f"(95% of the infinite cache's {100 * infinite:.2f}%; {unique_blocks:,} unique blocks)"
        if advice
        else None
    )
    names = ["policy", "capacity", "% uniq"]
    if block_bytes is not None:
        names.append("GiB")
    for name in (*names, "block hit %", "replays"):
        table.add_column(name, justify="left" if name == "policy" else "right")
    body: list[list[str]] = []
    for a in advice:
        if a.capacity_blocks is None or a.capacity_frac is None:
            reached = f"{100 * a.block_hit_ratio:.2f}" if a.block_hit_ratio is not None else ""
            cells = [a.policy, "never", ""] + ([""] if block_bytes is not None else [])
            body.append([*cells, reached, str(a.replays)])
        else:
            cells = [a.policy, f"{a.capacity_blocks:,}", f"{100 * a.capacity_frac:.1f}"]
            if block_bytes is not None:
                cells.append(f"{a.capacity_blocks * block_bytes / _GIB:,.1f}")
            body.append([*cells, f"{100 * (a.block_hit_ratio or 0.0):.2f}", str(a.replays)])
    return _whole_cells(table, body)


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _figure_cls() -> Any:
    """matplotlib's `Figure`. Not pyplot: it would switch the caller's backend to Agg (a
    notebook's plots stop showing) and keep every figure a failed save left open."""
    try:
        # `import a.b` also looks `a` up; `from a.b import` may find `a.b` cached without it.
        import matplotlib.figure
    except ImportError as e:
        raise PlotUnavailable(
            "--plot needs matplotlib; install it with `pip install kvtier[plot]`"
        ) from e
    return matplotlib.figure.Figure


def plot_format(path: str | Path) -> str:
    """The image format `path`'s extension names, if matplotlib can write it.

    The extension decides, so the file written is exactly `path` (matplotlib would append
    `.png` to a name without one). Raises `ValueError` for a missing or unknown extension and
    `PlotUnavailable` without matplotlib.
    """
    _figure_cls()
    from matplotlib.backend_bases import FigureCanvasBase

    # pgf needs a LaTeX install, which would fail only once the replays are done.
    formats = set(FigureCanvasBase.get_supported_filetypes()) - {"pgf"}
    fmt = Path(path).suffix.lower().removeprefix(".")
    if fmt not in formats:
        raise ValueError(
            f"--plot={str(path)!r} is invalid; expected a file name ending in one of: "
            + ", ".join(f".{f}" for f in sorted(formats))
        )
    return fmt


def plot_miss_ratio(results: Sequence[RunResult], path: str | Path, *, title: str = "") -> None:
    """Save a miss-ratio curve: miss ratio against capacity, one line per policy.

    The format is the one `path`'s extension names (see `plot_format`).
    """
    fmt = plot_format(path)
    fig = _figure_cls()(figsize=(7, 4.5))
    ax = fig.subplots()
    infinite = [r for r in results if r.policy == "infinite"]
    policies = dict.fromkeys(r.policy for r in results if r.policy != "infinite")
    lines: list[Any] = []
    for policy in policies:
        pts = sorted(
            (100 * r.capacity_frac, 1 - r.block_hit_ratio) for r in results if r.policy == policy
        )
        style = "--" if policy == "opt" else "-"
        lines += ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=policy)
    if infinite:
        miss = 1 - infinite[0].block_hit_ratio
        lines.append(ax.axhline(miss, color="grey", linestyle=":", label="infinite"))
    ax.set_xlabel("capacity (% of the trace's unique blocks)")
    ax.set_ylabel("block miss ratio")
    # The title names the trace, whose file name is text: as mathtext (`a$^$.jsonl`) or with
    # bytes that are not UTF-8 (surrogate escapes) it failed the save after every replay.
    text = (title or "miss-ratio curve").encode("utf-8", "replace").decode("utf-8")
    ax.set_title(text, fontsize=10, parse_math=False)
    ax.grid(True, alpha=0.3)
    # Named explicitly: from the axes, legend() leaves out a label that starts with "_", as a
    # policy spec may (`_mine:Fifo`), and that policy's line was drawn unnamed.
    ax.legend(lines, [line.get_label() for line in lines])
    fig.tight_layout()
    # The canvas for `fmt` is picked per call: no backend is set for the process. Saved
    # through a file, so that a failed save leaves an earlier plot of that name whole.
    with atomic_write(path, binary=True) as f:
        fig.savefig(f, dpi=120, format=fmt)
