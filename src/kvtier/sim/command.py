"""`kvtier simulate`: replay a trace through the manager for policies x capacities."""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import json
import math
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from kvtier.cli import STDOUT, OutputError, print_rich, writing_stdout
from kvtier.outputs import atomic_write
from kvtier.policies import get_policy_cls, registered_policies
from kvtier.sim.advise import Advice, advise
from kvtier.sim.readers import FORMATS, read_trace
from kvtier.sim.replay import HIT_ACTIONS, STORE_ON
from kvtier.sim.report import (
    PlotUnavailable,
    advice_table,
    plot_format,
    plot_miss_ratio,
    results_table,
    write_csv,
    write_json,
)
from kvtier.sim.result import RunResult
from kvtier.sim.runner import (
    BOUNDS,
    MODES,
    ReplayOptions,
    Terminated,
    default_jobs,
    map_trace,
    run_grid,
    run_one,
)
from kvtier.sim.shapes import MODEL_PRESETS, ModelShape, parse_capacity, parse_model_shape
from kvtier.sim.trace import Trace

DEFAULT_CAPACITIES = "1%,5%,10%,25%"
ADVISE_SHARE = 0.95


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Declare `kvtier simulate`'s arguments on `p`."""
    p.add_argument("trace", type=Path, help="trace file (Mooncake JSONL or token-id prompts)")
    p.add_argument(
        "--policies",
        default=None,
        help="comma-separated cache policies: registered names, 'opt', or package.module:Class "
        "for a CachePolicy of your own (default: every registered one and opt); the infinite "
        "cache is always added",
    )
    p.add_argument(
        "--capacities",
        default=None,
        help="comma-separated CPU-tier sizes: a share of the trace's unique blocks (5%%), "
        "a block count (20000) or bytes with --model-shape (64GiB); default "
        + DEFAULT_CAPACITIES.replace("%", "%%"),
    )
    p.add_argument("--mode", choices=MODES, default="flat", help="replay mode (default flat)")
    p.add_argument(
        "--device-capacity",
        default=None,
        help="engine mode: device prefix cache size, same units as --capacities (default 1%%)",
    )
    p.add_argument(
        "--store",
        choices=STORE_ON,
        default=None,
        help="engine mode: offer computed blocks as computed (eager, the default) or on device "
        "eviction",
    )
    p.add_argument(
        "--hits",
        choices=HIT_ACTIONS,
        default=None,
        help="record a CPU hit as a use (touch) or a pinned load (load); default: touch in "
        "flat mode (textbook), load in engine mode",
    )
    p.add_argument(
        "--store-threshold",
        type=int,
        default=0,
        help="admit a block on its N-th sighting: 2 admits on the second, 0 always (default "
        "%(default)s)",
    )
    p.add_argument(
        "--max-tracker-size",
        default=None,
        help="bound of the admission tracker: a key count, or Nx for N keys per slot of the "
        "run's capacity (default 64000); only with --store-threshold 2 or more",
    )
    p.add_argument(
        "--model-shape",
        default=None,
        help=f"preset ({', '.join(MODEL_PRESETS)}) or LAYERS,KV_HEADS,HEAD_DIM[,DTYPE]: "
        "adds bytes loaded/stored and allows byte capacities",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="auto",
        help="trace format (default %(default)s: from the first record)",
    )
    p.add_argument(
        "--block-tokens",
        type=int,
        default=None,
        help="tokens per block (default: what a Mooncake-format trace's lengths imply, 512 for "
        "the published Mooncake traces; 16 for token prompts)",
    )
    p.add_argument(
        "--hash",
        default="sha256",
        help="token prompts: block hash algorithm, sha256 or xxh3_128 (needs the xxhash "
        "package; default %(default)s)",
    )
    p.add_argument(
        "--namespace",
        default="",
        help="token prompts: hash namespace, the model id (default: none)",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="write rows as JSON ('-': stdout)")
    p.add_argument("--csv", default=None, metavar="FILE", help="write rows as CSV ('-': stdout)")
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="save a miss-ratio curve, in the format its extension names (.png, .svg, .pdf, ...)",
    )
    p.add_argument(
        "--advise",
        action="store_true",
        help=f"print per policy the smallest capacity reaching {100 * ADVISE_SHARE:.0f}%% of the "
        "infinite cache's block hit ratio (--json and --csv write the answers)",
    )
    p.add_argument("--jobs", type=int, default=None, help="worker processes (default: one per CPU)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def _policies(spec: str | None) -> list[str]:
    known = registered_policies()
    if spec is None:
        return [*known, "opt"]
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise ValueError("--policies is empty; expected a comma-separated list of names")
    for name in names:
        if name in known or name in BOUNDS:
            continue
        if ":" not in name:
            raise ValueError(
                f"policy {name!r} is unknown; expected some of: {', '.join([*known, *BOUNDS])}, "
                "or 'package.module:Class'"
            )
        # Resolved here, before any replay: a bad spec fails once, not in every worker, and
        # forked workers find its module already imported. Rows name it as given.
        get_policy_cls(name)
    return list(dict.fromkeys(n for n in names if n != "infinite"))


def _capacity(
    flag: str,
    text: str,
    *,
    unique_blocks: int,
    block_bytes: int | None,
    allow_zero: bool = False,
) -> int:
    """`parse_capacity(text)`'s block count; an error names `flag`, as both flags take the
    same forms and a message naming only the value left the reader to guess which."""
    try:
        return parse_capacity(
            text, unique_blocks=unique_blocks, block_bytes=block_bytes, allow_zero=allow_zero
        )[0]
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def _tracker_size(spec: str) -> tuple[int, float | None]:
    """`"64000"` -> (64000, None); `"5x"` -> (64000, 5.0)."""
    try:
        if spec.endswith("x"):
            per_slot = float(spec[:-1])
            if 0 < per_slot < math.inf:
                return 64_000, per_slot
        elif int(spec) >= 1:
            return int(spec), None
    except ValueError:
        pass
    raise ValueError(
        f"--max-tracker-size={spec!r} is invalid; expected a positive key count or Nx "
        "(N keys per slot)"
    )


class _Bar:
    """A progress bar on stderr, redrawn by a thread of its own that `paused` stops.

    rich's own redraw thread cannot be stopped without taking the bar down; it holds rich's
    and stderr's locks while it draws, and a worker forked meanwhile inherits them held, so
    its first print or warning waits for ever (and the run with it).
    """

    _INTERVAL = 0.1  # seconds between redraws, rich's default rate

    def __init__(self, bar: Progress, task: TaskID) -> None:
        self._bar = bar
        self._task = task
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def advance(self, n: int) -> None:
        """Count `n` more units done."""
        self._bar.advance(self._task, n)

    def start(self) -> None:
        """Redraw every `_INTERVAL` seconds, so the elapsed time moves between advances."""
        if self._thread is not None:
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._redraw, args=(self._stop,), name="kvtier-progress", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop redrawing; on return the thread has ended, so it holds no lock."""
        if self._thread is None:
            return
        self._stop.set()
        thread, self._thread = self._thread, None
        thread.join()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No redraw within: for `map_trace` to fork its workers."""
        self.stop()
        try:
            yield
        finally:
            self.start()

    def _redraw(self, stop: threading.Event) -> None:
        while not stop.wait(self._INTERVAL):
            self._bar.refresh()


@contextlib.contextmanager
def _progress(total: int, enabled: bool, unit: str = "requests") -> Iterator[_Bar | None]:
    if not enabled:
        yield None
        return
    columns = (
        TextColumn("replaying"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit),
        TimeElapsedColumn(),
    )
    with Progress(
        *columns, console=Console(stderr=True), transient=True, auto_refresh=False
    ) as progress:
        bar = _Bar(progress, progress.add_task("replay", total=total))
        bar.start()
        try:
            yield bar
        finally:
            bar.stop()


@contextlib.contextmanager
def _open_out(flag: str, name: str) -> Iterator[IO[str]]:
    """The output `flag` names, open for writing; a failure names it (`OutputError`)."""
    if name == "-":
        with writing_stdout():
            yield sys.stdout
            sys.stdout.flush()  # fail here, where the output is known, not at exit
        return
    try:
        # Whole or not at all: an interrupted run or a full disk left a truncated file in
        # place of an earlier good one.
        with atomic_write(name, newline="") as f:
            yield f
    except OSError as e:
        raise OutputError(f"{flag} file {name!r}", e) from e


def _check_output(flag: str, name: str | None) -> None:
    """Refuse an output path that cannot be written, before any replay."""
    if name is None or (name == "-" and flag != "--plot"):
        return
    try:
        _check_output_path(flag, name)
    except OSError as e:
        # A name too long to look up (ENAMETOOLONG) was reported as a bare errno line that
        # named neither the flag nor what was expected.
        raise ValueError(
            f"{flag}={name!r} is invalid; {e.strerror or e}, expected a file path that can be "
            "written"
        ) from None


def _check_output_path(flag: str, name: str) -> None:
    path = Path(name)
    if path.is_dir():
        raise ValueError(f"{flag}={name!r} is invalid; it is a directory, expected a file path")
    # Path() drops a trailing separator, which open() refuses only after every replay.
    if name.endswith(tuple(sep for sep in (os.sep, os.altsep) if sep)):
        raise ValueError(
            f"{flag}={name!r} is invalid; it ends in a path separator, expected a file path"
        )
    link = ""
    if path.is_symlink() and not path.exists():
        # open() follows a dangling link and creates its target, in the target's directory.
        target = os.path.realpath(name)
        if os.path.islink(target):
            raise ValueError(f"{flag}={name!r} is invalid; it is a symlink loop")
        path, link = Path(target), f"it links to {target!r}, and "
    parent = path.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise ValueError(f"{flag}={name!r} is invalid; {link}{str(parent)!r} {what}")
    # Creating a file needs a directory that can be written; replacing one, only the file:
    # `--csv /dev/null` was refused for every user but root, as /dev is root's.
    exists = path.exists()
    if not os.access(path if exists else parent, os.W_OK if exists else os.W_OK | os.X_OK):
        raise ValueError(f"{flag}={name!r} is invalid; it is not writable")
    if flag == "--plot":
        try:
            plot_format(name)
        except PlotUnavailable as e:
            raise ValueError(str(e)) from None


def _stdout_as_dash(name: str | None) -> str | None:
    """`"-"` for a path that is the file stdout writes to, else `name`."""
    if name is None or name == "-" or os.path.realpath(name) == os.devnull:
        return name  # /dev/null discards, whatever else also writes there
    try:
        out, st = os.fstat(sys.stdout.fileno()), os.stat(name)
    except (OSError, ValueError, AttributeError):  # no such file, or stdout has no descriptor
        return name
    return "-" if (st.st_dev, st.st_ino) == (out.st_dev, out.st_ino) else name


def _check_distinct_outputs(outputs: tuple[tuple[str, str | None], ...]) -> None:
    """Refuse two outputs to one place: JSON then CSV on stdout is neither, and a file
    written twice keeps only the second."""
    seen: dict[object, tuple[str, str]] = {}
    for flag, name in outputs:
        if name is None:
            continue
        place = name if name == "-" else _file_place(name)
        if place in seen:
            first_flag, first_name = seen[place]
            where = "stdout ('-')" if name == "-" else repr(name)
            if first_name != name and name != "-":
                where += f" (the same file as {first_name!r})"
            raise ValueError(
                f"{first_flag} and {flag} both write to {where}; expected a place of its own "
                "for each"
            )
        seen[place] = (flag, name)


def _file_place(name: str) -> object:
    """The file `name` writes to: an existing file by its identity, so that two hard links to
    it are one place (the second output replaced the first), else by its resolved path."""
    try:
        st = os.stat(name)
    except OSError:
        return os.path.realpath(name)
    return (st.st_dev, st.st_ino)


def _check_not_the_trace(trace: Path, outputs: tuple[tuple[str, str | None], ...]) -> None:
    """Refuse an output that would overwrite the trace: it is read first, then replaced by
    the results, and the user's trace is gone."""
    for flag, name in outputs:
        if name is None or name == "-" or not Path(name).exists():
            continue
        with contextlib.suppress(OSError):  # a trace that cannot be read is reported later
            if os.path.samefile(name, trace):  # also through a symlink or hard link
                raise ValueError(
                    f"{flag}={name!r} is the trace being read; expected another file for the "
                    "results"
                )


def _table_width() -> int | None:
    # Piped output keeps whole rows (rich would wrap them at 80 columns).
    return None if sys.stdout.isatty() else 200


def _print_table(table: Table) -> None:
    # A table wider than the console (its cells are never cut) is written whole.
    print_rich(table, width=_table_width(), crop=False)


def run(args: argparse.Namespace) -> int:
    """Run `kvtier simulate` with parsed `args`; returns the exit status."""
    try:
        return _run(args)
    except Terminated:
        # Only a multi-process run turns SIGTERM into `Terminated` (to stop its workers first);
        # exit as the shell reports a process that SIGTERM ended.
        print("kvtier: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM


def _run(args: argparse.Namespace) -> int:
    policies = _policies(args.policies)
    shape: ModelShape | None = (
        parse_model_shape(args.model_shape) if args.model_shape is not None else None
    )
    if args.mode != "engine":
        # Silently ignoring them would report a flat replay as if it had a device in front.
        given = [
            flag
            for flag, value in (
                ("--device-capacity", args.device_capacity),
                ("--store", args.store),
            )
            if value is not None
        ]
        if given:
            verb = "apply" if len(given) > 1 else "applies"
            raise ValueError(f"{' and '.join(given)} {verb} only to --mode engine")
    if args.advise:
        # --advise searches the capacity itself and draws no curve: ignoring these would
        # leave the user waiting for a file or a grid that never comes.
        given = [
            flag
            for flag, value in (("--capacities", args.capacities), ("--plot", args.plot))
            if value is not None
        ]
        if given:
            verb = "apply" if len(given) > 1 else "applies"
            raise ValueError(
                f"{' and '.join(given)} {verb} only without --advise (it searches the capacity "
                "itself; --json and --csv write its answers)"
            )
        if not policies:
            # The infinite cache is the target, not a policy to size.
            raise ValueError(
                f"--advise needs a policy to size; --policies={args.policies!r} names only the "
                "infinite cache"
            )
        if policies == ["opt"] and args.mode == "engine" and args.store == "on-evict":
            # opt is skipped below; the search would answer an empty table and exit 0.
            raise ValueError(
                f"--advise needs a policy to size; --policies={args.policies!r} names only opt, "
                "which --store on-evict skips (it is exact only with eager stores); expected a "
                "cache policy too, or --store eager"
            )
    store_on = args.store or "eager"
    if args.store_threshold < 0:
        raise ValueError(f"--store-threshold={args.store_threshold} is invalid; expected >= 0")
    jobs = args.jobs if args.jobs is not None else default_jobs()
    if jobs < 1:
        raise ValueError(f"--jobs={jobs} is invalid; expected >= 1")
    tracker, per_slot = _tracker_size(args.max_tracker_size or "64000")
    if args.max_tracker_size is not None and args.store_threshold < 2:
        # Else it was read and ignored: the row shows no tracker, the reader a bound applied.
        raise ValueError(
            f"--max-tracker-size={args.max_tracker_size!r} has no effect with --store-threshold="
            f"{args.store_threshold}; expected --store-threshold 2 or more (reuse admission)"
        )
    # `--json /dev/stdout` (or the file stdout is redirected to) is stdout: written as `-`, so
    # the table stays off it and `--csv -` beside it is refused, rather than mixed in.
    args.json, args.csv = (_stdout_as_dash(name) for name in (args.json, args.csv))
    outputs = (("--json", args.json), ("--csv", args.csv), ("--plot", args.plot))
    for flag, name in outputs:
        _check_output(flag, name)
    _check_distinct_outputs(outputs)
    _check_not_the_trace(args.trace, outputs)
    try:
        trace = read_trace(
            args.trace,
            fmt=args.format,
            block_tokens=args.block_tokens,
            algorithm=args.hash,
            namespace=args.namespace,
        )
    except ImportError as e:
        # `--hash xxh3_128` without the optional xxhash package: one error line, not a
        # traceback (the message says what to install).
        raise ValueError(str(e)) from None
    if trace.num_blocks == 0:
        raise ValueError(f"trace {str(args.trace)!r} has no blocks to replay")
    unique = trace.num_unique_blocks
    block_bytes = shape.block_bytes(trace.block_tokens) if shape is not None else None
    capacities: list[int] = []
    if not args.advise:
        capacities = [
            _capacity("--capacities", c.strip(), unique_blocks=unique, block_bytes=block_bytes)
            # `is None`, not `or`: an empty `--capacities ''` is an error, not the defaults.
            for c in (DEFAULT_CAPACITIES if args.capacities is None else args.capacities).split(",")
            if c.strip()
        ]
        if not capacities:
            raise ValueError("--capacities is empty; expected e.g. 1%,5%,10%,25%")
        # 5% and the block count it comes to are one capacity: one row, one replay.
        capacities = list(dict.fromkeys(capacities))
    device_blocks = 0
    if args.mode == "engine":
        # An empty device is valid: engine mode then equals flat mode.
        device_blocks = _capacity(
            "--device-capacity",
            "1%" if args.device_capacity is None else args.device_capacity,
            unique_blocks=unique,
            block_bytes=block_bytes,
            allow_zero=True,
        )
    opts = ReplayOptions(
        mode=args.mode,
        store_threshold=args.store_threshold,
        max_tracker_size=tracker,
        tracker_per_slot=per_slot,
        device_blocks=device_blocks,
        store_on=store_on,
        hits_as=args.hits,
    )
    if "opt" in policies and args.mode == "engine" and store_on != "eager":
        print(
            "kvtier: note: opt skipped; it is exact only when every miss may be stored at once "
            "(flat mode or --store eager)",
            file=sys.stderr,
        )
        policies.remove("opt")
    show_progress = not args.quiet and sys.stderr.isatty()
    title = (
        f"{trace.name}: {len(trace):,} requests, {trace.num_blocks:,} blocks of "
        f"{trace.block_tokens} tokens, {unique:,} unique"
    )
    title += f", mode {args.mode}"
    if args.mode == "engine":
        title += f" (device {device_blocks:,} blocks, store {store_on})"
    if args.store_threshold:
        title += f", store threshold {args.store_threshold}"
    if args.advise:
        return _run_advise(trace, policies, opts, jobs, args, show_progress, block_bytes)

    runs = [(p, c) for p in policies for c in capacities] + [("infinite", unique)]
    with _progress(len(trace) * len(runs), show_progress) as bar:
        results = run_grid(
            trace,
            runs,
            opts,
            jobs=jobs,
            progress=bar.advance if bar is not None else None,
            forking=bar.paused if bar is not None else None,
        )
    _emit(results, shape, args, title, plot_title=f"{trace.name} ({args.mode})")
    return 0


def _emit(
    results: list[RunResult],
    shape: ModelShape | None,
    args: argparse.Namespace,
    title: str,
    plot_title: str,
) -> None:
    # The table first, so a file that fails to write does not cost the results.
    failed: list[OutputError] = []
    if args.json != "-" and args.csv != "-":
        with _stdout_later(failed):
            _print_table(results_table(results, shape, title=title))
    if args.json is not None:
        with _stdout_later(failed), _open_out("--json", args.json) as f:
            write_json(results, f, shape)
    if args.csv is not None:
        with _stdout_later(failed), _open_out("--csv", args.csv) as f:
            write_csv(results, f, shape)
    if args.plot is not None:
        try:
            plot_miss_ratio(results, args.plot, title=plot_title)
        except PlotUnavailable as e:
            raise ValueError(str(e)) from None
        except OSError as e:
            raise OutputError(f"--plot file {args.plot!r}", e) from e
    if failed:
        raise failed[0]


@contextlib.contextmanager
def _stdout_later(failed: list[OutputError]) -> Iterator[None]:
    """Hold a failure to write stdout (`| head`, a full disk) in `failed` until the files are
    written: they hold the results of every replay."""
    try:
        yield
    except OutputError as e:
        if e.where != STDOUT:
            raise
        failed.append(e)


def _run_advise(
    trace: Trace,
    policies: list[str],
    opts: ReplayOptions,
    jobs: int,
    args: argparse.Namespace,
    show_progress: bool,
    block_bytes: int | None,
) -> int:
    infinite = run_one(trace, "infinite", trace.num_unique_blocks, opts).block_hit_ratio
    target = ADVISE_SHARE * infinite
    resolution = max(1, round(trace.num_unique_blocks * 0.005))
    arg_lists = [(p, target, opts, resolution) for p in policies]
    with _progress(len(policies), show_progress, "policies") as bar:
        on_done = (lambda: bar.advance(1)) if bar is not None else None
        answers: list[Advice] | None = map_trace(
            trace,
            advise,
            arg_lists,
            jobs=jobs,
            on_done=on_done,
            forking=bar.paused if bar is not None else None,
        )
        if answers is None:
            answers = []
            for a in arg_lists:
                answers.append(advise(trace, *a))
                if bar is not None:
                    bar.advance(1)
    failed: list[OutputError] = []
    if args.json != "-" and args.csv != "-":
        with _stdout_later(failed):
            _print_table(advice_table(answers, trace.num_unique_blocks, infinite, block_bytes))
    advice_rows = [dataclasses.asdict(a) for a in answers]
    if block_bytes is not None:
        # The question --advise answers is how much host memory to give the tier.
        for row in advice_rows:
            blocks = row["capacity_blocks"]
            row["capacity_bytes"] = None if blocks is None else blocks * block_bytes
    if args.json is not None:
        with _stdout_later(failed), _open_out("--json", args.json) as f:
            json.dump(advice_rows, f, indent=2)
            f.write("\n")
    if args.csv is not None and advice_rows:
        with _stdout_later(failed), _open_out("--csv", args.csv) as f:
            writer = csv.DictWriter(f, fieldnames=list(advice_rows[0]), lineterminator="\n")
            writer.writeheader()
            writer.writerows(advice_rows)
    if failed:
        raise failed[0]
    return 0
