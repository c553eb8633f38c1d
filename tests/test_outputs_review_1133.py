"""Review of `kvtier.outputs.atomic_write`: argument errors reported before any file is made,
a replaced file's owner kept, and descriptor links reached through a linked folder."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from kvtier.outputs import atomic_write

EARLIER = "an earlier good file\n"
needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="giving a file away needs root"
)


def test_an_illegal_newline_is_refused_before_any_file_is_made(tmp_path: Path) -> None:
    """It failed on the temporary file's descriptor, which open() had closed already: EBADF in
    place of the ValueError, and the temporary file was left behind."""
    out = tmp_path / "out.json"
    out.write_text(EARLIER)
    with pytest.raises(ValueError, match="illegal newline value"), atomic_write(out, newline="x"):
        pass
    assert out.read_text() == EARLIER
    assert os.listdir(tmp_path) == ["out.json"]


def test_a_binary_newline_is_reported_before_a_missing_folder(tmp_path: Path) -> None:
    """As open() reports it, the arguments first: it was FileNotFoundError."""
    missing = tmp_path / "missing" / "p.svg"
    bad = atomic_write(missing, binary=True, newline="")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="binary mode doesn't take a newline argument"), bad:
        pass


@needs_root
def test_a_replaced_file_keeps_its_owner(tmp_path: Path) -> None:
    """Under sudo, a user's earlier result became root's: the user could no longer replace it."""
    out = tmp_path / "out.json"
    out.write_text(EARLIER)
    os.chown(out, 65534, 65534)
    with atomic_write(out) as f:
        f.write("new\n")
    st = out.stat()
    assert (st.st_uid, st.st_gid) == (65534, 65534)
    assert out.read_text() == "new\n"
    assert os.listdir(tmp_path) == ["out.json"]


@needs_root
def test_a_file_that_cannot_be_given_away_is_written_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user may write another user's file but not make one theirs: open() keeps its owner,
    and in a sticky folder (/tmp) the rename failed with EPERM where open() succeeds. (fchown
    is patched to fail as it does for a user who is not root.)"""
    out = tmp_path / "theirs.json"
    out.write_text(EARLIER)
    os.chown(out, 65534, 65534)
    inode = out.stat().st_ino

    def refused(fd: int, uid: int, gid: int) -> None:
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(os, "fchown", refused)
    with atomic_write(out) as f:
        f.write("new\n")
    st = out.stat()
    assert (st.st_ino, st.st_uid) == (inode, 65534)
    assert out.read_text() == "new\n"
    assert os.listdir(tmp_path) == ["theirs.json"]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_a_descriptor_reached_through_a_linked_folder_is_written_in_place(
    tmp_path: Path,
) -> None:
    """`fds -> /proc/self/fd`, then `fds/N`: the file was replaced, and the descriptor's own
    writes went to the detached one."""
    (tmp_path / "fds").symlink_to("/proc/self/fd")
    real = tmp_path / "real.txt"
    fd = os.open(real, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        inode = os.fstat(fd).st_ino
        with atomic_write(tmp_path / "fds" / str(fd)) as f:
            f.write("rows\n")
        os.write(fd, b"after\n")
    finally:
        os.close(fd)
    assert real.stat().st_ino == inode
    assert real.read_text() == "rows\nafter\n"
    assert sorted(os.listdir(tmp_path)) == ["fds", "real.txt"]
