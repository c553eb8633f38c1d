"""`kvtier demo` and scripts/demo.sh edge cases a serving engineer meets: a `--json` path that
is a dangling link, a container's memory limit, a relative KVTIER_VENV and a failed set-up."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_json_check_through_a_dangling_link_keeps_the_link(tmp_path: Path) -> None:
    """Opening a dangling link creates its target; the check removed the link instead, so a
    refused run lost the user's link and left an empty file where it pointed."""
    from kvtier.demo import _check_writable

    link, target = tmp_path / "results.json", tmp_path / "target.json"
    link.symlink_to(target.name)
    _check_writable(link)
    assert link.is_symlink() and os.readlink(link) == target.name
    assert not target.exists()


def test_a_run_refused_after_the_json_check_keeps_a_dangling_json_link(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvtier.cli import main

    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')  # no weights: refused later
    link, target = tmp_path / "results.json", tmp_path / "out" / "target.json"
    target.parent.mkdir()
    link.symlink_to(target)
    assert main(["demo", "--quiet", "--model", str(model), "--json", str(link)]) == 2
    assert "cannot load it as a causal LM" in capsys.readouterr().err
    assert link.is_symlink() and not target.exists()


def _fake_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, proc: str) -> Path:
    from kvtier import demo

    (tmp_path / "proc").write_text(proc)
    root = tmp_path / "cgroup"
    root.mkdir()
    # raising=False: the names are the hook this test needs, whatever the module holds.
    monkeypatch.setattr(demo, "PROC_CGROUP", tmp_path / "proc", raising=False)
    monkeypatch.setattr(demo, "CGROUP_ROOT", root, raising=False)
    return root


def test_a_v1_container_limit_of_a_parent_cgroup_is_the_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SC_PHYS_PAGES is the host's RAM: in a container limited to 64 MiB the demo took a
    workload of gigabytes, and the OOM killer ended it without a word (exit 137)."""
    from kvtier import demo

    root = _fake_cgroup(tmp_path, monkeypatch, "5:cpu:/\n4:memory:/a/b\n0::/\n")
    (root / "memory" / "a" / "b").mkdir(parents=True)
    (root / "memory" / "a" / "b" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (root / "memory" / "a" / "memory.limit_in_bytes").write_text(f"{64 * 2**20}\n")
    assert demo.physical_memory() == 64 * 2**20


def test_a_v2_memory_max_counts_and_max_means_no_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier import demo

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    root = _fake_cgroup(tmp_path, monkeypatch, "0::/pod/app\n")
    (root / "cgroup.controllers").write_text("memory\n")
    (root / "pod" / "app").mkdir(parents=True)
    (root / "pod" / "app" / "memory.max").write_text("max\n")
    assert demo.physical_memory() == ram
    (root / "pod" / "memory.max").write_text(f"{16 * 2**20}\n")
    assert demo.physical_memory() == 16 * 2**20


def test_the_default_workload_is_refused_in_a_small_container(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier import demo
    from kvtier.integrations.hf.models import make_demo_model

    root = _fake_cgroup(tmp_path, monkeypatch, "0::/\n")
    (root / "cgroup.controllers").write_text("memory\n")
    (root / "memory.max").write_text(f"{16 * 2**20}\n")  # the default needs about 27 MiB
    _, config = make_demo_model("llama", 0)
    with pytest.raises(ValueError, match=r"16\.0 MiB of memory"):
        demo._check_memory(demo.DemoOptions(), config)


def _fake_env(tmp_path: Path, name: str, pip_status: int) -> Path:
    """A stand-in virtual environment: its python answers pip with `pip_status`, its kvtier
    prints where it ran and its arguments."""
    bin_dir = tmp_path / name / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    stubs = {
        "python": f'if [ "$1" = -m ] && [ "$2" = pip ]; then exit {pip_status}; fi',
        "kvtier": 'echo "$PWD" "$@"',
    }
    for stub, body in stubs.items():
        (bin_dir / stub).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / stub).chmod(0o755)
    return bin_dir.parent


def _demo_sh(tmp_path: Path, venv: str) -> subprocess.CompletedProcess[str]:
    caller = tmp_path / "the caller"  # a space, as in many home folders
    caller.mkdir(exist_ok=True)
    # A python that must not be run: it would create a virtual environment and install torch.
    no_python = tmp_path / "no-python"
    no_python.write_text('#!/usr/bin/env bash\necho "created a venv: $*" >&2\nexit 97\n')
    no_python.chmod(0o755)
    env = {**os.environ, "KVTIER_VENV": venv, "PYTHON": str(no_python), "KVTIER_WITH_VLLM": "0"}
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "demo.sh"), "--json", "a b.json"],
        cwd=caller,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_relative_kvtier_venv_is_from_where_the_script_runs(tmp_path: Path) -> None:
    """Read from the repository root, `KVTIER_VENV=../venv` named a missing environment, and
    setup.sh created one there and installed torch into it."""
    _fake_env(tmp_path, "venv", 0)
    out = _demo_sh(tmp_path, "../venv")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == f"{tmp_path / 'the caller'} demo --json a b.json"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_failed_set_up_is_not_reported_as_different_tokens(tmp_path: Path) -> None:
    """pip's status 1 passed through demo.sh, which README gives to "tokens differ"."""
    venv = _fake_env(tmp_path, "venv", 1)
    out = _demo_sh(tmp_path, str(venv))
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stdout == ""  # kvtier demo never ran
    (line,) = [s for s in out.stderr.splitlines() if s.startswith("demo.sh: error:")]
    assert "scripts/setup.sh" in line and "status 1" in line


@pytest.mark.parametrize("name", ["outdir/", "results.json/"])
def test_a_json_path_ending_in_a_separator_is_refused_before_the_run(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Path() drops the separator, so `--json outdir/` wrote a file named `outdir` and exited
    0 (kvtier simulate refuses such a path)."""
    from kvtier.cli import main

    monkeypatch.chdir(tmp_path)

    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the workload ran before --json was checked")

    monkeypatch.setattr("kvtier.demo.run_demo", no_run)
    assert main(["demo", "--quiet", "--json", name]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and repr(name) in err and "path separator" in err, err
    assert list(tmp_path.iterdir()) == []


def test_help_states_the_status_of_an_interrupted_run(capsys: pytest.CaptureFixture[str]) -> None:
    """main() exits 130 on Ctrl-C (as docs/simulate.md says for simulate); --help and README
    listed 0, 1, 2 and 141 only."""
    from kvtier.cli import main

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "130 when interrupted" in " ".join(capsys.readouterr().out.split())
    assert "130 when\ninterrupted" in (ROOT / "README.md").read_text()


def test_demo_without_torch_is_the_one_line_install_hint() -> None:
    """transformers imports without torch: only it was checked, and the run's `import torch`
    ended in a traceback and status 1, which says "tokens differ"."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # import torch fails, as where it is not installed\n"
        "from kvtier.cli import main\n"
        "sys.exit(main(['demo', '--conversations', '1', '--turns', '1']))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr == "kvtier demo: needs torch and transformers: pip install 'kvtier[hf]'\n"


def _tiny_gemma3(path: Path, positions: int = 131072) -> Path:
    """A random-weight Gemma 3 checkpoint: a multimodal config, its decoder's settings
    (vocab_size, max_position_embeddings) in `text_config`."""
    transformers = pytest.importorskip("transformers")
    text = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "sliding_window": 64,
        "layer_types": ["full_attention", "full_attention"],
        "max_position_embeddings": positions,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    }
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def test_a_multimodal_checkpoint_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """AutoModelForCausalLM loads Gemma 3 as Gemma3ForConditionalGeneration, whose config
    has no vocab_size of its own: the demo ended in an AttributeError and status 1."""
    from kvtier.cli import main

    model = _tiny_gemma3(tmp_path / "gemma3")
    capsys.readouterr()  # save_pretrained's progress bar
    args = ["demo", "--model", str(model), "--conversations", "1", "--turns", "2", "--quiet"]
    assert main([*args, "--new-tokens", "2"]) == 0
    assert capsys.readouterr().err == ""


def test_a_multimodal_checkpoints_positions_are_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvtier.cli import main

    model = _tiny_gemma3(tmp_path / "gemma3", positions=64)
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["demo", "--model", str(model), "--conversations", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "max_position_embeddings" in err, err


@pytest.mark.parametrize("field", ["turns", "conversations", "new_tokens", "seed"])
def test_demo_options_refuse_a_bool(field: str) -> None:
    """bool is an int: DemoOptions(turns=True) ran one turn, seed=True named the model
    "random-weight llama (seed True)"."""
    from kvtier.demo import DemoOptions

    with pytest.raises(ValueError, match=rf"^--{field.replace('_', '-')}=True; expected an int"):
        DemoOptions(**{field: True})  # type: ignore[arg-type]  # the bad value on purpose


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_writes_a_relative_out_where_it_is_run(tmp_path: Path) -> None:
    """gpu_check.sh moves to the checkout first: OUT=results from elsewhere wrote the results
    into the checkout's own `results` folder."""
    python = tmp_path / "python"  # passes the CUDA check; nvidia-smi then ends the run
    python.write_text("#!/usr/bin/env bash\ncat >/dev/null\nexit 0\n")
    python.chmod(0o755)
    caller = tmp_path / "the caller"
    caller.mkdir()
    name = f"review-out-{os.getpid()}"
    try:
        subprocess.run(
            ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "tests"],
            cwd=caller,
            env={**os.environ, "OUT": name, "PYTHON": str(python), "PATH": "/usr/bin:/bin"},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert (caller / name).is_dir()
        assert not (ROOT / name).exists()
    finally:
        shutil.rmtree(ROOT / name, ignore_errors=True)


def test_demo_options_take_a_str_model_path(tmp_path: Path) -> None:
    """DemoOptions(model="dir") raised AttributeError ('str' object has no attribute
    'is_dir'); a str is read as a path, anything else refused naming --model."""
    from kvtier.demo import DemoOptions

    with pytest.raises(ValueError, match=r"--model .*nowhere is not a directory"):
        DemoOptions(model=str(tmp_path / "nowhere"))  # type: ignore[arg-type]
    (tmp_path / "config.json").write_text("{}")
    assert DemoOptions(model=str(tmp_path)).model == tmp_path  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^--model 5; expected a checkpoint directory path$"):
        DemoOptions(model=5)  # type: ignore[arg-type]
