"""scripts/setup.sh as a reused or unusual environment meets it.

Before: KVTIER_WITH_VLLM=true (anything but 1) skipped vLLM without a word; vLLM's dependencies
were installed only together with vLLM, so a run stopped after vLLM went in left an environment
that imported vllm and never got the rest (`import vllm.v1.core.sched.scheduler`: no module
named 'cbor2'); an environment whose python links to a removed interpreter failed in venv with
"[Errno 2] No such file or directory"; and one with Python 3.10 went on to install torch and
then kept pip resolving for over ten minutes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "scripts" / "setup.sh"


def _stub_env(tmp_path: Path, python_body: str = "") -> tuple[Path, Path]:
    """A stand-in environment (a space in its path) whose python logs each call to a file and
    otherwise runs `python_body`; returns the environment and the log."""
    venv = tmp_path / "a venv"
    bin_dir = venv / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "python.log"
    log.write_text("")
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    python = bin_dir / "python"
    python.write_text(f'#!/usr/bin/env bash\n{python_body}\nprintf "%s\\n" "$*" >> "{log}"\n')
    python.chmod(0o755)
    return venv, log


def _setup(tmp_path: Path, venv: Path, with_vllm: str) -> subprocess.CompletedProcess[str]:
    # A python that must not be run: it would create an environment and install torch.
    no_python = tmp_path / "no-python"
    no_python.write_text('#!/usr/bin/env bash\necho "created a venv: $*" >&2\nexit 97\n')
    no_python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
    env |= {"KVTIER_VENV": str(venv), "KVTIER_WITH_VLLM": with_vllm, "PYTHON": str(no_python)}
    return subprocess.run(["bash", str(SETUP)], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("value", ["true", "yes", "2", " 1"])
def test_kvtier_with_vllm_other_than_0_or_1_is_refused_by_name(value: str, tmp_path: Path) -> None:
    venv, log = _stub_env(tmp_path)
    done = _setup(tmp_path, venv, value)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert f"KVTIER_WITH_VLLM='{value}'; expected 0" in done.stderr
    assert log.read_text() == ""  # refused before anything ran


@pytest.mark.parametrize("value", ["1", ""])
def test_vllms_dependencies_are_installed_where_vllm_already_imports(
    value: str, tmp_path: Path
) -> None:
    """`import vllm` needs only torch, numpy and packaging: a run stopped after vLLM went in
    left it importable, and later runs never installed the rest."""
    venv, log = _stub_env(tmp_path)  # its python says yes to "import vllm; version 0.33.0"
    done = _setup(tmp_path, venv, value)
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    assert "-m pip install -q --no-deps vllm==0.33.0" not in calls
    assert "-m pip install -q -r requirements/vllm033-cpu.txt" in calls
    assert "-m pip install -q --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2" in calls


def test_an_environment_whose_python_is_gone_is_a_clear_error(tmp_path: Path) -> None:
    venv = tmp_path / "a venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(tmp_path / "removed" / "python3.11")
    done = _setup(tmp_path, venv, "0")
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "created a venv" not in done.stderr
    (line,) = [s for s in done.stderr.splitlines() if s.startswith("setup.sh: error:")]
    assert f"{venv}/bin/python links to a Python that is gone" in line
    assert f"remove {venv}" in line


def test_an_environment_older_than_python_3_11_is_a_clear_error(tmp_path: Path) -> None:
    # A real interpreter that reports itself as 3.10 to whatever the script asks with -c.
    pretend = "import sys; sys.version_info = (3, 10, 13, 'final', 0); sys.version = '3.10.13'"
    body = f'if [ "$1" = -c ]; then exec "{sys.executable}" -c "{pretend}"$\'\\n\'"$2"; fi'
    venv, log = _stub_env(tmp_path, body)
    done = _setup(tmp_path, venv, "0")
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert f"{venv} has Python 3.10.13; kvtier needs 3.11 or newer" in done.stderr
    assert log.read_text() == ""  # no pip install ran
