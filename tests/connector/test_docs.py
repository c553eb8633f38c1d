"""The connector guide's example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "connector.md"


def test_step_loop_example_runs() -> None:
    (code,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    scope: dict[str, object] = {}
    exec(compile(code, str(DOC), "exec"), scope)
    worker = scope["worker"]
    worker.transfer.wait(range(1, 10))  # type: ignore[attr-defined]
    scheduler = scope["scheduler"]
    scheduler.on_worker_results(worker.get_finished())  # type: ignore[attr-defined]
    assert scheduler.manager.get_stats().ready == 3  # type: ignore[attr-defined]
    worker.transfer.shutdown()  # type: ignore[attr-defined]
