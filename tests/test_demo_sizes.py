"""`kvtier demo`'s report shows the bytes a tiny workload moved, not "0.0 MiB"."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.demo import DemoResult, result_table


def _result(loaded: int, stored: int) -> DemoResult:
    return DemoResult(
        model="m", requests=1, prompt_tokens=10, identical_outputs=True, max_logit_diff=0.0,
        differing_requests=0, first_divergence=None,
        prefix_hit_ratio=0.5, prefill_tokens={"kvtier": 5, "recompute": 10},
        prefill_tokens_saved=5, ttft_median_s={"kvtier": 1.0, "recompute": 2.0},
        ttft_p90_s={"kvtier": 1.0, "recompute": 2.0}, bytes_loaded=loaded,
        bytes_stored=stored, failed_loads=0, wall_s=1.0,
    )  # fmt: skip


def _bytes_cells(r: DemoResult) -> dict[str, str]:
    table = result_table(r)
    labels = list(table.columns[0].cells)
    values = list(table.columns[1].cells)
    return {str(k): str(v) for k, v in zip(labels, values, strict=True) if "bytes" in str(k)}


@pytest.mark.parametrize(
    ("n", "shown"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (4096, "4.0 KiB"),
        (65536, "64.0 KiB"),  # one block of the demo model, 0.06 MiB
        (2**20 // 10, "0.1 MiB"),
        (3 * 2**20, "3.0 MiB"),
    ],
)
def test_bytes_moved_are_shown_in_a_unit_that_shows_them(n: int, shown: str) -> None:
    cells = _bytes_cells(_result(n, n))
    assert cells == {"bytes loaded": shown, "bytes stored": shown}
