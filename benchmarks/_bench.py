"""What the benchmark scripts share: parsing a `PAGE_KIBxBLOCKS` case, showing and saving rows.

The scripts run as `python benchmarks/NAME.py`, which puts this folder on `sys.path`.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

KiB = 1 << 10


def parse_case(text: str) -> tuple[int, int]:
    """`"256x16"` -> (page bytes, blocks per job); argparse's error for anything else."""
    page, _, blocks = text.partition("x")
    try:
        p, b = int(page), int(blocks)
    except ValueError:
        p = b = 0
    if p < 1 or b < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected PAGE_KIBxBLOCKS with both at least 1, e.g. 256x16"
        )
    return p * KiB, b


def show_and_save(table: Table, rows: list[dict[str, object]], json_path: str | None) -> None:
    """Print `table`; write `rows` as a JSON list to `json_path` if given."""
    Console().print(table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
