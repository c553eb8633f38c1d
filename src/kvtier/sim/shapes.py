"""Model shapes (bytes per block) and capacity specs ("5%", "20000", "64GiB")."""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Final

from kvtier.base import checked_int
from kvtier.config import parse_size

DTYPE_BYTES: Final = {
    "fp32": 4,
    "float32": 4,
    "fp16": 2,
    "float16": 2,
    "bf16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "float8": 1,
}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The KV-cache geometry of a model: K and V of `kv_heads * head_dim` values per layer."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        for field_name in ("layers", "kv_heads", "head_dim"):
            value = getattr(self, field_name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{field_name}={value!r} is invalid; expected a positive int")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(
                f"dtype {self.dtype!r} is unknown; expected one of: {', '.join(DTYPE_BYTES)}"
            )

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all layers (K and V)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def block_bytes(self, block_tokens: int) -> int:
        """KV bytes of one `block_tokens`-token block."""
        return self.bytes_per_token * block_tokens


MODEL_PRESETS: Final = {
    s.name: s
    for s in (
        ModelShape("llama-3-8b", 32, 8, 128),
        ModelShape("llama-3-70b", 80, 8, 128),
        ModelShape("qwen-2.5-7b", 28, 4, 128),
        ModelShape("qwen-2.5-72b", 80, 8, 128),
        ModelShape("mistral-7b", 32, 8, 128),
    )
}
"""Shapes of a few common models, by name (dtype bf16)."""


def parse_model_shape(spec: str) -> ModelShape:
    """A preset name, or `LAYERS,KV_HEADS,HEAD_DIM[,DTYPE]` such as `32,8,128,bf16`."""
    if not isinstance(spec, str):
        raise TypeError(
            f"model shape {spec!r} has type {type(spec).__name__}; expected a str: a preset "
            f"({', '.join(MODEL_PRESETS)}) or LAYERS,KV_HEADS,HEAD_DIM[,DTYPE]"
        )
    if spec in MODEL_PRESETS:
        return MODEL_PRESETS[spec]
    parts = [p.strip() for p in spec.split(",")]
    # isdecimal, not isdigit: isdigit also takes '²' or '①', which int() then refuses with a
    # message that names neither the shape nor what was expected.
    if len(parts) in (3, 4) and all(p.isdecimal() for p in parts[:3]):
        layers, kv_heads, head_dim = (int(p) for p in parts[:3])
        dtype = parts[3] if len(parts) == 4 else "bf16"
        return ModelShape(spec, layers, kv_heads, head_dim, dtype)
    raise ValueError(
        f"model shape {spec!r} is unknown; expected a preset ({', '.join(MODEL_PRESETS)}) "
        "or LAYERS,KV_HEADS,HEAD_DIM[,DTYPE] such as 32,8,128,bf16"
    )


_CAPACITY_RE: Final = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(%|[a-zA-Z]+)?\s*$")
_MAX_BLOCKS: Final = 10**308
_MAX_DIGITS: Final = 4000  # below the 4,300 digits Python's int() reads; 1e308 has 309
_SIZE_UNITS: Final = ("B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB")


def _bytes_text(n: int) -> str:
    """`n` bytes in the largest binary unit it fills: "64 MiB", "1.75 GiB", "512 B"."""
    if n >= 2**1000:
        return f"{n:,} bytes"  # beyond a float (a block size inferred from absurd lengths)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            text = f"{n / size:.4g}"
            # The exact count too where the short form rounds (a "1 MiB" block one byte larger).
            return f"{text} {unit}" + ("" if float(text) * size == n else f" ({n:,} bytes)")
    return f"{n} B"


def parse_capacity(
    spec: str, *, unique_blocks: int, block_bytes: int | None = None, allow_zero: bool = False
) -> tuple[int, float]:
    """Turn a capacity spec into `(blocks, share of the trace's unique blocks)`.

    `"5%"` is a share of `unique_blocks` (rounded to the nearest block, a tie to the even one,
    and up to one block if the share is above 0 and the trace has blocks), `"20000"` a block
    count, `"64GiB"` (or GB, MiB, …) a byte size divided by `block_bytes` (rounded down), which
    needs a model shape.
    Every capacity is at least one block; with `allow_zero` (a device cache) a spec of zero
    (`"0"`, `"0%"`, `"0GiB"`) gives 0 blocks.
    """
    if not isinstance(spec, str):
        # A block count given as an int failed in the regex, naming neither the value nor
        # the forms a capacity takes.
        raise TypeError(
            f"capacity {spec!r} has type {type(spec).__name__}; expected a str such as '5%', "
            "'20000' or '64GiB'"
        )
    # The share and byte forms divide by these: a float or a negative count gave a capacity
    # that is no block count, or "less than one block" for a share of 50%.
    unique_blocks = checked_int("unique_blocks", unique_blocks, minimum=0)
    if block_bytes is not None:
        block_bytes = checked_int("block_bytes", block_bytes)
    m = _CAPACITY_RE.match(spec)
    if m is None:
        raise ValueError(
            f"capacity {spec!r} is invalid; expected a share ('5%'), a block count ('20000') "
            "or a size ('64GiB')"
        )
    digits, unit = m.group(1), (m.group(2) or "")
    if len(digits) > _MAX_DIGITS:
        # Python refuses to read an int of more than 4,300 digits, with a message about
        # sys.set_int_max_str_digits that says nothing of the capacity.
        raise ValueError(
            f"capacity {spec[:40]!r}... has {len(digits):,} digits; expected at most "
            f"{_MAX_DIGITS:,} (and at most 1e308 blocks)"
        )
    exact = Fraction(digits)
    if unit == "%":
        # Exact arithmetic: in floats a tie such as 4.4% of 375 blocks (16.5) can land on
        # either side and round away from the even neighbour that every other tie goes to.
        blocks = round(exact * unique_blocks / 100)
        if blocks == 0 and exact > 0:
            blocks = min(1, unique_blocks)
    elif not unit:
        if not digits.isdigit():
            raise ValueError(f"capacity {spec!r} is invalid; a block count must be an integer")
        blocks = int(digits)
    else:
        if unit.lower() not in (u.lower() for u in _SIZE_UNITS):
            raise ValueError(
                f"capacity {spec!r} has unknown unit {unit!r}; expected % or one of: "
                f"{', '.join(_SIZE_UNITS)}"
            )
        try:
            nbytes = parse_size(spec.strip())
        except ValueError as e:  # "size '0.5B' is not a whole number of bytes", ...
            raise ValueError(
                str(e).replace(f"size {spec.strip()!r}", f"capacity {spec!r}", 1)
            ) from None
        if block_bytes is None:
            raise ValueError(
                f"capacity {spec!r} is a size in bytes; give --model-shape so it can be "
                "converted to blocks"
            )
        blocks = nbytes // block_bytes
    if blocks < 1 and not (allow_zero and exact == 0):
        if unit and unit != "%" and block_bytes is not None and exact > 0:
            # The block's size comes from the trace and the model shape: without it the user
            # had to work out how much is enough.
            raise ValueError(
                f"capacity {spec!r} is less than one block; expected at least "
                f"{_bytes_text(block_bytes)}, the KV cache of one block of this trace with "
                "this model shape"
            )
        raise ValueError(f"capacity {spec!r} is less than one block")
    if blocks > _MAX_BLOCKS:  # its share of the trace must stay a finite float
        raise ValueError(f"capacity {spec!r} is too large; expected at most 1e308 blocks")
    return blocks, blocks / unique_blocks if unique_blocks else 0.0
