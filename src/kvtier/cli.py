"""The `kvtier` command: one argparse subcommand per job.

A subcommand is a `Command` in `COMMANDS`: its name, a one-line help, a function that declares
its arguments and a function that runs it. Adding one (e.g. `kvtier demo`) is one entry.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier import __version__


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
    for i, (title, entries) in enumerate(sections):
        if i:
            print()
        print(f"{title}:")
        for name, description in entries.items():
            print(f"  {name:<{width}}  {description}")
    return 0


COMMANDS: list[Command] = [
    Command(
        "simulate",
        "replay a trace through the CPU-tier manager for policies × capacities",
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
        "policies", "list the registered cache and admission policies", _no_arguments, _policies
    ),
]
"""Every subcommand, in the order `kvtier --help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `kvtier` command, with every subcommand in `COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="kvtier", description="KV-cache offloading for LLM inference: tools."
    )
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvtier` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status: int = args._run(args)
    except BrokenPipeError:
        # The reader of our output went away (`kvtier simulate T --csv - | head`): nothing is
        # wrong with the arguments, and there is no one left to tell. End as rich does when
        # this happens while it prints a table.
        _stop_writing_stdout()
        return 1
    except (ValueError, TypeError, OSError) as e:
        print(f"kvtier {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvtier: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:
        # Imported only now: commands that never replay do not pay for the simulator.
        from kvtier.sim.runner import ReplayError

        if not isinstance(e, ReplayError):
            raise
        # The run failed, not its arguments: 1, not argparse's 2.
        print(f"kvtier {args.command}: error: {e}", file=sys.stderr)
        return 1
    return status
