"""Token-id lists that numpy converts without complaint but that are not token ids (bools), or
that it converts to a float or object array although every element is a valid id."""

from __future__ import annotations

import enum
from typing import Any

import numpy as np
import pytest

from kvtier.hashing import BlockHasher, encode_extra_keys


@pytest.mark.parametrize(
    "tokens", [[True, 2, 3, 4], [1, 2, 3, False], (1, np.True_, 3, 4), [np.bool_(False), 7]]
)
def test_bools_among_list_token_ids_are_refused(tokens: Any) -> None:
    """np.asarray([True, 2, 3, 4]) is int64 [1, 2, 3, 4], so a flag hashed as token 1."""
    with pytest.raises(TypeError, match=r"token_ids\[\d\]=(np\.)?(True|False)_? is a bool"):
        BlockHasher(2).hash_blocks(tokens)


def test_bool_scalars_with_a_dtype_among_list_token_ids_are_refused() -> None:
    """0-d bool arrays and torch bool scalars beside ints also convert to 0 and 1."""
    torch = pytest.importorskip("torch")
    cases: list[Any] = [
        [np.array(True), 2],
        [2, torch.tensor(False)],
        [np.int64(3), np.array(True)],
    ]
    for tokens in cases:
        with pytest.raises(TypeError, match=r"token_ids\[\d\]=.*(True|False).* is a bool"):
            BlockHasher(2).hash_blocks(tokens)
    mixed = [np.array(5), torch.tensor(6), np.int32(7), 8]  # integer scalars are ids
    assert BlockHasher(2).hash_blocks(mixed) == BlockHasher(2).hash_blocks([5, 6, 7, 8])


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        ([1, 2, 3, 4.0], r"token_ids\[3\]=4\.0 is a float \(.*dtype float64\)"),
        ([1, "2"], r"token_ids\[1\]='2' is a str"),
        ([1, None], r"token_ids\[1\]=None is a NoneType \(.*dtype object\)"),
        ([2**63, 2], r"token_ids\[0\]=9223372036854775808 is out of range"),
    ],
)
def test_a_bad_element_is_named_with_its_position(tokens: list[Any], match: str) -> None:
    """The message named only the array's dtype (`float64` for [2**63, 2], all ints)."""
    # An int out of range is a ValueError at any size, as for ids that fit an int64.
    error = ValueError if "out of range" in match else TypeError
    with pytest.raises(error, match=match + r".*; expected integer token ids 0\.\.4294967295"):
        BlockHasher(2).hash_blocks(tokens)


def test_valid_ids_of_mixed_numpy_types_hash_like_plain_ints() -> None:
    """numpy promotes uint64 with int64 to float64, and that list was refused as floats."""
    hasher = BlockHasher(2)
    mixed: Any = [np.uint64(1), np.int64(2), 3, np.uint32(4)]
    assert hasher.hash_blocks(mixed) == hasher.hash_blocks([1, 2, 3, 4])


def test_integer_arrays_and_bool_free_lists_still_hash_the_same() -> None:
    hasher = BlockHasher(2)
    want = hasher.hash_blocks([1, 2, 3, 4])
    for tokens in (np.array([1, 2, 3, 4], dtype=">i8"), (1, 2, 3, 4), range(1, 5)):
        assert hasher.hash_blocks(tokens) == want


class _Level(int, enum.Enum):
    HIGH = 1


class _Named(int):
    def __str__(self) -> str:
        return "named"


@pytest.mark.parametrize("key", [_Level.HIGH, _Named(1)])
def test_an_int_subclass_extra_key_encodes_as_its_value(key: int) -> None:
    """str() of `class E(int, Enum)` is "E.A": the key 1 hashed as the text of its class and
    member names, so renaming the enum changed every hash."""
    assert encode_extra_keys(key) == encode_extra_keys(1)
    hasher = BlockHasher(2)
    assert hasher.hash_blocks([1, 2], [key]) == hasher.hash_blocks([1, 2], [1])
