"""The scheduler side runs where torch is not installed (README); the worker side says which
extra it needs. torch is hidden from a child process as where it is missing."""

from __future__ import annotations

import subprocess
import sys

import pytest

_HIDE_TORCH = "import sys\nsys.modules['torch'] = None\n"


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _HIDE_TORCH + code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_scheduler_side_imports_and_runs_without_torch() -> None:
    out = _run(
        "import kvtier.admission, kvtier.config, kvtier.connector, kvtier.hashing, kvtier.sim\n"
        "from kvtier.cpu import CPUOffloadingManager\n"
        "from kvtier.base import ReqContext, make_offload_key\n"
        "m = CPUOffloadingManager(4, 'kvaware')\n"
        "k = make_offload_key(b'x' * 16, 0)\n"
        "assert m.prepare_store([k], ReqContext('a')) is not None\n"
        "print('torch' in sys.modules and sys.modules['torch'] is not None)\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "False\n"


@pytest.mark.parametrize("module", ["kvtier.transfer", "kvtier.transfer.factory"])
def test_the_worker_side_names_the_extra_that_brings_torch(module: str) -> None:
    out = _run(
        f"try:\n    import {module}\n"
        "except ModuleNotFoundError as e:\n    print(e.name)\n    print(e)\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "torch",
        "kvtier.transfer (the worker side) needs torch: pip install 'kvtier[torch]'",
    ]
