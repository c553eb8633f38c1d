"""Every option of `kvtier simulate --help` and `kvtier demo --help` says what it does and its
default; --hash lists its choices."""

from __future__ import annotations

import pytest

from kvtier.cli import main
from kvtier.hashing import HASH_ALGORITHMS


def _entries(command: str, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """Each option's --help entry, its lines joined: `{"--hash": "--hash HASH token ..."}`."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    lines = capsys.readouterr().out.split("options:", 1)[1].splitlines()
    entries: dict[str, str] = {}
    flag = ""
    for line in lines:
        if line.startswith("  -"):  # "  -q, --quiet  no progress bar": named by its long flag
            flag = [w.rstrip(",") for w in line.split() if w.startswith("-")][-1]
            entries[flag] = ""
        if flag:
            entries[flag] += " " + line.strip()
    return {k: " ".join(v.split()) for k, v in entries.items()}


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        ("--store-threshold", "(default 0)"),
        ("--format", "(default auto: from the first record)"),
        ("--hash", "(needs the xxhash package; default sha256)"),
        ("--namespace", "the model id (default: none)"),
    ],
)
def test_simulate_options_state_their_default(
    flag: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert says in _entries("simulate", capsys)[flag]


def test_simulate_hash_lists_every_algorithm(capsys: pytest.CaptureFixture[str]) -> None:
    entry = _entries("simulate", capsys)["--hash"]
    assert all(name in entry for name in HASH_ALGORITHMS), entry


def test_demo_conversations_and_json_say_what_they_are(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("torch")
    entries = _entries("demo", capsys)
    assert (
        "conversations, their turns interleaved round-robin (default 8)"
        in entries["--conversations"]
    )
    assert "as one JSON object" in entries["--json"] and "'-': to stdout" in entries["--json"]
