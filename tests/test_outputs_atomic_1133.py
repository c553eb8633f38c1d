"""Output files are written whole or not at all: `kvtier simulate --json/--csv/--plot`,
`kvtier demo --json`, the benchmark scripts' `--json` and `split_blocks.py`'s trace. A write
that fails midway (a full disk, Ctrl-C, a value that does not serialise) left a truncated file
in place of an earlier good one. Also `kvtier.outputs.atomic_write`'s handling of the paths a
plain `open(path, "w")` supports: symlinks, FIFOs, `/dev/stdout`, file modes."""

from __future__ import annotations

import importlib
import json
import os
import resource
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvtier
from kvtier.cli import main

SRC = Path(kvtier.__file__).resolve().parents[1]
BENCHMARKS = SRC.parent / "benchmarks"
EARLIER = '"an earlier good file"\n'
LIMIT = 300  # bytes a child may write to one file: less than any output below


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    rows = [{"input_length": 1536, "hash_ids": [1, 2, 3 + t % 50]} for t in range(200)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def bench_modules() -> Iterator[None]:
    sys.path.insert(0, str(BENCHMARKS))
    yield
    sys.path.remove(str(BENCHMARKS))


def _earlier(path: Path) -> Path:
    path.write_text(EARLIER)
    return path


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def _limited() -> None:
    # Writes past LIMIT bytes fail with EFBIG, as on a full disk (Python ignores SIGXFSZ).
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


def _run_limited(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [sys.executable, *args],
        env=env,
        preexec_fn=_limited,
        capture_output=True,
        text=True,
        timeout=300,
    )


# -- kvtier simulate -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "name"), [("--json", "r.json"), ("--csv", "r.csv"), ("--plot", "r.svg")]
)
def test_simulate_keeps_the_earlier_file_when_the_disk_fills(
    trace: Path, tmp_path: Path, flag: str, name: str
) -> None:
    if flag == "--plot":
        pytest.importorskip("matplotlib")
    out = _earlier(tmp_path / name)
    argv = ["-m", "kvtier", "simulate", str(trace), "-q", "--jobs", "1", "--policies", "lru"]
    done = _run_limited([*argv, flag, str(out)])
    assert done.returncode == 2
    assert done.stderr.endswith(
        f"kvtier simulate: error: cannot write to {flag} file {str(out)!r}: [Errno 27] File "
        "too large\n"
    )
    assert out.read_text() == EARLIER  # was the first 300 bytes of the new one
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("flag", ["--json", "--csv"])
def test_simulate_interrupted_while_writing_keeps_the_earlier_file(
    trace: Path,
    tmp_path: Path,
    flag: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvtier.sim import command

    def interrupted(results: object, out: object, shape: object) -> None:
        out.write("[\n  {")  # type: ignore[attr-defined]
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "write_json" if flag == "--json" else "write_csv", interrupted)
    out = _earlier(tmp_path / "r.out")
    argv = ["simulate", str(trace), "-q", "--jobs", "1", "--policies", "lru", flag, str(out)]
    assert main(argv) == 130
    assert capsys.readouterr().err.endswith("kvtier: interrupted\n")
    assert out.read_text() == EARLIER
    assert _leftovers(tmp_path) == []


def test_simulate_through_a_symlink_keeps_the_link_the_modes_and_a_file_on_failure(
    trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupted write leaves the link's target as it was; a finished one replaces the
    target, the link stays a link, the file keeps the mode it had, and a new file gets the
    umask's, as `open(path, "w")` gives them (mkstemp's would be 0600)."""
    from kvtier.sim import command

    target = _earlier(tmp_path / "kept.json")
    target.chmod(0o604)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    fresh = tmp_path / "fresh.csv"
    argv = ["simulate", str(trace), "-q", "--jobs", "1", "--policies", "lru"]

    def interrupted(results: object, out: object, shape: object) -> None:
        out.write("[")  # type: ignore[attr-defined]
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(command, "write_json", interrupted)
        assert main([*argv, "--json", str(link)]) == 130
    assert target.read_text() == EARLIER
    old_mask = os.umask(0o027)
    try:
        assert main([*argv, "--json", str(link), "--csv", str(fresh)]) == 0
    finally:
        os.umask(old_mask)
    assert link.is_symlink() and link.resolve() == target
    assert json.loads(target.read_text())[0]["policy"] == "lru"
    assert stat.S_IMODE(target.stat().st_mode) == 0o604
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o640
    assert _leftovers(tmp_path) == []


# -- kvtier demo ---------------------------------------------------------------------------------

_DEMO_DRIVER = """
import sys
import kvtier.demo as demo
from kvtier.cli import main

result = demo.DemoResult(
    model="m", requests=1, prompt_tokens=8, identical_outputs=True, max_logit_diff=0.0,
    differing_requests=0, first_divergence=None, prefix_hit_ratio=0.5,
    prefill_tokens={"kvtier": 4, "recompute": 8}, prefill_tokens_saved=4,
    ttft_median_s={"kvtier": 0.1}, ttft_p90_s={"kvtier": 0.1}, bytes_loaded=0,
    bytes_stored=0, failed_loads=0, wall_s=0.0, options={"pad": "x" * 1000},
)
demo.run_demo = lambda opts, tick=None: result
sys.exit(main(["demo", "--quiet", "--json", sys.argv[1]]))
"""


def test_demo_keeps_the_earlier_json_when_the_disk_fills(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = _earlier(tmp_path / "demo.json")
    done = _run_limited(["-c", _DEMO_DRIVER, str(out)])
    assert done.returncode == 2, done.stderr
    assert done.stderr.endswith(
        f"kvtier demo: error: cannot write to --json file {str(out)!r}: [Errno 27] File too large\n"
    )
    assert out.read_text() == EARLIER
    assert _leftovers(tmp_path) == []


# -- benchmark scripts ---------------------------------------------------------------------------


def test_a_benchmark_keeps_the_earlier_json_when_the_disk_fills(
    trace: Path, tmp_path: Path
) -> None:
    out = _earlier(tmp_path / "speed.json")
    script = str(BENCHMARKS / "sim_speed.py")
    args = ["--trace", str(trace), "--policies", "lru", "--capacities", "5", "--jobs", "1"]
    done = _run_limited([script, *args, "--json", str(out)])
    assert done.returncode != 0
    assert "File too large" in done.stderr
    assert out.read_text() == EARLIER
    assert _leftovers(tmp_path) == []


def test_show_and_save_leaves_no_half_written_rows(
    tmp_path: Path, bench_modules: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A row that does not serialise stopped json.dump midway, after the rows before it."""
    pytest.importorskip("torch")
    from rich.table import Table

    bench = importlib.import_module("_bench")
    out = _earlier(tmp_path / "rows.json")
    rows: list[dict[str, object]] = [{"gbps": 1.0}, {"gbps": object()}]
    with pytest.raises(TypeError, match="not JSON serializable"):
        bench.show_and_save(Table(), rows, str(out))
    assert out.read_text() == EARLIER
    assert _leftovers(tmp_path) == []


def test_split_blocks_keeps_an_earlier_destination_when_a_line_is_bad(
    tmp_path: Path,
    bench_modules: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It wrote the good lines, then deleted the file: the earlier split was gone too."""
    split_blocks = importlib.import_module("split_blocks")
    src, dst = tmp_path / "t.jsonl", _earlier(tmp_path / "t16.jsonl")
    good = json.dumps({"input_length": 600, "hash_ids": [0, 7]})
    src.write_text(good + "\n" + json.dumps({"input_length": 600, "hash_ids": [1]}) + "\n")
    monkeypatch.setattr(sys, "argv", ["split_blocks.py", str(src), str(dst)])
    with pytest.raises(SystemExit):
        split_blocks.main()
    assert "t.jsonl:2: not a Mooncake trace line" in capsys.readouterr().err
    assert dst.read_text() == EARLIER
    assert _leftovers(tmp_path) == []


def test_split_blocks_keeps_an_earlier_destination_when_the_disk_fills(
    trace: Path, tmp_path: Path
) -> None:
    dst = _earlier(tmp_path / "t16.jsonl")
    done = _run_limited([str(BENCHMARKS / "split_blocks.py"), str(trace), str(dst)])
    assert done.returncode == 2
    assert done.stderr.endswith(f"dst {str(dst)!r}: cannot write there (File too large)\n")
    assert dst.read_text() == EARLIER
    assert _leftovers(tmp_path) == []


# -- the helper ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error", [OSError(28, "No space left on device"), KeyboardInterrupt(), TypeError("no JSON")]
)
def test_a_failed_write_leaves_the_earlier_file_and_no_temporary(
    tmp_path: Path, error: BaseException
) -> None:
    from kvtier.outputs import atomic_write

    out = _earlier(tmp_path / "out.json")
    with pytest.raises(type(error)), atomic_write(out) as f:
        f.write("[1, 2,")
        raise error
    assert out.read_text() == EARLIER
    assert os.listdir(tmp_path) == ["out.json"]
    with atomic_write(out, binary=True) as b:
        b.write(b"done")
    assert out.read_bytes() == b"done"


def test_a_fifo_is_written_in_place(tmp_path: Path) -> None:
    """A reader waits on a FIFO: replacing it with a file would leave the reader waiting."""
    from kvtier.outputs import atomic_write

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    with atomic_write(fifo) as f:
        f.write("rows\n")
    reader.join(10)
    assert got == ["rows\n"]
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert os.listdir(tmp_path) == ["pipe"]


def test_dev_stdout_is_written_through_its_descriptor(tmp_path: Path) -> None:
    """`/dev/stdout` redirected to a file is that file, reached through the descriptor: a
    replaced file would no longer be the one stdout writes to."""
    out = tmp_path / "stdout.txt"
    code = (
        "from kvtier.outputs import atomic_write\n"
        "with atomic_write('/dev/stdout') as f:\n    f.write('rows\\n')\n"
        "print('after', flush=True)\n"
    )
    with out.open("a") as f:  # `>>`: stdout's own writes go to the end of the file
        inode = os.fstat(f.fileno()).st_ino
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        subprocess.run([sys.executable, "-c", code], stdout=f, env=env, check=True, timeout=60)
    assert out.stat().st_ino == inode
    assert out.read_text() == "rows\nafter\n"
    assert os.listdir(tmp_path) == ["stdout.txt"]


def test_a_dangling_symlink_creates_its_target_and_stays(tmp_path: Path) -> None:
    from kvtier.outputs import atomic_write

    (tmp_path / "results").mkdir()
    link = tmp_path / "latest.json"
    link.symlink_to(tmp_path / "results" / "run1.json")
    with atomic_write(link) as f:
        f.write("[]\n")
    assert link.is_symlink() and (tmp_path / "results" / "run1.json").read_text() == "[]\n"
    assert os.listdir(tmp_path / "results") == ["run1.json"]


def test_errors_name_the_path_given_not_the_temporary_file(tmp_path: Path) -> None:
    from kvtier.outputs import atomic_write

    link = tmp_path / "out.json"
    link.symlink_to(tmp_path / "missing" / "out.json")
    with pytest.raises(FileNotFoundError) as e, atomic_write(link) as f:
        f.write("never")
    assert e.value.filename == str(link)


def test_a_read_only_file_is_refused_as_open_refuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Renaming over it would succeed where `open(path, "w")` fails. (os.access is patched:
    root, which runs these tests in some containers, may write any file.)"""
    from kvtier.outputs import atomic_write

    out = _earlier(tmp_path / "out.json")
    out.chmod(0o444)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if Path(p) == out else real_access(p, m))
    with pytest.raises(PermissionError) as e, atomic_write(out) as f:
        f.write("never")
    assert e.value.filename == str(out)
    assert out.read_text() == EARLIER and os.listdir(tmp_path) == ["out.json"]


def test_a_file_in_a_folder_that_is_not_writable_is_written_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """open() may replace a writable file in a folder that takes no new file, and so may the
    helper, in place; a new name there is refused, naming it. (os.open is patched: root,
    which runs these tests in some containers, may create files in any folder.)"""
    from kvtier.outputs import atomic_write

    out = _earlier(tmp_path / "out.json")
    inode = out.stat().st_ino
    real_open = os.open

    def no_new_files(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", no_new_files)
    with atomic_write(out) as f:
        f.write("new\n")
    assert out.read_text() == "new\n" and out.stat().st_ino == inode
    new = tmp_path / "new.json"
    with pytest.raises(PermissionError) as e, atomic_write(new) as f:
        f.write("never")
    assert e.value.filename == str(new)
    assert os.listdir(tmp_path) == ["out.json"]
