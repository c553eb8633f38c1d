"""docs/transfer.md's Python snippets run as written: the first on its own, the others in one
namespace in order (each builds on the registration and pool of the ones before)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from kvtier.transfer.native import library

DOC = Path(__file__).resolve().parents[2] / "docs" / "transfer.md"


def _snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


def test_the_snippets_run_and_the_fault_example_prints_what_it_says() -> None:
    first, *rest = _snippets()
    assert len(rest) == 4
    exec(compile(first, str(DOC), "exec"), {})
    if library() is None:  # the NativeCPUTransferWorker snippet needs the compiled library
        rest = [code for code in rest if "NativeCPUTransferWorker" not in code]
    namespace: dict[str, object] = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for code in rest:
            exec(compile(code, str(DOC), "exec"), namespace)
    assert printed.getvalue().splitlines()[-1] == "{1: True, 2: False}"
