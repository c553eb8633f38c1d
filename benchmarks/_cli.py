"""Argument checks the benchmark scripts share: a bad value is refused in one line that names
it (argparse's usage and `error:` line, exit status 2), before any long run starts.

Kept free of torch and numpy: the trace and policy scripts import it too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import NoReturn, TypeVar

from kvtier.demo import physical_memory
from kvtier.outputs import atomic_write


def at_least(low: int) -> Callable[[str], int]:
    """An argparse `type`: an integer of at least `low`."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid; expected an integer >= {low}")
        return value

    return convert


positive_int = at_least(1)
"""An argparse `type`: an integer of at least 1."""

SEED_MAX = 2**64 - 1
"""The largest seed `torch.manual_seed` takes (it overflows past it, with a traceback)."""


def seed_int(text: str) -> int:
    """An argparse `type`: a seed from 0 to `SEED_MAX`."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid; expected an integer from 0 to 2**64 - 1"
        )
    return value


def int_list(low: int) -> Callable[[str], list[int]]:
    """An argparse `type`: comma-separated integers, each at least `low`, at least one."""

    def convert(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            values = []
        if not values or min(values) < low:
            raise argparse.ArgumentTypeError(
                f"{text!r} is invalid; expected comma-separated integers >= {low}"
            )
        return values

    return convert


def require_file(parser: argparse.ArgumentParser, what: str, path: Path | str) -> None:
    """Refuse `path` unless it is an existing file (a trace, say)."""
    if not Path(path).is_file():
        parser.error(f"{what} {str(path)!r}: no such file")


def require_writable(
    parser: argparse.ArgumentParser,
    path: Path | str | None,
    option: str = "--json",
    *,
    make_parents: bool = False,
    inputs: Iterable[Path | str] = (),
) -> None:
    """Refuse `path` (where `option` asks results to be written) unless a file can be written
    there, so that a long run does not end in an error. Creates `path`'s folders with
    `make_parents`; leaves an existing file as it is, and no new one behind. `path` must not
    be one of `inputs` (a trace the run reads, which the results would replace)."""
    if path is None:
        return
    p = Path(path)
    for source in inputs:
        with contextlib.suppress(OSError):  # a missing input is refused by its own check
            if p.exists() and os.path.samefile(p, source):  # also through a link
                parser.error(
                    f"{option} {str(path)!r} is the input {str(source)!r}; expected another "
                    "file for the results"
                )
    existed = p.exists()
    try:
        if make_parents:
            p.parent.mkdir(parents=True, exist_ok=True)
        with p.open("a"):
            pass
    except OSError as e:
        parser.error(f"{option} {str(path)!r}: cannot write there ({e.strerror or e})")
    if not existed:
        p.unlink()


def write_results(path: Path | str, text: str) -> None:
    """Write `text` to `path` whole or not at all: Ctrl-C or a full disk while writing leaves
    an earlier file of that name as it was, not truncated (see `kvtier.outputs.atomic_write`)."""
    with atomic_write(path) as f:
        f.write(text)


def require_known(
    parser: argparse.ArgumentParser, option: str, names: Iterable[str], known: Iterable[str]
) -> None:
    """Refuse any of `names` not in `known`."""
    allowed = list(known)
    unknown = [n for n in names if n not in allowed]
    if unknown:
        parser.error(f"{option}: unknown {unknown}; expected some of {allowed}")


_Item = TypeVar("_Item", str, int)


def require_distinct(
    parser: argparse.ArgumentParser, option: str, names: Sequence[_Item], what: str = "name"
) -> None:
    """Refuse a name (or another `what`: a size, a seed) given twice: its rows would print
    twice, with twice the samples."""
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        parser.error(f"{option}: {twice} given twice; expected each {what} once")


def require_memory(parser: argparse.ArgumentParser, need: int, what: str) -> None:
    """Refuse arguments (`what` names them) whose buffers take `need` bytes of host memory,
    more than this machine has: allocating them would fail with a traceback, or swap."""
    ram = physical_memory()
    if ram is not None and need > ram:
        parser.error(
            f"{what}: the buffers need {need / 2**30:,.1f} GiB, more than this machine's "
            f"{ram / 2**30:,.1f} GiB; expected smaller values"
        )


def progress(message: str) -> None:
    """One line on stderr while a long run goes on (stdout keeps the results)."""
    print(message, file=sys.stderr, flush=True)


INTERRUPTED = 130
"""The exit status after Ctrl-C: 128 + SIGINT, as a shell reports it and `kvtier` exits."""


def run_main(main: Callable[[], int | None]) -> NoReturn:
    """Run a script's `main()` and exit with its status. Ctrl-C ends the script with one line
    and status 130 rather than a traceback from wherever the replay or copy loop was."""
    try:
        status = main()
    except KeyboardInterrupt:
        progress("interrupted")
        raise SystemExit(INTERRUPTED) from None
    raise SystemExit(status)


@contextlib.contextmanager
def worker_pool(jobs: int) -> Iterator[ProcessPoolExecutor]:
    """A process pool for a script's replays. Ctrl-C stops it at once: the workers ignore the
    terminal's SIGINT (which reaches them too, and would print a traceback per worker), the
    parent terminates them, says so in one line and exits with status 130."""
    # Imported here: the simulator's pool helpers pull numpy in, which this module does not.
    from kvtier.sim.runner import _stop_workers, _worker_init

    pool = ProcessPoolExecutor(jobs, initializer=_worker_init, initargs=(os.getpid(),))
    try:
        yield pool
    except KeyboardInterrupt:
        _stop_workers(pool)
        progress("interrupted")
        raise SystemExit(INTERRUPTED) from None
    except BaseException:
        _stop_workers(pool)
        raise
    pool.shutdown()
