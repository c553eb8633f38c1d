"""A command that crashes exits with its own status, never one that is a command's answer."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cli import INTERNAL_ERROR, main


def _crash(*args: object, **kwargs: object) -> int:
    raise ZeroDivisionError("a bug deep inside")


def test_a_demo_crash_is_not_read_as_tokens_differ(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import kvtier.demo

    monkeypatch.setattr(kvtier.demo, "run_demo", _crash)
    status = main(["demo", "--conversations", "1", "--turns", "1", "--quiet"])
    assert status == INTERNAL_ERROR
    assert status not in (0, 1, 2)  # identical, differ, bad arguments
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert "ZeroDivisionError: a bug deep inside" in err
    assert "kvtier demo: internal error (exit 70): ZeroDivisionError" in err.splitlines()[-1]


def test_a_runtime_error_that_is_not_a_replay_error_is_an_internal_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, a RuntimeError other than ReplayError was re-raised: status 1 from Python.
    def boom(args: object) -> int:
        raise RuntimeError("not a replay failure")

    monkeypatch.setattr("kvtier.sim.command.run", boom)
    assert main(["simulate", "no-such-trace.jsonl"]) == INTERNAL_ERROR
    assert "RuntimeError: not a replay failure" in capsys.readouterr().err


def test_a_replay_error_and_bad_arguments_keep_their_statuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", str(tmp_path / "missing.jsonl")]) == 2
    assert "internal error" not in capsys.readouterr().err


def test_interrupts_are_not_internal_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr("kvtier.sim.command.run", interrupted)
    assert main(["simulate", "t.jsonl"]) == 130
