"""Compiled CPU transfer path fixes of the 2026-11-30 third review."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.transfer import native
from kvtier.transfer.native import library

pytestmark = pytest.mark.skipif(library() is None, reason="the compiled library is unavailable")


def test_a_cached_library_others_may_write_is_built_again_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The build cache loaded whatever file had the library's name, and loading runs its code:
    # a library another user swapped in (the file was world-writable) ran its constructor in
    # this process before its missing symbols sent the loader to build again, and the rebuilt
    # file then did not load either (the process already held the foreign one by that name).
    cc = native._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    # Built in another process: this one must not hold the real library by that name.
    build = "from kvtier.transfer import native; assert native._load() is not None"
    subprocess.run([sys.executable, "-c", build], check=True, timeout=300)
    (path,) = (tmp_path / "cache").glob("kvtier-native-*.so")
    marker = tmp_path / "ran"
    source = tmp_path / "foreign.c"
    source.write_text(
        "#include <stdio.h>\n__attribute__((constructor)) static void ran(void) {\n"
        f'    fclose(fopen("{marker}", "w"));\n}}\n'
    )
    subprocess.run([*cc, "-shared", "-fPIC", "-o", str(path), str(source)], check=True)
    path.chmod(0o666)
    lib = native._load()
    assert not marker.exists()
    assert lib is not None and lib.kvtier_copy_indexed is not None
    assert path.stat().st_mode & 0o777 == 0o755
