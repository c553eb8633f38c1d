"""The `kvtier` command: one argparse subcommand per job.

A subcommand is a `Command` in `COMMANDS`: its name, a one-line help, a function that declares
its arguments and a function that runs it. Adding one (e.g. `kvtier demo`) is one entry.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier import __version__

if TYPE_CHECKING:
    from _typeshed import SupportsWrite


@dataclass(frozen=True, slots=True)
class Command:
    """A `kvtier` subcommand."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _simulate_arguments(p: argparse.ArgumentParser) -> None:
    from kvtier.sim.command import add_arguments

    add_arguments(p)


def _simulate(args: argparse.Namespace) -> int:
    from kvtier.sim.command import run

    return run(args)


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    from kvtier.demo import add_arguments

    add_arguments(p)


def _demo(args: argparse.Namespace) -> int:
    from kvtier.demo import run

    return run(args)


def _no_arguments(p: argparse.ArgumentParser) -> None:
    pass


class OutputError(OSError):
    """Writing an output failed; the message names it, as the OS error alone does not
    (`[Errno 28] No space left on device` from `--csv /dev/full`)."""

    def __init__(self, where: str, error: OSError) -> None:
        super().__init__(error.errno, error.strerror)
        self.where = where
        """`STDOUT`, or the flag and path that failed."""
        self.error = error

    def __str__(self) -> str:
        return f"cannot write to {self.where}: {self.error}"


STDOUT = "standard output"


# The exit status when the reader of stdout goes away (`| head`): 128 + SIGPIPE, what a shell
# reports for a command that SIGPIPE ended (`yes | head`), as 130 (128 + SIGINT) is what an
# interrupted command exits with. Not 1, which `kvtier demo` uses for "tokens differ".
BROKEN_PIPE = 141

# Ctrl-C: 128 + SIGINT, what a shell reports for a command that SIGINT ended.
INTERRUPTED = 130

# An uncaught exception: sysexits.h's EX_SOFTWARE, apart from every status a command gives
# as its answer.
INTERNAL_ERROR = 70


@contextlib.contextmanager
def writing_stdout() -> Iterator[None]:
    """Turn an `OSError` raised inside into an `OutputError` naming standard output."""
    try:
        yield
    except OutputError:
        raise
    except OSError as e:
        raise OutputError(STDOUT, e) from e


def print_rich(*renderables: object, width: int | None = None, crop: bool = True) -> None:
    """Print rich `renderables` to stdout (`width` columns, or the terminal's; `crop=False`
    writes lines wider than that whole); a failure is an `OutputError` naming standard output.

    Rendered into a buffer and written here: rich, writing stdout itself, ends the process on
    a broken pipe (SystemExit(1)) and reports a full disk without naming stdout.
    """
    from rich.console import Console

    real = Console() if width is None else Console(width=width)
    # The buffer has stdout's encoding, so rich still draws ASCII boxes for an ASCII stdout.
    raw = io.BytesIO()
    buffer = io.TextIOWrapper(raw, encoding=real.encoding, errors="replace", newline="")
    console = Console(
        file=buffer,
        width=real.width,
        force_terminal=real.is_terminal,
        color_system=real.color_system,  # type: ignore[arg-type]  # a name it accepts
    )
    for renderable in renderables:
        console.print(renderable, crop=crop)
    buffer.flush()
    with writing_stdout():
        sys.stdout.write(raw.getvalue().decode(real.encoding))
        sys.stdout.flush()


def _policies(args: argparse.Namespace) -> int:
    from kvtier.admission import registered_admission_policies
    from kvtier.policies import registered_policies
    from kvtier.sim.runner import BOUNDS

    sections: list[tuple[str, dict[str, str]]] = [
        ("cache policies", {n: c.description for n, c in registered_policies().items()}),
        (
            "admission policies",
            {n: c.description for n, c in registered_admission_policies().items()},
        ),
        ("simulator bounds (kvtier simulate --policies)", dict(BOUNDS)),
    ]
    width = max(len(n) for _, entries in sections for n in entries)
    with writing_stdout():
        for i, (title, entries) in enumerate(sections):
            if i:
                print()
            print(f"{title}:")
            for name, description in entries.items():
                print(f"  {name:<{width}}  {description}")
        sys.stdout.flush()
    return 0


COMMANDS: list[Command] = [
    Command(
        "simulate",
        "replay a trace through the CPU-tier manager for policies x capacities",
        _simulate_arguments,
        _simulate,
    ),
    Command(
        "demo",
        "multi-turn chat on a small model, with kvtier vs recomputation: hits, TTFT, same tokens",
        _demo_arguments,
        _demo,
    ),
    Command(
        "policies",
        "list the registered cache and admission policies, and the simulator's bounds",
        _no_arguments,
        _policies,
    ),
]
"""Every subcommand, in the order `kvtier --help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `kvtier` command, with every subcommand in `COMMANDS`."""
    parser = _Parser(prog="kvtier", description="KV-cache offloading for LLM inference: tools.")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def _stop_writing_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit does not fail once more."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a file (a test's capture): nothing is flushed to a pipe at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


class _ClosedStdout(io.TextIOBase):
    """Stands in for `sys.stdout` when Python started with file descriptor 1 closed: Python
    then sets `sys.stdout = None`, and `print()` drops every line without a word (`kvtier
    policies >&-` printed nothing and exited 0). Writing here raises instead."""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        raise OSError(errno.EBADF, "standard output is closed; expected somewhere to write")


class _Parser(argparse.ArgumentParser):
    """An `ArgumentParser` whose --help and --version output fails loudly."""

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        # argparse ignores OSError while writing, so `kvtier --help >/dev/full` exited 0 with
        # no help written. Errors go to stderr as before; stdout failures reach main().
        if message and file is sys.stdout and file is not None:
            file.write(message)
        else:
            super()._print_message(message, file)


def _flush_stdout(command: str) -> int:
    """Flush stdout now, while a failure can still be reported: 0, or the exit status after
    saying why (at exit Python would print a traceback, or nothing)."""
    try:
        sys.stdout.flush()
    except OSError as e:
        return _write_failed(command, e)
    return 0


def _write_failed(command: str, e: OSError) -> int:
    _stop_writing_stdout()
    if isinstance(e, BrokenPipeError):
        # The reader of our output went away (`kvtier simulate T --csv - | head`): nothing is
        # wrong with the arguments, and there is no one left to tell.
        return BROKEN_PIPE
    print(f"{command}: error: cannot write to standard output: {e}", file=sys.stderr)
    return 2


def _interrupted() -> int:
    print("kvtier: interrupted", file=sys.stderr)
    return INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvtier` console script; returns the exit status."""
    if sys.stdout is None:
        sys.stdout = _ClosedStdout()
    # Building the parser imports every command's module: a Ctrl-C in those first moments
    # (seconds on a loaded machine) printed a traceback instead of `kvtier: interrupted`.
    try:
        parser = build_parser()
    except KeyboardInterrupt:
        return _interrupted()
    try:
        args = parser.parse_args(argv)
    except OSError as e:  # writing --help or --version
        return _write_failed("kvtier", e)
    except SystemExit as e:
        # --help and --version exit 0 with their output maybe still in stdout's buffer.
        failed = _flush_stdout("kvtier") if e.code == 0 else 0
        if failed:
            return failed
        raise
    except KeyboardInterrupt:
        return _interrupted()
    try:
        status: int = args._run(args)
        failed = _flush_stdout(f"kvtier {args.command}")
        if failed:
            return failed
    except OutputError as e:
        if e.where == STDOUT:
            return _write_failed(f"kvtier {args.command}", e.error)
        print(f"kvtier {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError as e:
        return _write_failed(f"kvtier {args.command}", e)
    except (ValueError, TypeError, OSError) as e:
        print(f"kvtier {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _interrupted()
    except Exception as e:
        # Imported only now: commands that never replay do not pay for the simulator.
        from kvtier.sim.runner import ReplayError

        if isinstance(e, ReplayError):
            # The run failed, not its arguments: 1, not argparse's 2.
            print(f"kvtier {args.command}: error: {e}", file=sys.stderr)
            return 1
        # A bug, not a verdict: Python's own status for an uncaught exception is 1, which
        # `kvtier demo` uses for "tokens differ" and `kvtier simulate` for a failed replay.
        traceback.print_exc()
        print(
            f"kvtier {args.command}: internal error (exit {INTERNAL_ERROR}): "
            f"{type(e).__name__}; please report it with the traceback above",
            file=sys.stderr,
        )
        return INTERNAL_ERROR
    return status
