"""Chained prefix block hashes over token ids, identical in every process.

A block's hash identifies its tokens *and* everything before them: it is
`H(parent || tokens || extra keys)`, where `parent` is the previous block's hash, or for the
first block a root hash derived from the namespace (the model's identity), the algorithm and
the block size, so two models, or two block sizes, never share a hash. Tokens are encoded as
fixed-width little-endian uint32 and extra keys with a length-prefixed encoding, so within one
hasher distinct inputs never encode to the same bytes. Python's `hash()`
is never used: it changes with `PYTHONHASHSEED`.
"""

from __future__ import annotations

import hashlib
import reprlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, TypeAlias

import numpy as np
import numpy.typing as npt

from kvtier.base import OffloadKey, checked_int, make_offload_key

ExtraKey: TypeAlias = str | bytes | int
"""One extra key of a block: a LoRA name, a multimodal input hash, a cache salt, ..."""

ExtraKeys: TypeAlias = ExtraKey | Sequence[ExtraKey]
"""A block's extra keys; a bare `str`, `bytes` or `int` counts as one key."""

HASH_ALGORITHMS: Final = ("sha256", "xxh3_128")
"""Supported hash algorithms; `sha256` is the default."""

_DIGEST_SIZES: Final = {"sha256": 32, "xxh3_128": 16}
_ROOT_TAG: Final = b"kvtier.block_hash.v2"
_TOKEN_DTYPE: Final = np.dtype("<u4")
_MAX_TOKEN: Final = int(np.iinfo(np.uint32).max)
# Type tags keep b"1", "1" and 1 apart; the 8-byte length keeps ("ab", "c") apart from ("a", "bc").
_TAG_STR: Final = b"s"
_TAG_BYTES: Final = b"b"
_TAG_INT: Final = b"i"
_BOOLS: Final = frozenset({"bool", "torch.bool"})  # str() of numpy's and torch's bool dtypes


def _utf8(text: str) -> bytes:
    """`text` as UTF-8, lone surrogates included: `os.fsdecode` leaves one for each byte of a
    path that is not UTF-8 (and JSON's "\\ud800" makes one), which strict UTF-8 refused with a
    UnicodeEncodeError naming neither the key nor the namespace. "surrogatepass" is one-to-one
    and leaves the bytes of every other str as they were, so no existing hash changes."""
    return text.encode("utf-8", "surrogatepass")


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _load_xxh3_128() -> Callable[[bytes], bytes]:
    try:
        import xxhash
    except ImportError as e:
        raise ImportError(
            "hash algorithm 'xxh3_128' needs the xxhash package; "
            "install it with `pip install kvtier[xxhash]`"
        ) from e
    fn: Callable[[bytes], bytes] = xxhash.xxh3_128_digest
    return fn


def _len_prefixed(tag: bytes, payload: bytes) -> bytes:
    return tag + len(payload).to_bytes(8, "little") + payload


def encode_extra_keys(keys: ExtraKeys | None) -> bytes:
    """Canonical bytes of one block's extra keys; `None` and `()` both encode to `b""`.

    `keys` is one key or a sequence (list, tuple) of them. Raises `TypeError` for a key that is
    not `str`, `bytes` (`bytearray` and `memoryview` count as bytes) or an integer (`int` or
    numpy's, which encodes as the equal `int`; bools excluded, so a flag is never mistaken for
    the number 1), and for a collection without a fixed order (a set's order of strings
    changes between processes).
    """
    if keys is None:
        return b""
    items: Sequence[object]
    if isinstance(keys, (str, bytes, bytearray, memoryview, int, np.integer)):
        items = (keys,)
    elif isinstance(keys, Sequence):
        items = keys
    else:
        raise TypeError(
            f"extra keys {keys!r} have type {type(keys).__name__}; expected a str, bytes or "
            "int, or a sequence (list, tuple) of them"
        )
    parts = [len(items).to_bytes(4, "little")] if items else []
    for key in items:
        # numpy's integers count, as in token ids (a LoRA id read from an array); its
        # timedelta64 is an integer subtype, not a number.
        if isinstance(key, (bool, np.bool_, np.timedelta64)) or not isinstance(
            key, (str, bytes, bytearray, memoryview, int, np.integer)
        ):
            raise TypeError(
                f"extra key {key!r} has type {type(key).__name__}; expected str, bytes or int"
            )
        if isinstance(key, str):
            parts.append(_len_prefixed(_TAG_STR, _utf8(key)))
        elif not isinstance(key, (int, np.integer)):
            # bytes(), not iteration: bytearray(b"ab") is one bytes key, never the ints 97, 98.
            parts.append(_len_prefixed(_TAG_BYTES, bytes(key)))
        else:
            # Decimal text gives every int, however large or negative, one encoding. int() first:
            # str() of an int subclass may be its own (`class E(int, Enum)` gives "E.A").
            parts.append(_len_prefixed(_TAG_INT, _decimal(int(key))))
    return b"".join(parts)


# Digits per piece when str() refuses a whole int: below the lowest limit Python allows (640).
_PIECE_DIGITS: Final = 600


def _decimal(n: int) -> bytes:
    """`str(n)` as ASCII, also beyond `sys.get_int_max_str_digits()`, a per-process setting: a
    key must encode the same in every process, or fail in none."""
    try:
        return str(n).encode("ascii")
    except ValueError:
        pass
    sign, n = ("-", -n) if n < 0 else ("", int(n))
    pieces = []
    base = 10**_PIECE_DIGITS
    while n:
        n, piece = divmod(n, base)
        pieces.append(str(piece).zfill(_PIECE_DIGITS))
    return (sign + "".join(reversed(pieces)).lstrip("0")).encode("ascii")


def _as_token_array(token_ids: Sequence[int] | npt.NDArray[np.integer]) -> npt.NDArray[np.uint32]:
    # asarray, not fromiter(dtype=int64): fromiter silently turns 1.5 and "3" into ints.
    arr = np.asarray(token_ids)
    is_array = isinstance(token_ids, np.ndarray) or hasattr(token_ids, "__array__")
    if arr.ndim == 0 and not is_array:
        # A generator, map, set or str becomes one object, not ids: "has shape ()" named
        # neither what was given nor what to give instead.
        raise TypeError(
            f"token_ids {reprlib.repr(token_ids)} has type {type(token_ids).__name__}; expected a "
            "1-D sequence of token ids: a list, a tuple or a numpy or torch integer array"
        )
    if arr.ndim != 1:
        raise ValueError(f"token_ids has shape {arr.shape}; expected a 1-D sequence")
    if arr.size == 0:
        return np.empty(0, dtype=_TOKEN_DTYPE)
    if not is_array and arr.dtype.kind in "iu":
        # asarray turns [True, 2] into int64 [1, 2]: a flag would hash as token 1. One pass over
        # the element types in C, far cheaper than the conversion itself.
        types = set(map(type, token_ids))
        if types != {int} and not all(
            issubclass(t, (int, np.integer)) and not issubclass(t, (bool, np.bool_)) for t in types
        ):
            # So are 0-d arrays and torch scalars of a bool dtype; a walk only for such lists.
            for i, tok in enumerate(token_ids):
                if type(tok) in (bool, np.bool_) or str(getattr(tok, "dtype", "")) in _BOOLS:
                    raise TypeError(
                        f"token_ids[{i}]={tok!r} is a bool; expected integer token ids "
                        f"0..{_MAX_TOKEN}"
                    )
    elif arr.dtype.kind not in "iu":
        # The kind, not issubdtype: numpy's timedelta64 is an integer subtype, and its ids
        # hashed as plain ints ([timedelta64(1)] as [1]) or failed inside int().
        if not is_array:
            # float64 or object from a list: a float or str among the ids, an int beyond
            # uint64, or ints numpy cannot hold in one dtype ([np.uint64(1), np.int64(2)]).
            _refuse_token(token_ids, arr.dtype)
            arr = np.array([int(t) for t in token_ids], dtype=_TOKEN_DTYPE)
        else:
            raise TypeError(
                f"token_ids has dtype {arr.dtype}; expected integer token ids 0..2**32-1"
            )
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > _MAX_TOKEN:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is out of range; expected 0..{_MAX_TOKEN}")
    return arr.astype(_TOKEN_DTYPE, copy=False)


def _refuse_token(token_ids: Iterable[object], dtype: np.dtype[Any]) -> None:
    """Raise naming the first element of `token_ids` that is not a token id in 0..2**32-1:
    `TypeError` for a bool, a float or a str, `ValueError` for an int out of range (as for
    ids that fit an int64); return if there is none."""
    for i, tok in enumerate(token_ids):
        error: type[Exception]
        if isinstance(tok, (bool, np.bool_, np.timedelta64)) or not isinstance(
            tok, (int, np.integer)
        ):
            error, why = TypeError, f"a {type(tok).__name__}"
        elif not 0 <= tok <= _MAX_TOKEN:
            error, why = ValueError, "out of range"
        else:
            continue
        raise error(
            f"token_ids[{i}]={tok!r} is {why} (token_ids as an array has dtype {dtype}); "
            f"expected integer token ids 0..{_MAX_TOKEN}"
        )


class BlockHasher:
    """Computes chained hashes of full `block_size`-token blocks under a namespace.

    `algorithm` is `"sha256"` (32-byte hashes, the default) or `"xxh3_128"` (16-byte hashes,
    faster; needs `pip install kvtier[xxhash]`). `namespace` (e.g. the model name and
    revision; a `str` is UTF-8 encoded) seeds the root hash, so hashers with different
    namespaces never produce the same hash. Token ids must be ints (numpy and torch integer
    arrays included; bools and floats are refused) in 0..2**32-1. The hasher does not know the
    model's vocabulary: an id past it but below 2**32 hashes like any other, and is left to
    the engine's embedding lookup to refuse.
    """

    __slots__ = ("_digest", "algorithm", "block_size", "digest_size", "namespace", "root_hash")

    def __init__(
        self, block_size: int, *, algorithm: str = "sha256", namespace: str | bytes = b""
    ) -> None:
        block_size = checked_int("block_size", block_size)
        if algorithm == "sha256":
            self._digest: Callable[[bytes], bytes] = _sha256
        elif algorithm == "xxh3_128":
            self._digest = _load_xxh3_128()
        else:
            raise ValueError(
                f"unknown hash algorithm {algorithm!r}; "
                f"expected one of: {', '.join(HASH_ALGORITHMS)}"
            )
        if isinstance(namespace, str):
            namespace = _utf8(namespace)
        elif not isinstance(namespace, bytes):
            raise TypeError(
                f"namespace {namespace!r} has type {type(namespace).__name__}; "
                "expected str or bytes"
            )
        self.block_size = block_size
        self.algorithm = algorithm
        self.namespace = namespace
        self.digest_size = _DIGEST_SIZES[algorithm]
        # The block size too: a block's bytes are its parent, its tokens and its extra keys,
        # unseparated, so 8 tokens with an extra key could equal 16 tokens without one under
        # hashers that differ only in block size (a tier shared between them).
        self.root_hash: bytes = self._digest(
            _len_prefixed(_TAG_BYTES, _ROOT_TAG)
            + _len_prefixed(_TAG_STR, algorithm.encode("ascii"))
            + _len_prefixed(_TAG_BYTES, namespace)
            + _len_prefixed(_TAG_INT, _decimal(block_size))
        )
        """Parent of a sequence's first block."""

    def __repr__(self) -> str:
        return (
            f"BlockHasher(block_size={self.block_size}, algorithm={self.algorithm!r}, "
            f"namespace={self.namespace!r})"
        )

    def hash_blocks(
        self,
        token_ids: Sequence[int] | npt.NDArray[np.integer],
        extra_keys: Sequence[ExtraKeys | None] | None = None,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """Return one hash per full block of `token_ids`; a trailing partial block is skipped.

        `extra_keys`, when given, holds one entry per block (per full block, or per block
        counting the trailing partial one, whose entry is ignored); `None` means no extra
        keys for that block. `parent` continues a chain: hashing `tokens[k * block_size:]`
        with `parent=hashes[k - 1]` gives `hashes[k:]`.
        """
        tokens = _as_token_array(token_ids)
        bs = self.block_size
        num_full = tokens.shape[0] // bs
        num_all = -(-tokens.shape[0] // bs)
        if parent is None:
            parent = self.root_hash
        elif not isinstance(parent, bytes) or len(parent) != self.digest_size:
            # A bytearray of the right length was told only "expected 32 bytes".
            kind = "" if isinstance(parent, bytes) else f" of type {type(parent).__name__}"
            raise ValueError(
                f"parent={parent!r}{kind} is not a {self.algorithm} block hash; expected "
                f"{self.digest_size} bytes, a bytes object as hash_blocks returns"
            )
        extras: list[bytes] | None = None
        if extra_keys is not None:
            if not isinstance(extra_keys, (Sequence, np.ndarray)) or isinstance(
                extra_keys, (str, bytes, bytearray, memoryview)
            ):
                # A set or dict has no block order; a generator has no length; a bare str or
                # bytes would be one key per character, so salts "ab" and "ac" would share
                # their first block's hash.
                raise TypeError(
                    f"extra_keys has type {type(extra_keys).__name__}; expected a list with "
                    "one entry per block"
                )
            if len(extra_keys) not in (num_full, num_all):
                raise ValueError(
                    f"extra_keys has {len(extra_keys)} entries; expected one per block "
                    f"({num_full} full blocks, {num_all} counting the partial one)"
                )
            # Most blocks of a request share one LoRA name or salt: encode each distinct str or
            # bytes once. Other types skip the memo (1 == True == 1.0 as dict keys). One memo per
            # type: "a" and b"a" hash alike, and comparing them warns (raises under -bb).
            memos: dict[type, dict[object, bytes]] = {str: {}, bytes: {}}
            extras = []
            for entry in extra_keys[:num_full]:
                memo = memos.get(type(entry))
                if memo is None:
                    extras.append(encode_extra_keys(entry))
                    continue
                enc = memo.get(entry)
                if enc is None:
                    enc = memo[entry] = encode_extra_keys(entry)
                extras.append(enc)

        # One tobytes() for the whole prompt, then per-block slices: no per-token Python work.
        data = tokens[: num_full * bs].tobytes()
        step = bs * _TOKEN_DTYPE.itemsize
        digest = self._digest
        hashes: list[bytes] = []
        h = parent
        if extras is None:
            for start in range(0, len(data), step):
                h = digest(h + data[start : start + step])
                hashes.append(h)
        else:
            for i, start in enumerate(range(0, len(data), step)):
                h = digest(h + data[start : start + step] + extras[i])
                hashes.append(h)
        return hashes


def chunk_keys(
    block_hashes: Sequence[bytes], blocks_per_chunk: int, group_idx: int = 0
) -> list[OffloadKey]:
    """Offload keys of the full chunks of `block_hashes`: each chunk's last block hash + group.

    A trailing chunk with fewer than `blocks_per_chunk` blocks gets no key.
    """
    blocks_per_chunk = checked_int("blocks_per_chunk", blocks_per_chunk)
    if isinstance(block_hashes, np.ndarray) and block_hashes.dtype.kind == "S":
        # Its items drop trailing NUL bytes: a hash ending in 0x00 (one in 256) would make a
        # key no list of the same hashes makes, and miss for good.
        raise TypeError(
            f"block_hashes is a numpy array of dtype {block_hashes.dtype}, whose items lose "
            "trailing NUL bytes (tolist() loses them too); expected a list of bytes, as "
            "hash_blocks returns"
        )
    make_offload_key(b"", group_idx)  # validates group_idx even when there is no full chunk
    return [
        make_offload_key(block_hashes[i], group_idx)
        for i in range(blocks_per_chunk - 1, len(block_hashes), blocks_per_chunk)
    ]
