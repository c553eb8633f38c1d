"""Helpers for testing code that moves KV blocks: KV tensors of every supported layout filled with
random bytes, and byte-exact snapshots of device blocks. Used by kvtier's tests and benchmarks;
needs torch only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvtier.transfer.registration import KVTensor

NUM_BLOCKS = 48
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8, torch.float8_e4m3fn]


def fill_random_bytes(t: torch.Tensor, seed: int) -> None:
    """Overwrite every byte of `t`'s storage (NaN patterns included: copies must be bitwise)."""
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )
    g = torch.Generator().manual_seed(seed)
    flat.copy_(torch.randint(0, 256, (storage.nbytes(),), dtype=torch.uint8, generator=g))


def _flash(nb: int, dt: torch.dtype, dev: str) -> list[KVTensor]:
    return [KVTensor(torch.empty(2, nb, 4, 2, 8, dtype=dt, device=dev), "flash") for _ in range(2)]


def _flash_permuted(nb: int, dt: torch.dtype, dev: str) -> list[KVTensor]:
    # vLLM allocates some backends' caches block-major and exposes them K/V-major.
    base = torch.empty(nb, 2, 4, 2, 8, dtype=dt, device=dev)
    return [KVTensor(base.transpose(0, 1), "flash")]


def _hnd(nb: int, dt: torch.dtype, dev: str) -> list[KVTensor]:
    # vLLM's "HND" cache layout: allocated head-major, exposed token-major with `permute`, so
    # a block is one byte run whose dimensions are not in row-major order.
    flash = torch.empty(2, nb, 2, 4, 8, dtype=dt, device=dev).permute(0, 1, 3, 2, 4)
    flashinfer = torch.empty(nb, 2, 2, 4, 8, dtype=dt, device=dev).permute(0, 1, 3, 2, 4)
    return [KVTensor(flash, "flash"), KVTensor(flashinfer, "flashinfer")]


def _flashinfer(nb: int, dt: torch.dtype, dev: str) -> list[KVTensor]:
    return [
        KVTensor(torch.empty(nb, 2, 4, 2, 8, dtype=dt, device=dev), "flashinfer") for _ in range(2)
    ]


def _cross_layer(nb: int, dt: torch.dtype, dev: str) -> list[KVTensor]:
    return [KVTensor(torch.empty(nb, 3, 2, 4, 2, 8, dtype=dt, device=dev), "cross_layer")]


def _mla(nb: int, dt: torch.dtype, dev: str) -> list[KVTensor]:
    return [KVTensor(torch.empty(nb, 4, 40, dtype=dt, device=dev), "mla") for _ in range(2)]


def _aliased(nb: int, dt: torch.dtype, dev: str) -> list[KVTensor]:
    t = torch.empty(2, nb, 4, 2, 8, dtype=dt, device=dev)
    other = torch.empty(nb, 4, 24, dtype=dt, device=dev)
    # The same bytes three times: as itself, as another shape of one block, and again.
    return [KVTensor(t, "flash"), KVTensor(other, "mla"), KVTensor(t.view(2, nb, 64), 1),
            KVTensor(t, "flash")]  # fmt: skip


def _generic(nb: int, dt: torch.dtype, dev: str) -> list[KVTensor]:
    # (layers, 2, num_blocks, ...) from one allocation: block dimension 2, four parts per block.
    return [KVTensor(torch.empty(2, 2, nb, 4, 16, dtype=dt, device=dev), 2)]


def _shared_buffer(nb: int, dt: torch.dtype, dev: str) -> list[KVTensor]:
    # Per-layer tensors carved out of one buffer, back to back (not aliases, not overlapping).
    buf = torch.empty(3 * nb * 64, dtype=dt, device=dev)
    return [KVTensor(buf[i * nb * 64 : (i + 1) * nb * 64].view(nb, 4, 16), "mla") for i in range(3)]


LAYOUTS: dict[str, Callable[[int, torch.dtype, str], list[KVTensor]]] = {
    "flash": _flash,
    "flash_permuted": _flash_permuted,
    "flashinfer": _flashinfer,
    "hnd": _hnd,
    "cross_layer": _cross_layer,
    "mla": _mla,
    "aliased": _aliased,
    "generic": _generic,
    "shared_buffer": _shared_buffer,
}


def make_layout(
    name: str, dtype: torch.dtype, device: str = "cpu", seed: int = 0, nb: int = NUM_BLOCKS
) -> list[KVTensor]:
    """KV tensors of layout `name`, filled with random bytes."""
    make = LAYOUTS.get(name)
    if make is None:  # a bare KeyError named the value but not the choices
        raise ValueError(f"layout {name!r} is unknown; expected one of {sorted(LAYOUTS)}")
    kvs = make(nb, dtype, device)
    for i, kv in enumerate(kvs):
        fill_random_bytes(kv.tensor, seed * 1000 + i)
    return kvs


def block_bytes(kvs: list[KVTensor], block: int) -> list[torch.Tensor]:
    """A copy of every byte of device block `block` across the tensors."""
    out = []
    for kv in kvs:
        part = kv.tensor.select(kv.block_dim, block).contiguous()
        # reshape first: a block of one element is 0-d, which cannot be viewed as bytes.
        out.append(part.reshape(-1).view(torch.uint8).cpu().clone())
    return out


def snapshot(kvs: list[KVTensor], nb: int | None = None) -> list[list[torch.Tensor]]:
    """`block_bytes` of every block (of the first `nb`; default: all the tensors hold)."""
    return [block_bytes(kvs, b) for b in range(kvs[0].num_blocks if nb is None else nb)]


def assert_block_equals(kvs: list[KVTensor], block: int, expected: list[torch.Tensor]) -> None:
    """Byte-exact comparison of one device block with a snapshot."""
    for got, want in zip(block_bytes(kvs, block), expected, strict=True):
        assert torch.equal(got, want), f"block {block} differs"
