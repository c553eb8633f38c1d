"""`kvtier demo`'s verdict and the set-up script, as a new user meets them.

Before, the verdict read the greedy tokens only: kvtier logits 0.5 off recomputation's, NaN
(reported as a difference of 0.0) or missing rows all passed as "identical", exit 0. And
scripts/setup.sh reused any environment with a python in it, so one without pip (a venv made
where ensurepip was missing) failed every later run with "No module named pip"."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch

from kvtier.cli import main

TINY = ["--conversations", "2", "--turns", "2", "--system-tokens", "16", "--user-tokens", "8",
        "--new-tokens", "4"]  # fmt: skip
SETUP = Path(__file__).resolve().parents[1] / "scripts" / "setup.sh"


def _shift(logits: torch.Tensor) -> torch.Tensor:
    # Token 0's logit only, by far less than the margin of any argmax it is not: the tokens
    # stay the same (the run below checks that it found them equal).
    logits[:, 0] += 0.5
    return logits


def _nan(logits: torch.Tensor) -> torch.Tensor:
    logits[0, 0] = float("nan")
    return logits


def _missing_rows(logits: torch.Tensor) -> torch.Tensor:
    return logits[:1]


def _not_json(name: str) -> None:
    raise AssertionError(f"{name} is not JSON: strict readers (jq, JavaScript) refuse it")


def _alter_kvtier_logits(
    monkeypatch: pytest.MonkeyPatch, alter: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    from kvtier.integrations.hf.generator import KVTierGenerator

    real_one = KVTierGenerator.generate_one

    def generate_one(self: KVTierGenerator, prompt: torch.Tensor, n: int) -> Any:
        res = real_one(self, prompt, n)
        return dataclasses.replace(res, logits=alter(res.logits.clone()))

    monkeypatch.setattr(KVTierGenerator, "generate_one", generate_one)


@pytest.mark.parametrize("alter", [_shift, _nan, _missing_rows])
def test_logits_off_recomputation_are_not_identical_even_with_equal_tokens(
    alter: Callable[[torch.Tensor], torch.Tensor],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _alter_kvtier_logits(monkeypatch, alter)
    out = tmp_path / "demo.json"
    assert main(["demo", *TINY, "--json", str(out)]) == 1
    report = json.loads(out.read_text(), parse_constant=_not_json)
    assert (report["differing_requests"], report["first_divergence"]) == (0, None)
    assert report["identical_outputs"] is False
    assert report["logit_mismatches"] == report["requests"] == 4
    if alter is _shift:
        assert report["max_logit_diff"] >= 0.5
    else:  # not NaN's 0.0
        assert report["max_logit_diff"] is None
    printed = " ".join(capsys.readouterr().out.split())
    assert "identical with and without kvtier, but their logits are NOT in 4 of 4" in printed
    if alter is not _shift:
        assert "max logit difference not measured: logits missing or not finite" in printed


def test_rounding_sized_logit_differences_are_still_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def nudge(logits: torch.Tensor) -> torch.Tensor:
        return logits + 1e-5 * max(1.0, float(logits.abs().max()))

    _alter_kvtier_logits(monkeypatch, nudge)
    out = tmp_path / "demo.json"
    assert main(["demo", *TINY, "--quiet", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["identical_outputs"], report["logit_mismatches"]) == (True, 0)
    assert 0 < report["max_logit_diff"] < 1e-3


def test_setup_adds_pip_to_an_environment_that_lacks_it(tmp_path: Path) -> None:
    venv = tmp_path / "venv without pip"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    if subprocess.run([py, "-m", "ensurepip", "--version"], capture_output=True).returncode:
        pytest.skip("this python has no ensurepip")
    # No package source, so the script stops at its first install, once pip is there.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    env |= {
        "KVTIER_VENV": str(venv),
        "KVTIER_WITH_VLLM": "0",
        "PYTHON": sys.executable,
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_INDEX": "1",
    }
    done = subprocess.run(
        ["bash", str(SETUP)], env=env, capture_output=True, text=True, timeout=300
    )
    assert "No module named pip" not in done.stderr, done.stderr
    assert subprocess.run([py, "-m", "pip", "--version"], capture_output=True).returncode == 0


def _fake_distribution(site: Path, name: str, version: str) -> None:
    """An importable `name` that pip and importlib.metadata see as `version`."""
    (site / name).mkdir()
    (site / name / "__init__.py").write_text(f"__version__ = {version!r}\n")
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


def test_setup_replaces_another_vllm_version_in_a_reused_environment(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    # The pinned torch is "there", so the script goes on to vLLM; with no package source it
    # stops at the first thing it installs.
    _fake_distribution(site, "torch", "2.13.0")
    _fake_distribution(site, "vllm", "0.32.0")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    env |= {
        "KVTIER_VENV": str(venv),
        "KVTIER_WITH_VLLM": "1",
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_INDEX": "1",
    }
    done = subprocess.run(
        ["bash", str(SETUP)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    assert "vllm==0.33.0" in done.stderr, done.stderr
