"""Small helpers shared by kvtier's tests (importable because pytest puts tests/ on the path)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest

from kvtier.base import OffloadKey, make_offload_key


def key(i: int, group: int = 0) -> OffloadKey:
    """A deterministic test key: 8 bytes of `i` plus the group index."""
    return make_offload_key(i.to_bytes(8, "big"), group)


def keys(*ids: int) -> list[OffloadKey]:
    """Several test keys."""
    return [key(i) for i in ids]


def refused_argv(
    main: Callable[[], None],
    argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> str:
    """Run a benchmark's `main()` with `argv`, expect argparse to refuse it; its stderr."""
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit):
        main()
    return capsys.readouterr().err
