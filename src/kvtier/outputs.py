"""Output files written whole or not at all: `kvtier simulate`'s and `kvtier demo`'s result
files, and the benchmarks' JSON."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from typing import IO, Any, Literal, overload


@overload
def atomic_write(
    path: str | os.PathLike[str], *, binary: Literal[False] = ..., newline: str | None = ...
) -> contextlib.AbstractContextManager[IO[str]]: ...


@overload
def atomic_write(
    path: str | os.PathLike[str], *, binary: Literal[True], newline: None = ...
) -> contextlib.AbstractContextManager[IO[bytes]]: ...


def atomic_write(
    path: str | os.PathLike[str], *, binary: bool = False, newline: str | None = None
) -> contextlib.AbstractContextManager[IO[Any]]:
    """Open an output file (UTF-8 text, or bytes with `binary`) that `path` names only once
    the block inside has finished without error: an interrupted or failed write (Ctrl-C, a
    full disk, a value that does not serialise) leaves an earlier file of that name as it was
    and no partial one.

    The data goes to a temporary file beside the destination, flushed and fsync'ed, then
    renamed over it; the temporary file is removed on any failure (a process killed outright,
    by SIGKILL or an unhandled SIGTERM, can leave one behind, named `.NAME.*.tmp`). What
    `open(path, "w")` would do is kept otherwise: a symlink stays and its target is replaced;
    a new file gets the umask's mode, a replaced one keeps its mode and owner (and its group,
    where the user may set it); a file open() could not write is refused. Written in place,
    as `open` writes them: anything but a regular file or a new name (a FIFO, a terminal,
    `/dev/null`), a file reached through a descriptor link (`/dev/stdout`, `/proc/self/fd/N`,
    which would be detached from the descriptor), an existing writable file in a directory
    that is not writable (no room for the temporary file), and a writable file of another
    owner that the user may not give away. A file with other hard links is replaced under
    `path` alone. `-` is a file name here, as for `open`: callers that mean stdout handle it.
    """
    return _atomic_write(os.fspath(path), binary, newline)


@contextlib.contextmanager
def _atomic_write(path: str, binary: bool, newline: str | None) -> Iterator[IO[Any]]:
    mode, encoding = ("wb", None) if binary else ("w", "utf-8")
    # As open() checks them, before the file is touched: a bad value failed only once the
    # temporary file was open, and open(fd) had closed its descriptor already.
    if binary and newline is not None:
        raise ValueError("binary mode doesn't take a newline argument")
    if newline not in (None, "", "\n", "\r", "\r\n"):
        raise ValueError(f"illegal newline value: {newline!r}")
    target = _replaceable(path)
    made = _create_beside(path, target) if target is not None else None
    if target is None or made is None:
        with open(path, mode, encoding=encoding, newline=newline) as f:
            yield f
        return
    fd, tmp = made
    try:
        f = open(fd, mode, encoding=encoding, newline=newline)  # noqa: SIM115  # closed below
    except BaseException:
        os.unlink(tmp)
        with contextlib.suppress(OSError):  # open(fd) closes it once it has wrapped it
            os.close(fd)
        raise
    try:
        with f:
            yield f
            f.flush()
            # Else a crash soon after the rename can leave an empty file under the name. Some
            # filesystems (FUSE, network) cannot sync, which open() never asked of them.
            try:
                os.fsync(f.fileno())
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise
        try:
            os.replace(tmp, target)
        except OSError as e:
            raise OSError(e.errno, e.strerror, path) from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _replaceable(path: str) -> str | None:
    """The regular file (existing or new) to replace for `path`, or None to write in place."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None  # a new name, or a dangling symlink whose target open() would create
    except OSError:
        return None  # open() reports it (a symlink loop, a file as a directory, ...)
    if st is not None and not stat.S_ISREG(st.st_mode):
        return None
    if _through_descriptor(path):
        return None
    target = os.path.realpath(path)
    if os.path.islink(target):
        return None  # a link realpath could not resolve (a loop): open() reports it
    return target


def _through_descriptor(path: str) -> bool:
    """Whether `path` or a symlink it goes through lies in /proc or /dev/fd: the file of an
    open descriptor, such as `/dev/stdout` redirected to a file."""
    p = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on links followed
        # A folder on the way may be the link (`fds -> /proc/self/fd`, then `fds/1`).
        p = os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))
        if p.startswith(("/proc/", "/dev/fd/")):
            return True
        try:
            link = os.readlink(p)
        except OSError:  # not a link (or gone): the chain ends here
            return False
        p = os.path.normpath(os.path.join(os.path.dirname(p), link))
    return False


def _create_beside(path: str, target: str) -> tuple[int, str] | None:
    """A new temporary file (descriptor and name) in `target`'s directory, with the mode and
    group `open(path, "w")` would leave `target` with; None where it is written in place."""
    try:
        st: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        st = None
    folder, name = os.path.split(target)
    if st is not None and not os.access(target, os.W_OK):
        # Renaming over a file open() cannot write would succeed where open() refuses it.
        read_only = hasattr(os, "statvfs") and os.statvfs(folder).f_flag & os.ST_RDONLY
        code = errno.EROFS if read_only else errno.EACCES
        raise OSError(code, os.strerror(code), path)  # PermissionError for EACCES
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:
        # Hidden, so `out/*.json` does not match it; a short stem keeps it within NAME_MAX.
        tmp = os.path.join(folder, f".{name[:32]}.{secrets.token_hex(4)}.tmp")
        try:
            # 0o666 less the umask, as open() gives a new file (mkstemp's would be 0o600).
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:
            continue
        except PermissionError:
            if st is not None:
                return None  # a writable file in a folder that is not: as open() would
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path) from None
        except OSError as e:
            raise OSError(e.errno, e.strerror, path) from None
        break
    if st is not None:
        try:
            owned = _take_owner(fd, st)
            if owned:
                os.chmod(tmp, stat.S_IMODE(st.st_mode))  # after chown: it clears set-id bits
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        if not owned:
            # open() keeps the owner; a file the user may not give away (another user's, or
            # one in a sticky folder, where the rename fails) is written in place.
            os.close(fd)
            os.unlink(tmp)
            return None
    return fd, tmp


def _take_owner(fd: int, st: os.stat_result) -> bool:
    """Give the file `fd` the owner and, where the user may set it, the group of `st`; False
    where the owner cannot be kept."""
    if not hasattr(os, "fchown"):
        return True
    own = os.fstat(fd)
    if (own.st_uid, own.st_gid) == (st.st_uid, st.st_gid):
        return True
    try:
        os.fchown(fd, st.st_uid, st.st_gid)  # root, as under sudo, may keep both
    except OSError:
        if own.st_uid != st.st_uid:
            return False
        with contextlib.suppress(OSError):  # allowed for a group of the user's
            os.fchown(fd, -1, st.st_gid)
    return True
