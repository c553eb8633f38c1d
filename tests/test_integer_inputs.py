"""Integers across base, hashing, admission and config: numpy and torch values, and errors."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

from kvtier.admission import ReuseAdmission, make_admission_policy
from kvtier.base import checked_int, make_offload_key
from kvtier.config import ConfigError, KVTierConfig, parse_size
from kvtier.cpu import CPUOffloadingManager
from kvtier.hashing import BlockHasher, chunk_keys, encode_extra_keys


def test_checked_int_refuses_a_torch_bool_and_a_one_element_tensor() -> None:
    torch = pytest.importorskip("torch")
    # torch's __index__ turns tensor(True) into 1 and tensor([5]) into 5, where numpy's
    # refuses np.True_ and np.array([5]); a bool or an array is not a count (the docstring).
    for bad in (torch.tensor(True), torch.tensor([5]), torch.tensor([[5]])):
        with pytest.raises(ValueError, match="num_slots="):
            checked_int("num_slots", bad)
        with pytest.raises(ValueError, match="num_slots="):
            CPUOffloadingManager(bad)
    assert checked_int("num_slots", torch.tensor(5)) == 5
    assert type(checked_int("num_slots", torch.tensor(5))) is int
    with pytest.raises(ValueError, match="num_slots="):
        checked_int("num_slots", np.True_)


def np_int(value: int) -> Any:
    """`value` as a numpy integer, typed as the `int` the APIs declare."""
    return np.int64(value)


def test_sizes_and_counts_take_numpy_integers_everywhere() -> None:
    # CPUOffloadingManager(np.int64(8)) works (checked_int); its store_threshold, the hasher's
    # block size, a chunk's size and the tracker's size refused the same kind of value.
    n = np_int
    m = CPUOffloadingManager(n(8), store_threshold=n(2), max_tracker_size=n(100))
    assert isinstance(m.admission, ReuseAdmission)
    assert (m.admission.store_threshold, m.admission.max_tracker_size) == (2, 100)
    assert type(m.admission.store_threshold) is int
    assert make_admission_policy(n(1)).name == "always"
    assert BlockHasher(n(2)).block_size == 2
    assert BlockHasher(n(2)).hash_blocks([1, 2]) == BlockHasher(2).hash_blocks([1, 2])
    hashes = BlockHasher(1).hash_blocks([1, 2, 3, 4])
    assert chunk_keys(hashes, n(2)) == chunk_keys(hashes, 2)
    cfg = KVTierConfig(chunk_tokens=32)
    assert cfg.resolve_blocks_per_chunk(n(16)) == cfg.resolve_blocks_per_chunk(16) == 2
    with pytest.raises(ConfigError, match="device_block_size="):
        cfg.resolve_blocks_per_chunk(np.float64(16.0))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: BlockHasher(np.float64(2.0)), "block_size="),  # type: ignore[arg-type]
        (lambda: BlockHasher(np.True_), "block_size="),  # type: ignore[arg-type]
        (lambda: chunk_keys([], 1.0), r"blocks_per_chunk=1\.0"),  # type: ignore[arg-type]
        (lambda: chunk_keys([], True), "blocks_per_chunk=True"),
        (lambda: ReuseAdmission(np_int(1)), "store_threshold="),
        (lambda: ReuseAdmission(2, np_int(0)), "max_tracker_size="),
        (lambda: make_admission_policy(np_int(-1)), "store_threshold="),
    ],
)
def test_what_is_still_refused(make: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "settings",
    [
        {"num_slots": "9" * 5000},
        {"max_pending_events": "1" + "0" * 4400},
        {"transfer_cpus": "0-" + "9" * 5000},
        {"transfer_coalesce_depth": "9" * 4301},
    ],
    ids=["num_slots", "max_pending_events", "transfer_cpus", "transfer_coalesce_depth"],
)
def test_an_integer_too_long_to_read_is_a_config_error_naming_the_key(
    settings: dict[str, str],
) -> None:
    # int() refuses strings of over 4300 digits with its own ValueError, which named neither
    # the key nor what was expected.
    (name,) = settings
    with pytest.raises(ConfigError, match=rf"^{name}='.*' \(from dict\): expected "):
        KVTierConfig.from_dict(settings)
    env = {f"KVTIER_{name.upper()}": settings[name]}
    with pytest.raises(ConfigError, match=rf"^KVTIER_{name.upper()}='.*' \(from environment\)"):
        KVTierConfig.load(env=env)


def test_numpy_scalars_are_values_like_their_python_twins() -> None:
    # A program's dict may carry numpy scalars (a size computed with numpy); np.int64(5) was
    # refused as "expected a positive integer", which it is.
    cfg = KVTierConfig.from_dict(
        {
            "num_slots": np.int64(5),
            "store_threshold": np.uint8(2),
            "enable_events": np.True_,
            "transfer_cpus": [np.int32(3), 1],
            "cpu_bytes": None,
        }
    )
    assert cfg == KVTierConfig(
        num_slots=5, store_threshold=2, enable_events=True, transfer_cpus=(1, 3)
    )
    assert type(cfg.num_slots) is int and type(cfg.enable_events) is bool
    assert all(type(c) is int for c in cfg.transfer_cpus or ())
    assert KVTierConfig.from_dict(cfg.to_dict()) == cfg
    assert KVTierConfig.from_dict({"cpu_bytes": np.int64(2**30)}).cpu_bytes == 2**30
    assert parse_size(np.uint32(512)) == 512
    for bad in ({"num_slots": np.float64(5.0)}, {"num_slots": np.True_}, {"num_slots": np.int8(0)}):
        with pytest.raises(ConfigError, match="num_slots="):
            KVTierConfig.from_dict(bad)
    with pytest.raises(ConfigError, match="enable_events="):
        KVTierConfig.from_dict({"enable_events": np.int64(2)})
    with pytest.raises(ConfigError, match="cpu_bytes="):
        KVTierConfig.from_dict({"cpu_bytes": np.int64(0)})
    with pytest.raises(ValueError, match="is negative"):
        parse_size(np.int64(-1))


def test_an_int_extra_key_of_any_size_encodes_in_every_process() -> None:
    # str() refuses ints of more digits than sys.get_int_max_str_digits() (4300 by default,
    # 640 at least, set per process by PYTHONINTMAXSTRDIGITS), so such a key raised its own
    # ValueError, and one process could hash a key another refused.
    huge = [7 * 10**5000 + 3, -(10**4400), 10**700 - 1]
    limit = sys.get_int_max_str_digits()
    try:
        sys.set_int_max_str_digits(0)  # no limit: the decimal text str() gives
        want = [encode_extra_keys(k) for k in huge]
        hashes = BlockHasher(2).hash_blocks([1, 2], extra_keys=[huge[0]])
        sys.set_int_max_str_digits(640)  # the lowest limit Python allows
        assert [encode_extra_keys(k) for k in huge] == want
        assert BlockHasher(2).hash_blocks([1, 2], extra_keys=[huge[0]]) == hashes
    finally:
        sys.set_int_max_str_digits(limit)
    assert [encode_extra_keys(k) for k in huge] == want
    assert encode_extra_keys(-(10**4400)).endswith(b"-1" + b"0" * 4400)


@pytest.mark.parametrize("bad", [True, False, np.True_], ids=["True", "False", "np.True_"])
def test_a_bool_group_index_is_refused(bad: Any) -> None:
    # operator.index(True) is 1: a flag passed as the group made keys of group 1 (or 0),
    # colliding with that group's real keys. checked_int refuses bools for the same reason.
    with pytest.raises(TypeError, match=r"group_idx=.* has type .*bool.*; expected int"):
        make_offload_key(b"h", bad)
    with pytest.raises(TypeError, match=r"group_idx="):
        chunk_keys([b"h"], 1, bad)


def test_a_tensor_group_index_must_be_one_integer() -> None:
    torch = pytest.importorskip("torch")
    assert make_offload_key(b"h", torch.tensor(3)) == make_offload_key(b"h", 3)
    for bad in (torch.tensor([3]), torch.tensor(True)):
        with pytest.raises(TypeError, match="group_idx="):
            make_offload_key(b"h", bad)
