"""The CUDA copy kernel's run-time compile: real NVRTC where installed (no GPU needed)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvtier.transfer import nvrtc

needs_nvrtc = pytest.mark.skipif(nvrtc._library() is None, reason="NVRTC is not installed")


@needs_nvrtc
def test_the_copy_kernel_compiles_for_each_gpu_generation_and_is_cached(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    images = {cc: nvrtc.cubin(cc) for cc in [(8, 0), (9, 0), (12, 0)]}  # Ampere, Hopper, Blackwell
    for cc, image in images.items():
        assert image is not None and nvrtc._whole_elf(image), cc
    assert len(set(images.values())) == 3, "one image per architecture"
    assert len(list(tmp_path.glob("kvtier-gather-*.cubin"))) == 3

    def no_compile(*args: object) -> bytes:
        raise AssertionError("compiled again instead of reading the cache")

    monkeypatch.setattr(nvrtc, "_compile", no_compile)
    assert nvrtc.cubin((9, 0)) == images[(9, 0)]


@needs_nvrtc
def test_a_cached_file_that_is_not_a_cubin_is_compiled_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    image = nvrtc.cubin((9, 0))
    assert image is not None
    (cached,) = tmp_path.glob("kvtier-gather-*.cubin")
    for bad in (image[: len(image) // 2], image[:8], b"not a cubin"):  # cut short, or garbage
        cached.write_bytes(bad)
        assert nvrtc.cubin((9, 0)) == image
        assert cached.read_bytes() == image


@needs_nvrtc
def test_a_kernel_nvrtc_refuses_gives_no_image_and_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "gather.cu"
    broken.write_text('extern "C" __global__ void kvt_copy16() { undeclared_name = 1; }\n')
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(nvrtc, "SOURCE", broken)
    with caplog.at_level(logging.WARNING, logger="kvtier.transfer.nvrtc"):
        assert nvrtc.cubin((9, 0)) is None
    assert "could not compile gather.cu" in caplog.text and "undeclared_name" in caplog.text
    assert not list((tmp_path / "cache").glob("*.cubin")), "a failed compile left a file"


def test_without_nvrtc_there_is_no_image(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvrtc, "_library", lambda: None)
    assert nvrtc.cubin((9, 0)) is None
