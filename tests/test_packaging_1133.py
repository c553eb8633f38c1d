"""The built wheel is the package users install: it must hold every file the package reads at
run time (the C sources that `kvtier.transfer.native` compiles among them), and work from
where pip puts it, not only from this checkout's `src`."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_PIP = (sys.executable, "-m", "pip")
# Offline, and nothing but kvtier itself: its dependencies are this environment's.
_OFFLINE = ("-q", "--no-deps", "--no-index")


def _tracked(under: str) -> set[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z", under], cwd=ROOT, capture_output=True, check=True
    ).stdout
    return {p for p in out.decode().split("\0") if p}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to know which files are the package's")
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("setuptools is not installed (torch brings it in scripts/setup.sh)")
    if int(version.split(".")[0]) < 77:
        pytest.skip(f"setuptools {version} is older than pyproject's build requirement (77)")
    # A copy of the tracked files: an in-tree build would leave build/ in the checkout.
    src = tmp_path_factory.mktemp("src")
    for rel in _tracked("src") | {"pyproject.toml", "README.md"}:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [*_PIP, "wheel", *_OFFLINE, "--no-build-isolation", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (found,) = out.glob("kvtier-*.whl")
    return found


def test_the_wheel_holds_exactly_the_tracked_package_files(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        shipped = {n for n in z.namelist() if n.startswith("kvtier/")}
    expected = {p.removeprefix("src/") for p in _tracked("src/kvtier")}
    assert expected - shipped == set(), "tracked package files missing from the wheel"
    assert shipped - expected == set(), "files in the wheel that git does not track"


def test_the_installed_wheel_compiles_its_library_and_runs_the_cli(
    wheel: Path, tmp_path: Path
) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [*_PIP, "install", *_OFFLINE, "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(target),
        "KVTIER_CACHE_DIR": str(tmp_path / "cache"),
        "KVTIER_NATIVE_COPY": "1",
    }
    code = (
        "import kvtier, kvtier.transfer.native as n\n"
        "print(kvtier.__file__)\n"
        "print(n._compiler() is not None, n.library() is not None)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    where, built = out.stdout.splitlines()
    assert Path(where).is_relative_to(target), where  # not this checkout's src
    have_cc, have_lib = built.split()
    if have_cc == "True":
        assert have_lib == "True", "the installed package could not build its C library"
    cli = subprocess.run(
        [sys.executable, "-m", "kvtier", "policies"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 0, cli.stderr
    assert "kvaware" in cli.stdout and "lru" in cli.stdout


def test_every_extra_installs_something_the_package_imports() -> None:
    """An extra is a promise of a feature: `kvtier[redis]` installed redis for a remote tier
    that does not exist."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    imported = set()
    for path in (ROOT / "src" / "kvtier").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module.split(".")[0])
    unused = {}
    for extra, requirements in extras.items():
        if extra == "dev":  # the checks' tools, not the package's
            continue
        names = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].replace("-", "_") for r in requirements}
        if not names & imported:
            unused[extra] = sorted(names)
    assert unused == {}
