"""Turn a submit call into a validated job: which device rows pair with which host rows.

Host row `slot * blocks_per_chunk + j` holds block `j` of the chunk in `slot`. All index maths
is vectorised with numpy; a bad argument raises ValueError naming it before anything is queued.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

import numpy as np
import numpy.typing as npt

IndexArray = npt.NDArray[np.int64]
IdsLike = npt.NDArray[np.integer] | Sequence[int]


class Direction(enum.Enum):
    """Which way a job moves bytes."""

    STORE = "store"
    """device blocks -> host slots"""
    LOAD = "load"
    """host slots -> device blocks"""


@dataclass(frozen=True, slots=True)
class Job:
    """A validated transfer: `dev_rows[i]` pairs with host row `host_rows[i]`."""

    job_id: int
    direction: Direction
    group: int
    dev_rows: IndexArray
    host_rows: IndexArray
    nbytes: int
    dev_run: int | None
    """First device row if `dev_rows` is one ascending run (enables a one-pass copy)."""
    host_run: int | None
    """First host row if `host_rows` is one ascending run."""
    urgent: bool = False
    runs: tuple[list[int], list[int], list[int]] | None = None
    """(device starts, host starts, lengths) of the job's runs of consecutive rows on both
    sides, set only when runs are long enough (RUN_BYTES on average) to copy one by one."""

    def __len__(self) -> int:
        return int(self.dev_rows.shape[0])


def _ids(name: str, values: IdsLike, limit: int) -> IndexArray:
    """Validate integer ids in `[0, limit)` and return them as a 1-D int64 array."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        if arr.size:
            return _exact_ids(name, values, arr, limit)
        return np.empty(0, dtype=np.int64)  # `[]` arrives as float64
    if bool_among(values):
        at = next(i for i, v in enumerate(values) if bool_among([v]))
        raise ValueError(f"{name} must hold integers, got {values[at]!r} at index {at}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) >= limit:
        raise ValueError(f"{name} contains {int(arr.max())}, outside 0..{limit - 1}")  # unwrapped
    # The job is copied later, on another thread: its rows must not be the caller's array (or
    # a view of it, as `np.asarray` gives of a tensor), which the caller may reuse at once.
    # Only a list, tuple or range surely gives a new array: another object's `__array__` may
    # hand out the object's own buffer, with no base to tell.
    own = not isinstance(values, (list, tuple, range))
    arr = arr.astype(np.int64, copy=own)
    # One pass on the hot path: as unsigned, a negative id is larger than any limit.
    if arr.size and int(arr.view(np.uint64).max()) >= limit:
        lo, hi = int(arr.min()), int(arr.max())
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} contains {bad}, outside 0..{limit - 1}")
    return arr


def bool_among(values: object) -> bool:
    """Whether a list or tuple of ids holds a bool (Python's, numpy's, a 0-d bool tensor):
    numpy reads `[3, True]` as the integers 3 and 1, which would copy block 1."""
    if not isinstance(values, (list, tuple)) or set(map(type, values)) <= {int}:
        return False
    return any(
        isinstance(v, (bool, np.bool_)) or str(getattr(v, "dtype", "")) in ("bool", "torch.bool")
        for v in values
    )


def _exact_ids(name: str, values: IdsLike, arr: npt.NDArray[np.generic], limit: int) -> IndexArray:
    """Integers that numpy could not give an integer dtype: a list mixing `np.uint64` with
    `int` arrives as float64, one holding an int beyond 64 bits as object. Taken one by one
    (off the hot path), so that valid ids are accepted and a bad one is named."""
    items: object = arr.tolist() if arr.dtype.kind == "O" else values
    if isinstance(items, (list, tuple)) and all(
        isinstance(v, Integral) and not isinstance(v, bool) for v in items
    ):
        ints = [int(v) for v in items]
        bad = next((v for v in ints if not 0 <= v < limit), None)
        if bad is not None:
            raise ValueError(
                f"{name} contains {bad}, outside 0..{limit - 1}: it must hold integers in range"
            )
        return np.array(ints, dtype=np.int64)
    raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")


def _unique(name: str, arr: IndexArray) -> None:
    if arr.size > 1:
        s = np.sort(arr)
        dup = s[1:][s[1:] == s[:-1]]
        if dup.size:
            raise ValueError(f"{name} repeats id {int(dup[0])}; each may appear once per job")


def _run_start(arr: IndexArray) -> int | None:
    """First value if `arr` is `a, a+1, a+2, ...`; else None."""
    n = arr.shape[0]
    if n == 0:
        return None
    first = int(arr[0])
    if int(arr[-1]) - first != n - 1:
        return None
    if n > 2 and not bool(np.all(np.diff(arr) == 1)):
        return None
    return first


RUN_BYTES = 512 << 10
"""Average run size from which a job is copied run by run: a Python step then costs a few
microseconds against the tens of microseconds the run's copy takes, and it saves the staging
pass that scattered jobs need."""


def _long_runs(
    dev: IndexArray, host: IndexArray, page: int
) -> tuple[list[int], list[int], list[int]] | None:
    """Runs where both `dev` and `host` go up by one, if they average RUN_BYTES or more."""
    n = dev.shape[0]
    if n < 2 or n * page < RUN_BYTES:
        return None
    breaks = (np.diff(dev) != 1) | (np.diff(host) != 1)
    count = int(np.count_nonzero(breaks))
    if n * page < RUN_BYTES * (count + 1):
        return None
    starts = [0, *(np.flatnonzero(breaks) + 1).tolist()]
    lengths = [b - a for a, b in zip(starts, [*starts[1:], n], strict=True)]
    return dev[starts].tolist(), host[starts].tolist(), lengths


class JobPlanner:
    """Validates submit arguments against a registration and pool, and builds `Job`s."""

    def __init__(
        self, num_blocks: int, num_slots: int, blocks_per_chunk: int, page_bytes: dict[int, int]
    ) -> None:
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.bpc = blocks_per_chunk
        self.page_bytes = page_bytes
        self._offsets = np.arange(blocks_per_chunk, dtype=np.int64)

    def _check_group(self, group: int) -> int:
        if group not in self.page_bytes:
            raise ValueError(
                f"group={group!r} is not registered; groups are {list(self.page_bytes)}"
            )
        return self.page_bytes[group]

    def _host_rows(self, slots: IndexArray) -> IndexArray:
        if self.bpc == 1:
            return slots
        return (slots[:, None] * self.bpc + self._offsets[None, :]).reshape(-1)

    def store(self, job_id: int, device_blocks: IdsLike, slots: IdsLike, group: int) -> Job:
        """Plan a store of whole chunks: `len(device_blocks) == len(slots) * blocks_per_chunk`."""
        page = self._check_group(group)
        dev = _ids("device_blocks", device_blocks, self.num_blocks)
        sl = _ids("slots", slots, self.num_slots)
        if dev.shape[0] != sl.shape[0] * self.bpc:
            raise ValueError(
                f"a store writes whole chunks: len(device_blocks)={dev.shape[0]} must equal "
                f"len(slots)={sl.shape[0]} x blocks_per_chunk={self.bpc}"
            )
        _unique("slots", sl)
        host = self._host_rows(sl)
        return Job(
            job_id, Direction.STORE, group, dev, host, dev.shape[0] * page,
            _run_start(dev), _run_start(host), False, _long_runs(dev, host, page),
        )  # fmt: skip

    def load(
        self,
        job_id: int,
        slots: IdsLike,
        device_blocks: IdsLike,
        group: int,
        skip_blocks: int,
        urgent: bool,
    ) -> Job:
        """Plan a load of consecutive blocks of the slots' chunks, from `skip_blocks` on."""
        page = self._check_group(group)
        sl = _ids("slots", slots, self.num_slots)
        dev = _ids("device_blocks", device_blocks, self.num_blocks)
        if isinstance(skip_blocks, bool) or not isinstance(skip_blocks, int):
            raise ValueError(f"skip_blocks={skip_blocks!r} must be an int")
        if not 0 <= skip_blocks < self.bpc:
            raise ValueError(f"skip_blocks={skip_blocks} must be in 0..{self.bpc - 1}")
        n, cap = dev.shape[0], sl.shape[0] * self.bpc - skip_blocks
        # Every slot passed must contribute at least one block, and no block may be left out
        # (`n > 0` too: a single slot with skip_blocks > 0 has cap - bpc < 0).
        if not (max(cap - self.bpc, 0) < n <= cap) and not (n == 0 and sl.shape[0] == 0):
            raise ValueError(
                f"len(device_blocks)={n} does not fit len(slots)={sl.shape[0]} chunks of "
                f"{self.bpc} blocks starting at skip_blocks={skip_blocks}: expected "
                f"{max(cap - self.bpc + 1, 1)}..{cap}"
            )
        _unique("device_blocks", dev)
        host = self._host_rows(sl)[skip_blocks : skip_blocks + n]
        return Job(
            job_id, Direction.LOAD, group, dev, host, n * page,
            _run_start(dev), _run_start(host), urgent, _long_runs(dev, host, page),
        )  # fmt: skip
