"""The fixed-size memory of `kvaware`: a count-min sketch of recent access counts that outlives
eviction, and the process-independent key hash it is indexed by."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

from kvtier.base import OffloadKey, checked_int

M64: Final = (1 << 64) - 1
MAX_COUNT: Final = 15
# Counters per row at most: a row is indexed by the top bits of a 64-bit product, and the four
# rows (4 * 2**60 bytes) must still fit a bytearray's size (sys.maxsize).
MAX_WIDTH: Final = 1 << 60
# Odd 64-bit multipliers, one per sketch row.
_R0, _R1, _R2, _R3 = (
    0x9E3779B97F4A7C15,
    0xC2B2AE3D27D4EB4F,
    0x165667B19E3779F9,
    0xD6E8FEB86659FD93,
)
_HALVE = bytes(v >> 1 for v in range(256))


def key_hash(key: object) -> int:
    """A hash of `key` that is the same in every process (`hash()` of bytes is salted); a key
    that is not bytes is refused."""
    # A bytes subclass too (numpy.bytes_): equal to the plain key, it must count with it, and
    # its inherited hash() is salted.
    if type(key) is bytes or isinstance(key, bytes):
        return hash(int.from_bytes(key, "big"))
    # hash() of a str (or of a tuple holding one) is salted per process: returned, it broke
    # the promise above without a word.
    raise TypeError(f"offload keys are bytes; got {type(key).__name__} {key!r:.80}")


# One key passed where a list was expected: iterating it yields ints (or one-char strs).
_ONE_KEY = (bytes, bytearray, memoryview, str)


def checked_keys(keys: Iterable[OffloadKey]) -> Sequence[OffloadKey]:
    """`keys` as a list or tuple of bytes keys, else a TypeError naming the first bad one.

    Called before a policy call changes anything: a key that is not bytes has no hash that is
    the same in every process (a str's is salted), and one that cannot be hashed raised only
    when the call reached it, after the keys before it had moved and been counted."""
    if not isinstance(keys, (list, tuple)):
        if isinstance(keys, _ONE_KEY):
            raise TypeError(
                f"keys={keys!r:.80} is one {type(keys).__name__} object; expected a list of "
                "offload keys (bytes)"
            )
        try:
            keys = list(keys)
        except TypeError:
            raise TypeError(
                f"keys={keys!r:.80} has type {type(keys).__name__}; expected a list of offload "
                "keys (bytes)"
            ) from None
    for key in keys:
        if type(key) is not bytes and not isinstance(key, bytes):
            raise TypeError(f"offload keys are bytes; got {type(key).__name__} {key!r:.80}")
    return keys


class FrequencySketch:
    """Count-min sketch of recent access counts: 4 rows of `width` one-byte counters capped at
    15, all halved once `period` accesses are counted, so that old popularity fades. The count
    of accesses halves with them (TinyLFU's reset), so later halvings come every `period / 2`
    accesses. Fixed size."""

    def __init__(self, width: int, period: int) -> None:
        # A float width failed on a missing bit_length, a str on "'<' not supported", and a
        # NaN period was taken: `added >= nan` is never true, so the counts never aged.
        try:
            width = checked_int("width", width)
            period = checked_int("period", period)
        except ValueError:
            raise ValueError(
                f"width={width!r}, period={period!r} are invalid; expected both integers >= 1"
            ) from None
        if width > MAX_WIDTH:
            raise ValueError(f"width={width} is invalid; expected at most 2**60 counters per row")
        bits = max(4, (width - 1).bit_length())
        self.width = 1 << bits
        self._shift = 64 - bits
        # Where rows 2 and 3 start, kept rather than multiplied out on every access.
        self._w2 = 2 * self.width
        self._w3 = 3 * self.width
        self._table = bytearray(4 * self.width)
        self._period = period
        self._added = 0

    def estimate(self, h: int) -> int:
        """Recent access count of hash `h` (an over-estimate only through collisions)."""
        # The four cells are computed inline, and their minimum by compares (a min() call
        # costs more than the three): this runs several times per access.
        t, s = self._table, self._shift
        low = t[((h * _R0) & M64) >> s]
        cell = t[self.width + (((h * _R1) & M64) >> s)]
        if cell < low:
            low = cell
        cell = t[self._w2 + (((h * _R2) & M64) >> s)]
        if cell < low:
            low = cell
        cell = t[self._w3 + (((h * _R3) & M64) >> s)]
        return cell if cell < low else low

    def estimate_key(self, key: object) -> int:
        """`estimate(key_hash(key))`, the hash inline (this is on every eviction's path)."""
        return self.estimate(
            hash(int.from_bytes(key, "big"))
            if type(key) is bytes or isinstance(key, bytes)
            else key_hash(key)
        )

    def add(self, h: int) -> int:
        """Count one access of hash `h` and return its new estimate."""
        t, s = self._table, self._shift
        a = ((h * _R0) & M64) >> s
        b = self.width + (((h * _R1) & M64) >> s)
        c = self._w2 + (((h * _R2) & M64) >> s)
        d = self._w3 + (((h * _R3) & M64) >> s)
        # The cells lie in four rows, so none aliases another: each is read once.
        ta, tb, tc, td = t[a], t[b], t[c], t[d]
        low = ta if ta < tb else tb
        if tc < low:
            low = tc
        if td < low:
            low = td
        if low < MAX_COUNT:
            # Conservative update: only the counters at the minimum rise.
            low += 1
            if ta < low:
                t[a] = low
            if tb < low:
                t[b] = low
            if tc < low:
                t[c] = low
            if td < low:
                t[d] = low
        added = self._added + 1
        if added >= self._period:
            self._table = t.translate(_HALVE)
            added //= 2
            low >>= 1  # halving is monotone: the minimum halves with its cells
        self._added = added
        return low

    def clear(self) -> None:
        """Forget every count."""
        self._table = bytearray(len(self._table))
        self._added = 0

    def __len__(self) -> int:
        return len(self._table)
