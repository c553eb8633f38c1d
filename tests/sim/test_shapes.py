"""Model shapes and capacity specs."""

from __future__ import annotations

import pytest

from kvtier.sim.shapes import MODEL_PRESETS, ModelShape, parse_capacity, parse_model_shape


def test_presets_and_custom_shapes() -> None:
    llama = parse_model_shape("llama-3-8b")
    assert llama.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    assert llama.block_bytes(512) == 64 * 2**20
    assert parse_model_shape("qwen-2.5-7b").bytes_per_token == 2 * 28 * 4 * 128 * 2
    custom = parse_model_shape("4,2,64,fp32")
    assert (custom.layers, custom.kv_heads, custom.head_dim, custom.dtype) == (4, 2, 64, "fp32")
    assert parse_model_shape("4,2,64").dtype == "bf16"
    assert set(MODEL_PRESETS) >= {"llama-3-8b", "qwen-2.5-7b"}


@pytest.mark.parametrize("spec", ["gpt-5", "4,2", "4,2,x", "a,b,c,d"])
def test_bad_model_shapes(spec: str) -> None:
    with pytest.raises(ValueError, match="model shape"):
        parse_model_shape(spec)


def test_bad_shape_fields() -> None:
    with pytest.raises(ValueError, match="dtype 'int3'"):
        ModelShape("x", 1, 1, 1, "int3")
    with pytest.raises(ValueError, match="layers=0"):
        ModelShape("x", 0, 1, 1)


def test_capacities() -> None:
    assert parse_capacity("1%", unique_blocks=182_790) == (1828, 1828 / 182_790)
    assert parse_capacity("25%", unique_blocks=182_790)[0] == 45_698
    assert parse_capacity("2.5%", unique_blocks=1000)[0] == 25
    assert parse_capacity("300", unique_blocks=1000) == (300, 0.3)
    mib64 = 64 * 2**20
    assert parse_capacity("64GiB", unique_blocks=10, block_bytes=mib64)[0] == 1024
    assert parse_capacity("1gb", unique_blocks=10, block_bytes=10**6)[0] == 1000


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("lots", "capacity 'lots' is invalid"),
        ("1.5", "must be an integer"),
        ("0", "less than one block"),
        ("0%", "less than one block"),
        ("5 parsecs", "unknown unit"),
        ("0.5B", "capacity '0.5B' is not a whole number of bytes"),
        ("1.GiB", "capacity '1.GiB' is invalid; expected a non-negative number"),
        ("1" + "0" * 400, "is too large; expected at most 1e308 blocks"),
        ("64GiB", "give --model-shape"),
    ],
)
def test_bad_capacities(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_capacity(spec, unique_blocks=100)


def test_a_share_above_zero_is_at_least_one_block() -> None:
    assert parse_capacity("1%", unique_blocks=10) == (1, 0.1)
    assert parse_capacity("0.01%", unique_blocks=100) == (1, 0.01)
    assert parse_capacity("0." + "0" * 400 + "1%", unique_blocks=7)[0] == 1
    assert parse_capacity("1%", unique_blocks=150)[0] == 2  # rounding above one is unchanged
    with pytest.raises(ValueError, match="less than one block"):
        parse_capacity("5%", unique_blocks=0)


def test_a_device_capacity_may_be_zero() -> None:
    for spec in ("0", "0%", "0.0%", "0GiB"):
        assert parse_capacity(spec, unique_blocks=100, block_bytes=64, allow_zero=True) == (0, 0.0)
    with pytest.raises(ValueError, match="'32B' is less than one block"):
        parse_capacity("32B", unique_blocks=100, block_bytes=64, allow_zero=True)
    with pytest.raises(ValueError, match="'0GiB' is less than one block"):
        parse_capacity("0GiB", unique_blocks=100, block_bytes=64)  # a CPU tier


def test_capacities_beyond_the_trace_are_kept() -> None:
    assert parse_capacity("100000000000000000000", unique_blocks=10) == (10**20, 1e19)
    huge = "1" + "0" * 310 + "%"  # a share beyond float range: exact arithmetic
    assert parse_capacity(huge, unique_blocks=1) == (10**308, 1e308)
