import numpy as np
import pytest

from kvtier.base import (
    BlockIDsLoadStoreSpec,
    ReqContext,
    checked_int,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from kvtier.cpu import CPUOffloadingManager


def test_offload_key_round_trip() -> None:
    h = bytes(range(32))
    k = make_offload_key(h, 7)
    assert k == h + b"\x00\x00\x00\x07"
    assert get_offload_block_hash(k) == h
    assert get_offload_group_idx(k) == 7
    assert get_offload_group_idx(make_offload_key(h, 2**32 - 1)) == 2**32 - 1


@pytest.mark.parametrize("group", [-1, 2**32])
def test_offload_key_rejects_out_of_range_group(group: int) -> None:
    with pytest.raises(ValueError, match=f"group_idx={group}"):
        make_offload_key(b"x", group)


@pytest.mark.parametrize(
    ("block_hash", "group", "message"),
    [
        (5, 0, "block_hash=5 has type int; expected bytes"),
        ("abc", 0, "block_hash='abc' has type str; expected bytes"),
        (b"x", 1.0, "group_idx=1.0 has type float; expected int"),
    ],
)
def test_offload_key_rejects_wrong_types(block_hash: object, group: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        make_offload_key(block_hash, group)  # type: ignore[arg-type]


def test_offload_key_accepts_numpy_group_and_bytes_like_hash() -> None:
    key = make_offload_key(bytearray(b"h"), np.int64(3))  # type: ignore[arg-type]
    assert key == make_offload_key(b"h", 3)
    assert get_offload_group_idx(key) == 3


def test_block_ids_spec_is_int64_array() -> None:
    spec = BlockIDsLoadStoreSpec([3, 1, 2])
    assert spec.block_ids.dtype == np.int64
    assert spec.block_ids.tolist() == [3, 1, 2]
    assert len(spec) == 3


def test_req_context_positions() -> None:
    k = make_offload_key(b"h", 0)
    ctx = ReqContext("r", key_positions={k: 32})
    assert ctx.position(k) == 32
    assert ctx.position(make_offload_key(b"g", 0)) is None


@pytest.mark.parametrize("bad", [np.array(2.0), np.array([2]), np.zeros((1, 1), dtype=np.int64)])
def test_checked_int_refuses_array_likes_with_a_value_error_naming_them(bad: object) -> None:
    # They have __index__, which raises a TypeError that names neither the argument nor the value.
    with pytest.raises(ValueError, match="num_slots="):
        checked_int("num_slots", bad)
    with pytest.raises(ValueError, match="num_slots="):
        CPUOffloadingManager(bad)  # type: ignore[arg-type]
    assert checked_int("num_slots", np.array(3)) == 3
