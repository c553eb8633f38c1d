"""Tests of kvtier.hashing: chained block hashes, extra keys, namespaces, chunk keys."""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.base import get_offload_block_hash, get_offload_group_idx
from kvtier.hashing import BlockHasher, chunk_keys, encode_extra_keys

ALGORITHMS = ["sha256", "xxh3_128"]

_CHILD = """
import sys
from kvtier.hashing import BlockHasher
h = BlockHasher(4, algorithm=sys.argv[1], namespace="llama-3-8b@rev1")
hashes = h.hash_blocks(list(range(1000, 1013)), extra_keys=[("lora-a", b"\\x01", 7), None, "s"])
print(",".join(x.hex() for x in hashes))
"""


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_same_hashes_in_processes_with_different_hash_seeds(algorithm: str) -> None:
    outputs = set()
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, algorithm],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        outputs.add(out)
    assert len(outputs) == 1
    here = BlockHasher(4, algorithm=algorithm, namespace="llama-3-8b@rev1").hash_blocks(
        list(range(1000, 1013)), extra_keys=[("lora-a", b"\x01", 7), None, "s"]
    )
    assert outputs == {",".join(x.hex() for x in here)}


def test_hash_values_are_pinned() -> None:
    # A change of encoding silently invalidates every stored chunk and every shared trace;
    # these constants make such a change loud. Update them only on purpose (and bump the tag).
    sha = BlockHasher(2, namespace="m").hash_blocks([1, 2])[0]
    assert sha.hex()[:16] == "75419b91e74703d1"
    xxh = BlockHasher(2, namespace="m", algorithm="xxh3_128").hash_blocks([1, 2], ["lora"])[0]
    assert xxh.hex() == "7f986be4fc01b83be4a227d78957e6f8"


def test_hashers_of_other_block_sizes_never_share_a_hash() -> None:
    """A block's bytes are parent, tokens and extra keys, unseparated: an 8-token block with an
    extra key that encodes to 32 bytes equalled a 16-token block without one."""
    h8, h16 = BlockHasher(8, namespace="m"), BlockHasher(16, namespace="m")
    assert h8.root_hash != h16.root_hash
    salt = b"\x00" * 19  # tag, length and payload: 32 bytes, 8 tokens' worth
    tail = np.frombuffer(encode_extra_keys(salt), "<u4").tolist()
    head = list(range(100, 108))
    assert h8.hash_blocks(head, extra_keys=[salt]) != h16.hash_blocks(head + tail)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_digest_sizes_and_one_hash_per_full_block(algorithm: str) -> None:
    h = BlockHasher(16, algorithm=algorithm)
    hashes = h.hash_blocks(list(range(16 * 3 + 5)))
    assert len(hashes) == 3
    assert {len(x) for x in hashes} == {h.digest_size}
    assert h.digest_size == {"sha256": 32, "xxh3_128": 16}[algorithm]
    assert len(set(hashes)) == 3


def test_partial_block_is_not_hashed() -> None:
    h = BlockHasher(4)
    assert h.hash_blocks([1, 2, 3]) == []
    assert h.hash_blocks([]) == []
    full = h.hash_blocks([1, 2, 3, 4, 5, 6, 7, 8])
    assert h.hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]) == full


def test_chaining_depends_on_the_whole_prefix() -> None:
    h = BlockHasher(2)
    a = h.hash_blocks([1, 2, 5, 6])
    b = h.hash_blocks([3, 4, 5, 6])
    assert a[1] != b[1]  # same tokens in block 1, different prefix
    c = h.hash_blocks([1, 2, 5, 6, 7, 8])
    assert c[:2] == a  # same prefix, same hashes
    # A block's position matters too: [5, 6] first is not [5, 6] second.
    assert h.hash_blocks([5, 6])[0] != a[1]


def test_parent_continues_a_chain() -> None:
    h = BlockHasher(3)
    tokens = list(range(100, 130))
    extras = [f"x{i}" for i in range(10)]
    full = h.hash_blocks(tokens, extra_keys=extras)
    tail = h.hash_blocks(tokens[12:], extra_keys=extras[4:], parent=full[3])
    assert tail == full[4:]


def test_numpy_and_list_inputs_agree_for_every_int_dtype() -> None:
    h = BlockHasher(4)
    tokens = [0, 1, 2, 3, 250, 127, 9, 10]
    expected = h.hash_blocks(tokens)
    for dtype in (np.int32, np.int64, np.uint32, np.uint16, np.int8):
        small = [t for t in tokens if t <= np.iinfo(dtype).max]
        assert h.hash_blocks(np.array(small, dtype=dtype)) == h.hash_blocks(small)
    assert h.hash_blocks(np.array(tokens, dtype=np.int64)) == expected
    assert h.hash_blocks(tuple(tokens)) == expected


def test_large_token_ids_are_distinct_not_wrapped() -> None:
    h = BlockHasher(1)
    assert h.hash_blocks([2**32 - 1]) != h.hash_blocks([0])
    assert h.hash_blocks([2**16]) != h.hash_blocks([0])


def test_namespace_separates_models() -> None:
    tokens = list(range(32))
    a = BlockHasher(8, namespace="model-a").hash_blocks(tokens)
    b = BlockHasher(8, namespace="model-b").hash_blocks(tokens)
    assert not set(a) & set(b)
    # str namespaces are their UTF-8 bytes.
    assert BlockHasher(8, namespace="modèle").hash_blocks(tokens) == BlockHasher(
        8, namespace="modèle".encode()
    ).hash_blocks(tokens)
    assert BlockHasher(8).root_hash != BlockHasher(8, namespace="x").root_hash


def test_algorithms_give_different_hashes() -> None:
    tokens = list(range(8))
    assert (
        BlockHasher(8).hash_blocks(tokens)[0][:16]
        != BlockHasher(8, algorithm="xxh3_128").hash_blocks(tokens)[0]
    )


def test_extra_keys_change_hashes() -> None:
    h = BlockHasher(2)
    tokens = [1, 2, 3, 4]
    plain = h.hash_blocks(tokens)
    assert h.hash_blocks(tokens, extra_keys=[None, None]) == plain
    assert h.hash_blocks(tokens, extra_keys=[(), ()]) == plain
    lora = h.hash_blocks(tokens, extra_keys=["lora-a", "lora-a"])
    assert lora[0] != plain[0] and lora[1] != plain[1]
    assert h.hash_blocks(tokens, extra_keys=["lora-b", "lora-b"])[0] != lora[0]
    # An extra key on block 0 only still changes block 1 through the chain.
    only_first = h.hash_blocks(tokens, extra_keys=["salt", None])
    assert only_first[0] != plain[0] and only_first[1] != plain[1]
    # A bare key is a one-key tuple.
    assert h.hash_blocks(tokens, extra_keys=[("lora-a",), ("lora-a",)]) == lora


def test_extra_keys_may_cover_the_partial_block() -> None:
    h = BlockHasher(2)
    assert h.hash_blocks([1, 2, 3], extra_keys=["a", "b"]) == h.hash_blocks([1, 2], ["a"])


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("1", 1),
        ("1", b"1"),
        (b"1", 1),
        (("ab", "c"), ("a", "bc")),
        (("a",), ("a", "")),
        (-1, 1),
        ("", None),
        ((b"",), ()),
    ],
)
def test_extra_key_encoding_is_unambiguous(a: Any, b: Any) -> None:
    assert encode_extra_keys(a) != encode_extra_keys(b)
    h = BlockHasher(1)
    assert h.hash_blocks([7], [a]) != h.hash_blocks([7], [b])


@given(
    st.lists(st.one_of(st.text(), st.binary(), st.integers()), max_size=4),
    st.lists(st.one_of(st.text(), st.binary(), st.integers()), max_size=4),
)
def test_distinct_extra_key_tuples_encode_distinctly(a: list[Any], b: list[Any]) -> None:
    same = [(type(x), x) for x in a] == [(type(x), x) for x in b]
    assert (encode_extra_keys(a) == encode_extra_keys(b)) == same


@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.integers(1, 8))
def test_prefix_property(tokens: list[int], block_size: int) -> None:
    h = BlockHasher(block_size)
    hashes = h.hash_blocks(tokens)
    assert len(hashes) == len(tokens) // block_size
    for k in range(len(hashes) + 1):
        assert h.hash_blocks(tokens[: k * block_size]) == hashes[:k]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "16"])
def test_bad_block_size(bad: Any) -> None:
    with pytest.raises(ValueError, match=f"block_size={bad!r}"):
        BlockHasher(bad)


def test_unknown_algorithm_is_named() -> None:
    with pytest.raises(ValueError, match=r"'md5'.*sha256, xxh3_128"):
        BlockHasher(16, algorithm="md5")


def test_bad_namespace_type() -> None:
    with pytest.raises(TypeError, match="namespace 7"):
        BlockHasher(16, namespace=7)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tokens", "error", "match"),
    [
        ([1, -1], ValueError, "token id -1 is out of range"),
        ([1, 2**32], ValueError, f"token id {2**32} is out of range"),
        ([1, 2**70], ValueError, r"token_ids\[1\]=\d+ is out of range.*dtype object"),
        ([1, -(2**70)], ValueError, r"token_ids\[1\]=-\d+ is out of range"),
        ([1.0, 2.0], TypeError, "dtype float64"),
        (["1", "2"], TypeError, "dtype <U1"),
        ([[1, 2]], ValueError, r"shape \(1, 2\)"),
        (np.array([True, False]), TypeError, "dtype bool"),
    ],
)
def test_bad_tokens(tokens: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        BlockHasher(2).hash_blocks(tokens)


def test_bad_extra_keys() -> None:
    h = BlockHasher(2)
    with pytest.raises(ValueError, match="extra_keys has 3 entries"):
        h.hash_blocks([1, 2, 3, 4], extra_keys=["a", "b", "c"])
    with pytest.raises(TypeError, match=r"extra key 1\.5 has type float"):
        h.hash_blocks([1, 2], extra_keys=[("a", 1.5)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="extra key True has type bool"):
        h.hash_blocks([1, 2], extra_keys=[True])


@pytest.mark.parametrize("unordered", [{"lora-a", "salt"}, frozenset({"a"}), {"k": 1}])
def test_extra_keys_without_a_fixed_order_are_refused(unordered: Any) -> None:
    # A set of strings iterates in a PYTHONHASHSEED-dependent order: its hash would differ
    # between processes.
    with pytest.raises(TypeError, match=f"have type {type(unordered).__name__}"):
        BlockHasher(2).hash_blocks([1, 2], extra_keys=[unordered])
    with pytest.raises(TypeError, match="extra_keys has type dict"):
        BlockHasher(2).hash_blocks([1, 2], extra_keys={0: "a"})  # type: ignore[arg-type]


def test_set_of_extra_keys_is_refused_in_every_process() -> None:
    code = (
        "from kvtier.hashing import BlockHasher\n"
        "try:\n"
        "    print(BlockHasher(2).hash_blocks([1, 2], [{'lora-a', 'salt', 'x'}])[0].hex())\n"
        "except TypeError:\n"
        "    print('refused')\n"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in (1, 2, 3, 4)
    }
    assert outs == {"refused\n"}


def test_bytes_like_extra_keys_are_bytes_not_ints() -> None:
    h = BlockHasher(2)
    as_bytes = h.hash_blocks([1, 2], [b"ab"])
    assert h.hash_blocks([1, 2], [bytearray(b"ab")]) == as_bytes
    assert h.hash_blocks([1, 2], [memoryview(b"ab")]) == as_bytes
    # A bytearray in a tuple: hashed as bytes, though declared element types are str|bytes|int.
    assert h.hash_blocks([1, 2], [("x", bytearray(b"ab"))]) == h.hash_blocks([1, 2], [("x", b"ab")])  # type: ignore[list-item]
    assert h.hash_blocks([1, 2], [bytearray(b"ab")]) != h.hash_blocks([1, 2], [[97, 98]])


@pytest.mark.parametrize("bad", [np.float32(3), 1.5, (x for x in "ab")])
def test_extra_keys_of_another_type_are_clear_errors(bad: Any) -> None:
    with pytest.raises(TypeError, match=f"extra keys .* have type {type(bad).__name__}; expected"):
        encode_extra_keys(bad)


def test_bad_parent() -> None:
    h = BlockHasher(2)
    with pytest.raises(ValueError, match="expected 32 bytes"):
        h.hash_blocks([1, 2], parent=b"short")


def test_missing_xxhash_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def fake_import(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "xxhash":
            raise ImportError("No module named 'xxhash'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "xxhash", raising=False)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match=r"pip install kvtier\[xxhash\]"):
        BlockHasher(16, algorithm="xxh3_128")


def test_chunk_keys_use_each_full_chunks_last_block_hash() -> None:
    hashes = BlockHasher(1).hash_blocks(list(range(7)))
    keys = chunk_keys(hashes, 3, group_idx=2)
    assert [get_offload_block_hash(k) for k in keys] == [hashes[2], hashes[5]]
    assert {get_offload_group_idx(k) for k in keys} == {2}
    assert [get_offload_block_hash(k) for k in chunk_keys(hashes, 1)] == hashes
    assert chunk_keys(hashes[:2], 3) == []


@pytest.mark.parametrize(
    ("bpc", "gidx", "match"), [(0, 0, "blocks_per_chunk=0"), (1, -1, "group_idx=-1")]
)
def test_chunk_keys_bad_input(bpc: int, gidx: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        chunk_keys([], bpc, gidx)


@pytest.mark.parametrize("bare", ["ab", b"ab", bytearray(b"ab"), memoryview(b"ab")])
def test_a_bare_str_or_bytes_is_not_one_extra_key_per_character(bare: Any) -> None:
    # A salt or LoRA name passed as the whole `extra_keys` would be split into one key per
    # character (or byte): salts "ab" and "ac" would then share their first block's hash.
    h = BlockHasher(2)
    with pytest.raises(TypeError, match="one entry per block"):
        h.hash_blocks([1, 2, 3, 4], extra_keys=bare)
    # The intended spelling still works, and keeps different salts apart from the first block.
    ab, ac = h.hash_blocks([1, 2, 3, 4], ["ab"] * 2), h.hash_blocks([1, 2, 3, 4], ["ac"] * 2)
    assert ab[0] != ac[0]
