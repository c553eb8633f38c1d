"""Second-pass review of kvtier's core: defects found, each pinned by a test.

- Hashing: a str holding a lone surrogate (what `os.fsdecode` makes of a path byte that is not
  UTF-8, or JSON's "\\ud800") raised a bare UnicodeEncodeError as a namespace or an extra key.
- Hashing: a `parent` of the right length but not `bytes` was told only "expected 32 bytes".
- Manager: an admission plugin that answered with an unhashable key (a key wrapped in a list)
  failed with a bare "unhashable type: 'list'", naming neither the policy nor what was expected.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from helpers import key, keys, outputs_under_hash_seeds
from kvtier.admission import AdmissionPolicy
from kvtier.base import LookupResult, OffloadKey, ReqContext, make_offload_key
from kvtier.cpu import CPUOffloadingManager
from kvtier.hashing import BlockHasher, chunk_keys, encode_extra_keys

# A model directory whose name is Latin-1, not UTF-8: os.fsdecode keeps the byte as U+DCE9.
LATIN1_PATH = os.fsdecode(b"/models/caf\xe9-7b")


def test_a_namespace_from_a_path_that_is_not_utf8_hashes() -> None:
    hasher = BlockHasher(2, namespace=LATIN1_PATH)
    # Its own namespace: neither the bytes of the path, nor the same name spelt in UTF-8.
    others = {
        BlockHasher(2, namespace=os.fsencode(LATIN1_PATH)).root_hash,
        BlockHasher(2, namespace="/models/café-7b").root_hash,
        BlockHasher(2).root_hash,
    }
    assert hasher.root_hash not in others
    assert len(hasher.hash_blocks([1, 2, 3, 4])) == 2


@pytest.mark.parametrize("salt", ["salt-\ud800", LATIN1_PATH, "\udfff"])
def test_an_extra_key_with_a_lone_surrogate_hashes_apart_from_others(salt: str) -> None:
    hasher = BlockHasher(2)
    hashes = hasher.hash_blocks([1, 2], extra_keys=[salt])
    assert hashes != hasher.hash_blocks([1, 2], extra_keys=["salt-"])
    assert hashes != hasher.hash_blocks([1, 2])
    # Distinct strs never share an encoding: the two surrogates that UTF-8-decode from "é"'s
    # bytes under surrogateescape are not "é".
    assert encode_extra_keys([salt, "\udcc3\udca9"]) != encode_extra_keys([salt, "é"])
    # A str without a lone surrogate keeps UTF-8's bytes, so no existing hash changes.
    assert encode_extra_keys([salt, "ключ"]).endswith(
        b"s" + (8).to_bytes(8, "little") + "ключ".encode()
    )


def test_a_surrogate_namespace_hashes_alike_in_every_process() -> None:
    code = (
        "import os; from kvtier.hashing import BlockHasher; "
        "h = BlockHasher(2, namespace=os.fsdecode(b'caf\\xe9')); "
        "print(h.hash_blocks([1, 2], extra_keys=['\\udc80'])[0].hex())"
    )
    outputs = outputs_under_hash_seeds(code, ("1", "2"))
    assert len(outputs) == 1


@pytest.mark.parametrize("wrap", [bytearray, memoryview])
def test_a_parent_that_is_not_bytes_is_named_by_its_type(wrap: type) -> None:
    hasher = BlockHasher(2)
    parent = hasher.hash_blocks([1, 2])[0]
    with pytest.raises(ValueError, match=f"parent=.* of type {wrap.__name__} is not a sha256"):
        hasher.hash_blocks([3, 4], parent=wrap(parent))


class WrappingAdmission(AdmissionPolicy):
    """A plugin's bug: every admitted key comes back wrapped in a list (from `preview`, or
    from `admit` when `previews` is off)."""

    previews = True

    def admit(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
        return [[k] for k in keys]  # type: ignore[misc]

    def preview(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[OffloadKey] | None:
        return self.admit(keys, ctx) if self.previews else None


@pytest.mark.parametrize("previews", [True, False])
def test_an_admission_plugin_answering_an_unhashable_key_is_named(previews: bool) -> None:
    admission = WrappingAdmission()
    admission.previews = previews
    m = CPUOffloadingManager(4, admission=admission)
    ctx = ReqContext("r1")
    with pytest.raises(
        ValueError,
        match=r"admission policy \S*WrappingAdmission returned \[b'.*'\], "
        r"which was not offered; expected a subset of the offered keys",
    ):
        m.prepare_store(keys(1, 2), ctx)
    stats = m.get_stats()
    assert (stats.used_slots, stats.pending_writes, stats.stores_skipped) == (0, 0, 0)
    assert m.table_sizes()["slot_of"] == 0
    assert m.lookup(key(1), ctx) is LookupResult.MISS


def test_numpy_integer_extra_keys_hash_as_the_equal_int() -> None:
    # They were refused ("has type int64"), though token ids accept numpy's integers.
    hasher = BlockHasher(2)
    want = hasher.hash_blocks([1, 2], extra_keys=[[7, "lora"]])
    numpy_keys: Any = [[np.int64(7), "lora"]]
    assert hasher.hash_blocks([1, 2], extra_keys=numpy_keys) == want
    one: Any = np.uint8(7)
    assert encode_extra_keys(one) == encode_extra_keys(7)
    negative: Any = [np.int32(-3)]
    assert encode_extra_keys(negative) != encode_extra_keys([3])
    bad: Any
    for bad in (np.bool_(True), [np.timedelta64(7)], [np.float64(7)]):
        with pytest.raises(TypeError, match="expected"):
            encode_extra_keys(bad)


def test_chunk_keys_refuse_a_numpy_bytes_array() -> None:
    # numpy's "S" items drop trailing NUL bytes: a hash ending in 0x00 made another key.
    hashes = [bytes(31) + b"\x01", bytes(31) + b"\x00"]
    as_array: Any = np.array(hashes, dtype="S32")
    with pytest.raises(TypeError, match=r"dtype \|S32, whose items lose trailing NUL bytes"):
        chunk_keys(as_array, 1)
    assert chunk_keys(hashes, 1)[1] == make_offload_key(hashes[1], 0)
