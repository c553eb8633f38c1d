"""docs/hf.md's Python snippets run as written and print what the page says."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

DOC = Path(__file__).resolve().parents[3] / "docs" / "hf.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


def test_snippets_run_and_print_the_documented_output() -> None:
    snippets = _blocks("python")
    assert len(snippets) == 2
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for code in snippets:
            exec(compile(code, str(DOC), "exec"), {})
    assert printed.getvalue() == _blocks("text")[0]
