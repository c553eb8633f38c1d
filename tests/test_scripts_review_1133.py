"""scripts/setup.sh, test.sh, demo.sh and .ci/run as a user on a fresh machine meets them.

Before: ruff, mypy (and the stubs mypy reads) and apache-tvm-ffi were unpinned, so a new release
could turn CI red with no change here; Ctrl-C while pip installed made demo.sh exit 2 with
"setting up the environment failed" and test.sh exit 1 (pip's status for it); KVTIER_VENV=.
or =src had venv write bin/, lib/ and pyvenv.cfg into the repository, and a .venv that is a file
got venv's "Unable to create directory"; a PYTHON that was no command ended in "command not
found" (127), a relative one was read from the repository root, and a 3.10 one left a new
environment behind before the version check refused it; `cd tests && bash ../scripts/test.sh
policies/test_arc.py` failed with "file or directory not found", pytest reading the path from
the repository root; and Ctrl-C while .ci/run installed the cross compiler waited for apt-get
(up to 5 minutes) and then ran the tests."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

ROOT = Path(__file__).resolve().parents[1]
PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][^\s,;]*)")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "KVTIER_"))}
    return env | {"KVTIER_WITH_VLLM": "0"} | extra


def _stub_venv(where: Path, stubs: dict[str, str]) -> Path:
    """A stand-in virtual environment (it has bin/activate) whose commands run `stubs`."""
    bin_dir = where / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return where


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def test_lint_and_type_tools_are_pinned_to_what_runs_here() -> None:
    """An exact pin equal to the running environment's: the two cannot drift apart unseen."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        dev = tomllib.load(f)["project"]["optional-dependencies"]["dev"]
    for tool in ("ruff", "mypy", "types-PyYAML"):
        (spec,) = [s for s in dev if re.match(rf"{re.escape(tool)}\b(?!-)", s)]
        pin = PIN.fullmatch(spec)
        assert pin is not None, f"dev extra: {spec!r} is not an exact pin"
        assert pin.group(2) == _installed(tool), f"{spec} but {_installed(tool)} is installed"


def test_setup_pins_every_package_it_installs_by_name() -> None:
    named = []
    for line in (ROOT / "scripts" / "setup.sh").read_text().splitlines():
        if "pip install" not in line:
            continue
        words = shlex.split(line, comments=True)
        args = words[words.index("install") + 1 :]
        skip_next = False
        for arg in args:
            if skip_next or arg.startswith("-"):
                skip_next = arg in ("-r", "-e")  # a requirements file; kvtier itself
                continue
            named.append(arg)
    assert "xgrammar==0.2.8" in named
    for arg in named:
        pin = PIN.fullmatch(arg)
        assert pin is not None, f"setup.sh installs {arg!r} without an exact version"
        found = _installed(pin.group(1))
        # Absent with KVTIER_WITH_VLLM=0; torch's local label (+cpu) satisfies its pin.
        if found is not None:
            assert found.split("+")[0] == pin.group(2), f"{arg} but {found} is installed"


def _interrupt(script: str, pip: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Runs `script` with a pip that takes its time, sends Ctrl-C (SIGINT to the process group,
    as a terminal does) once pip runs, and returns how the script ended."""
    started = tmp_path / "pip started"
    sleep = f'import time; open("{started}", "w").close(); time.sleep(60)'
    if pip == "as pip":  # pip catches KeyboardInterrupt: "Operation cancelled by user", exit 1
        slow = (
            f"import sys\ntry:\n    {sleep}\nexcept KeyboardInterrupt:\n"
            "    print('ERROR: Operation cancelled by user', file=sys.stderr)\n    sys.exit(1)"
        )
    else:  # dies of the signal, as sh or an uncaught KeyboardInterrupt does
        slow = sleep
    quoted = shlex.quote(slow)
    venv = _stub_venv(
        tmp_path / "a venv",
        {
            "python": f'if [ "$2" = pip ] && [ "$3" = install ]; then '
            f"exec {shlex.quote(sys.executable)} -c {quoted}; fi",
            "ruff": "echo ruff ran",
            "mypy": "echo mypy ran",
            "kvtier": "echo kvtier ran",
        },
    )
    proc = subprocess.Popen(
        ["bash", str(ROOT / "scripts" / script)],
        cwd=tmp_path,
        env=_clean_env(KVTIER_VENV=str(venv)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not started.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "pip never started"
            time.sleep(0.02)
        time.sleep(0.2)  # into the sleep, past the interpreter's start
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("pip", ["as pip", "killed"])
@pytest.mark.parametrize("script", ["demo.sh", "test.sh"])
def test_ctrl_c_while_setting_up_exits_130(script: str, pip: str, tmp_path: Path) -> None:
    done = _interrupt(script, pip, tmp_path)
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert done.stdout == ""  # neither the checks nor the demo ran
    assert done.stderr.splitlines()[-1] == f"{script}: interrupted"
    assert "failed" not in done.stderr


def _repo_copy(tmp_path: Path) -> Path:
    """The scripts in a checkout with a space in its path, and a src/ to protect."""
    repo = tmp_path / "my checkout"
    shutil.copytree(ROOT / "scripts", repo / "scripts")
    (repo / "src" / "kvtier").mkdir(parents=True)
    (repo / "src" / "kvtier" / "__init__.py").write_text("")
    return repo


def _fake_python(tmp_path: Path, version: str | None = None) -> Path:
    """A PYTHON that answers setup.sh's version check (as `version` where given) and stops,
    with status 97, where the script would create an environment."""
    pretend = ""
    if version is not None:
        info = (*map(int, version.split(".")), "final", 0)
        pretend = f"import sys; sys.version_info = {info!r}; sys.version = {version!r}\n"
    python = tmp_path / "fake python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "$1" = -c ]; then exec {shlex.quote(sys.executable)} -c '
        f'{shlex.quote(pretend)}"$2"; fi\n'
        'echo "created a venv: $*" >&2\nexit 97\n'
    )
    python.chmod(0o755)
    return python


def _setup(repo: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(repo / "scripts" / "setup.sh")],
        cwd=cwd,
        env=_clean_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def _error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "created a venv" not in done.stderr
    (line,) = [s for s in done.stderr.splitlines() if s.startswith("setup.sh: error:")]
    return line


@pytest.mark.parametrize("value", [".", "src", "ROOT"])
def test_a_directory_that_is_neither_an_environment_nor_empty_is_refused(
    value: str, tmp_path: Path
) -> None:
    repo = _repo_copy(tmp_path)
    value = str(repo) if value == "ROOT" else value
    before = sorted(p.relative_to(repo) for p in repo.rglob("*"))
    python = _fake_python(tmp_path)
    line = _error(_setup(repo, repo, KVTIER_VENV=value, PYTHON=str(python)))
    assert f"KVTIER_VENV='{value}'" in line
    assert "neither a virtual environment (no pyvenv.cfg) nor empty; expected" in line
    assert sorted(p.relative_to(repo) for p in repo.rglob("*")) == before
    # An empty directory is where an environment may be created.
    (tmp_path / "empty").mkdir()
    done = _setup(repo, repo, KVTIER_VENV=str(tmp_path / "empty"), PYTHON=str(python))
    assert done.returncode == 97 and "created a venv: -m venv" in done.stderr, done.stderr


def test_a_venv_that_is_a_file_is_refused(tmp_path: Path) -> None:
    repo = _repo_copy(tmp_path)
    (repo / ".venv").write_text("not an environment\n")
    line = _error(_setup(repo, tmp_path, PYTHON=str(_fake_python(tmp_path))))
    assert f"{repo}/.venv (the default; KVTIER_VENV names another) is not a directory" in line


def test_a_python_that_is_no_command_is_named(tmp_path: Path) -> None:
    repo = _repo_copy(tmp_path)
    line = _error(_setup(repo, tmp_path, PYTHON="python3.99-not-here"))
    assert "PYTHON='python3.99-not-here' is not a command; expected a Python 3.11" in line
    assert not (repo / ".venv").exists()


def test_a_python_older_than_3_11_creates_no_environment(tmp_path: Path) -> None:
    repo = _repo_copy(tmp_path)
    python = _fake_python(tmp_path, "3.10.12")
    line = _error(_setup(repo, tmp_path, PYTHON=str(python)))
    assert f"PYTHON='{python}' is Python 3.10.12; kvtier needs 3.11 or newer" in line
    assert not (repo / ".venv").exists()


def test_a_relative_python_is_from_where_the_script_runs(tmp_path: Path) -> None:
    """Read from the repository root, `PYTHON=./py` was "No such file or directory" (127)."""
    repo = _repo_copy(tmp_path)
    _fake_python(tmp_path)  # tmp_path / "fake python", which stops where venv would run
    done = _setup(repo, tmp_path, PYTHON="./fake python", KVTIER_VENV="new venv")
    assert done.returncode == 97, (done.returncode, done.stderr)
    assert f"created a venv: -m venv {tmp_path}/new venv" in done.stderr


def _test_sh(cwd: Path, venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "test.sh"), *args],
        cwd=cwd,
        env=_clean_env(KVTIER_VENV=str(venv)),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_test_path_is_read_from_where_test_sh_was_called(tmp_path: Path) -> None:
    """The real pytest, called from tests/ with a path relative to it."""
    real = shlex.quote(sys.executable)
    stubs = {"python": f'if [ "$2" = pytest ]; then exec {real} "$@"; fi', "ruff": "", "mypy": ""}
    venv = _stub_venv(tmp_path / "venv", stubs)
    node = f"{Path(__file__).name}::test_a_test_path_is_read_from_where_test_sh_was_called"
    done = _test_sh(ROOT / "tests", venv, "-p", "no:cacheprovider", "--co", node)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"tests/{node}" in done.stdout.splitlines()


def test_option_values_and_root_paths_pass_as_given(tmp_path: Path) -> None:
    log = tmp_path / "pytest args"
    stubs = {
        "python": f'if [ "$2" = pytest ]; then printf "%s\\n" "$PWD" "${{@:3}}" > "{log}"; fi',
        "ruff": "",
        "mypy": "",
    }
    venv = _stub_venv(tmp_path / "venv", stubs)
    caller = tmp_path / "the caller"
    (caller / "sub dir").mkdir(parents=True)
    (caller / "sub dir" / "test_x.py").write_text("")
    args = ["-x", "sub dir/test_x.py::test_a", "-k", "sub dir", "-m", "sub dir", "tests/none.py"]
    done = _test_sh(caller, venv, *args)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == [
        str(ROOT), "-q", "-x", f"{caller}/sub dir/test_x.py::test_a",
        "-k", "sub dir", "-m", "sub dir", "tests/none.py",
    ]  # fmt: skip
    # From the repository root (CI), as given, even where the name is also a directory there.
    done = _test_sh(ROOT, venv, "tests", "-k", "tests")
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == [str(ROOT), "-q", "tests", "-k", "tests"]


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(
    any(shutil.which(t) is None for t in ("sh", "timeout", "sleep", "dirname")),
    reason="needs sh, timeout, sleep and dirname",
)
def test_ctrl_c_while_ci_installs_the_cross_tools_stops_it(tmp_path: Path) -> None:
    """timeout ran apt-get out of Ctrl-C's reach: .ci/run went on after up to 5 minutes, to run
    the tests. PATH holds only what .ci/run runs, so that the cross compiler is missing."""
    repo = tmp_path / "my checkout"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    (repo / "scripts").mkdir()
    (repo / "scripts" / "test.sh").write_text("echo tests ran\n")
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("bash", "sh", "timeout", "sleep", "dirname"):
        (tools / tool).symlink_to(shutil.which(tool) or tool)
    pid_file = tmp_path / "apt-get pid"
    stubs = {"id": "echo 0", "apt-get": f'echo $$ > "{pid_file}"\nexec sleep 60'}
    for name, body in stubs.items():
        (tools / name).write_text(f"#!/bin/sh\n{body}\n")
        (tools / name).chmod(0o755)
    proc = subprocess.Popen(
        [str(tools / "bash"), str(repo / ".ci" / "run")],
        env={"PATH": str(tools)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    apt = None
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text().strip():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "apt-get never started"
            time.sleep(0.02)
        apt = int(pid_file.read_text())
        time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C reaches
        out, err = proc.communicate(timeout=15)
        assert proc.returncode == 130, (proc.returncode, out, err)
        assert out == ""  # the tests did not run
        assert err.splitlines()[-1] == "ci: interrupted"
        assert _gone(apt, 10), "apt-get was left running"
    finally:
        if apt is not None and not _gone(apt, 0.1):
            os.killpg(os.getpgid(apt), signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
