"""The compiled library's switches read booleans as the config does: `KVTIER_NATIVE_COPY=false`
used to leave the library on (only "0" turned it off), and `KVTIER_PORTABLE_COPY=true` did not
select the portable build (only "1" did)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.transfer import native


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No library built yet in this process, and a cache of its own."""
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_cached", native._UNSET)
    monkeypatch.setattr(native, "_cached_extension", native._UNSET)
    return monkeypatch


@pytest.mark.parametrize("off", ["0", "false", "False", "no", "off", " OFF "])
def test_every_spelling_of_off_disables_the_library(fresh: pytest.MonkeyPatch, off: str) -> None:
    fresh.setenv("KVTIER_NATIVE_COPY", off)
    assert native.library() is None


def test_a_value_that_is_no_boolean_is_refused_by_name(fresh: pytest.MonkeyPatch) -> None:
    fresh.setenv("KVTIER_NATIVE_COPY", "disabled")
    with pytest.raises(ValueError, match=r"KVTIER_NATIVE_COPY='disabled' is invalid; expected a"):
        native.library()
    fresh.setenv("KVTIER_NATIVE_COPY", "0")
    assert native.library() is None  # the refusal cached nothing


def test_the_portable_build_is_chosen_by_any_spelling_of_on(fresh: pytest.MonkeyPatch) -> None:
    commands: list[list[str]] = []

    def build(path: Path, command: list[str], load: object) -> None:
        commands.append(command)
        raise OSError("not built in this test")

    fresh.setattr(native, "_compiler", lambda: ["cc"])
    fresh.setattr(native, "_build_and_load", build)
    for value in ("true", "1", "yes", "0", "", "off"):
        fresh.setenv("KVTIER_PORTABLE_COPY", value)
        fresh.setattr(native, "_cached", native._UNSET)
        assert native.library() is None
    assert ["-DKVT_PORTABLE_COPY" in c for c in commands] == [True] * 3 + [False] * 3


@pytest.mark.parametrize(("raw", "default", "expected"), [("", True, True), ("  ", False, False)])
def test_blank_is_the_default(
    monkeypatch: pytest.MonkeyPatch, raw: str, default: bool, expected: bool
) -> None:
    from kvtier.base import env_flag

    monkeypatch.setenv("KVTIER_X_FLAG", raw)
    assert env_flag("KVTIER_X_FLAG", default) is expected
