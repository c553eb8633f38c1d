"""Review of block hashing: per-block str and bytes extra keys that look alike.

`hash_blocks` memoised the encoding of str and bytes extra keys in one dict. "a" and b"a" have
the same hash, so the lookup compared them, which warns under `python -b` and raises
BytesWarning under `python -bb`: a request whose blocks mixed a str and a bytes key failed to
hash at all in such a process.
"""

from __future__ import annotations

import subprocess
import sys

from kvtier.hashing import BlockHasher

_CHILD = """
from kvtier.hashing import BlockHasher
h = BlockHasher(1)
print(",".join(x.hex() for x in h.hash_blocks([1, 2, 3], extra_keys=["a", b"a", "a"])))
"""


def _chained(hasher: BlockHasher, tokens: list[int], keys: list[str | bytes]) -> list[bytes]:
    """Block by block, each from its parent: no memo shared between blocks."""
    hashes: list[bytes] = []
    for tok, key in zip(tokens, keys, strict=True):
        parent = hashes[-1] if hashes else None
        hashes += hasher.hash_blocks([tok], extra_keys=[key], parent=parent)
    return hashes


def test_str_and_bytes_extra_keys_that_look_alike_hash_under_python_bb() -> None:
    out = subprocess.run(
        [sys.executable, "-bb", "-c", _CHILD],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    want = _chained(BlockHasher(1), [1, 2, 3], ["a", b"a", "a"])
    assert out.stdout.strip() == ",".join(x.hex() for x in want)
