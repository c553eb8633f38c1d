"""Types shared by every part of kvtier: keys, request context, specs, events, the manager ABC.

Everything here is plain Python plus numpy, so the scheduler side and the simulator import it
without torch or an engine.
"""

from __future__ import annotations

import enum
import numbers
import operator
import os
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NewType

import numpy as np
import numpy.typing as npt

OffloadKey = NewType("OffloadKey", bytes)
"""A chunk's identity: its last block hash followed by its 4-byte big-endian KV-cache group."""

_GROUP_BYTES = 4
_MAX_GROUP = (1 << (8 * _GROUP_BYTES)) - 1


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Pack a block hash and a KV-cache group index into an `OffloadKey`."""
    if not isinstance(block_hash, (bytes, bytearray, memoryview)):
        # bytes(5) would silently be five zero bytes: every int hash would collide by length.
        raise TypeError(
            f"block_hash={block_hash!r} has type {type(block_hash).__name__}; expected bytes"
        )
    if type(group_idx) is not int:
        index = _as_index(group_idx)
        if index is None:
            # A bool would be group 1 (or 0), colliding with that group's keys.
            raise TypeError(
                f"group_idx={group_idx!r} has type {type(group_idx).__name__}; expected int"
            )
        group_idx = index
    if not 0 <= group_idx <= _MAX_GROUP:
        raise ValueError(f"group_idx={group_idx} is out of range; expected 0..{_MAX_GROUP}")
    return OffloadKey(bytes(block_hash) + group_idx.to_bytes(_GROUP_BYTES, "big"))


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """Return the block hash part of `key`."""
    return key[:-_GROUP_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    """Return the KV-cache group index part of `key`."""
    return int.from_bytes(key[-_GROUP_BYTES:], "big")


@dataclass(slots=True)
class ReqContext:
    """What the manager and its policies may know about the request behind a call.

    `key_positions` maps a key to the token position where its chunk ends, so a policy can
    tell a prefix's head (small positions) from its tail.
    """

    req_id: str
    kv_transfer_params: Mapping[str, Any] | None = None
    key_positions: dict[OffloadKey, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if type(self.req_id) is not str and not isinstance(self.req_id, str):
            # Policies key per-request tables by it: an unhashable id failed part-way
            # through a manager call, after the manager had changed its state.
            raise TypeError(
                f"req_id={self.req_id!r} has type {type(self.req_id).__name__}; expected str"
            )
        positions = self.key_positions
        if type(positions) is not dict and not isinstance(positions, dict):
            # A list or a mapping of another kind failed deep inside a policy, mid-call.
            raise TypeError(
                f"key_positions={positions!r} has type {type(positions).__name__}; expected "
                "a dict of offload key -> token position"
            )

    def position(self, key: OffloadKey) -> int | None:
        """Token position where `key`'s chunk ends in this request, if known."""
        return self.key_positions.get(key)


class LookupResult(enum.Enum):
    """Answer of `OffloadingManager.lookup`."""

    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"
    """The chunk is being written; ask again later."""
    RETRY = "retry"
    """The location is not known yet (e.g. an asynchronous probe of a slower tier)."""


class LoadStoreSpec:
    """Where a worker finds (load) or puts (store) the bytes of a list of chunks."""

    medium: str = "unknown"


class BlockIDsLoadStoreSpec(LoadStoreSpec):
    """A spec addressed by integer ids (host slots or device blocks), co-indexed with keys.

    The numpy array is built on first use: a trace replay never looks at it, an engine does.
    """

    __slots__ = ("_array", "_ids")

    def __init__(self, block_ids: npt.ArrayLike) -> None:
        self._ids = block_ids
        self._array: npt.NDArray[np.int64] | None = None

    @property
    def block_ids(self) -> npt.NDArray[np.int64]:
        """The ids as a 1-D int64 array."""
        if self._array is None:
            self._array = np.asarray(self._ids, dtype=np.int64).reshape(-1)
        return self._array

    def __len__(self) -> int:
        return int(self.block_ids.shape[0])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.block_ids.tolist()})"


@dataclass(slots=True)
class PrepareStoreOutput:
    """Result of `prepare_store`: which keys to write, where, and what was evicted for room."""

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass(slots=True)
class OffloadingEvent:
    """A public change of a tier's contents: keys stored (`removed=False`) or removed."""

    keys: list[OffloadKey]
    medium: str
    removed: bool


@dataclass(slots=True)
class TransferResult:
    """Outcome of one transfer job as reported by a worker. `bytes` and `seconds` are 0 for a
    failed job: its copies may have stopped part-way, and a GPU's events may not time them."""

    job_id: int
    success: bool
    bytes: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class ManagerStats:
    """Counters and gauges of a manager. Counters are cumulative since the manager was created
    (`reset_cache` forgets the keys, not the counts); gauges describe the present."""

    num_slots: int
    used_slots: int
    ready: int
    pinned: int
    pending_writes: int
    hits: int
    misses: int
    loads: int
    stores: int
    failed_stores: int
    stores_skipped: int
    evictions: int
    stores_no_room: int = 0
    """Keys absent from the tier that a `prepare_store` turned away because no room could be
    made (every slot pinned or being written): the call returned None. All of them, whatever
    admission decided (a policy that previews learns nothing from such a call), at every such
    call: kvtier's connector offers the same chunks again once the tier has more room."""

    @property
    def usage(self) -> float:
        """Fraction of slots in use (ready, pinned or being written)."""
        return self.used_slots / self.num_slots if self.num_slots else 0.0


class OffloadingManager(ABC):
    """Scheduler-side bookkeeping of one tier: what is where, what to evict, what to admit.

    Keys move absent -> pending-write -> ready <-> pinned, and ready -> absent by eviction
    (DESIGN §2). Methods take the keys they act on and never scan the whole pool.
    """

    medium: str = "unknown"

    @abstractmethod
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """Say whether `key` can be loaded now. Has no side effects."""

    @abstractmethod
    def prepare_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> LoadStoreSpec:
        """Pin ready `keys` against eviction and say where to read them (co-indexed)."""

    @abstractmethod
    def complete_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        """Unpin `keys` after a load finished (successfully or not)."""

    @abstractmethod
    def touch(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        """Record a use of `keys` (e.g. they hit in the device cache) for the cache policy."""

    @abstractmethod
    def prepare_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        """Reserve room for the keys worth storing; `None` means no room now and no change
        (but for the `stores_no_room` counter)."""

    @abstractmethod
    def complete_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        """Make stored keys readable, or forget them without a trace if the store failed."""

    def on_new_request(self, ctx: ReqContext) -> None:  # noqa: B027 - optional hook
        """Called once when the engine first sees a request."""

    def on_request_finished(self, ctx: ReqContext) -> None:  # noqa: B027 - optional hook
        """Called once when a request ends; its transfers may still complete afterwards."""

    def prefix_extended(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:  # noqa: B027
        """`keys`, head first, are a request's chunks before (and up to) chunks its store just
        added: its prompt stored over several steps (chunked prefill), or its reply after its
        prompt. Not a use. A policy that orders chunks by recency ranks them, head last, above
        what the store added, so that the request's prefix is evicted from its tail, as when
        the whole prefix is stored in one call."""

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Return the events collected since the last call, oldest first."""
        return ()

    @abstractmethod
    def reset_cache(self) -> None:
        """Forget every key. A completion of a job prepared before the reset is the caller's
        to drop (the connector tags jobs with a generation): the manager cannot tell it from
        a completion of the same key stored again since."""

    def on_reset_flushed(self) -> None:  # noqa: B027 - optional hook
        """Every transfer in flight at the last reset has finished; its room may be reused."""

    @abstractmethod
    def get_stats(self) -> ManagerStats:
        """Return the manager's counters and gauges."""


def _as_index(value: object) -> int | None:
    """`value` as an int when it is one integer (anything with `__index__`: numpy ints, 0-d
    integer tensors), else None: a bool, a float, an array or a tensor of several values.
    torch's `__index__` takes tensor(True) as 1 and tensor([5]) as 5: refused here by their
    dtype and shape, without importing torch."""
    if (
        isinstance(value, bool)
        or getattr(value, "ndim", 0) != 0
        or str(getattr(value, "dtype", "")) == "torch.bool"
    ):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:  # no __index__, or a numpy array that is not one integer
        return None


def checked_fraction(name: str, value: object) -> float:
    """`value` as a float strictly between 0 and 1, else a ValueError naming `name` and the
    value. Any real number counts (numpy floats included); a bool, a str or NaN does not."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        f = float(value)
        if 0.0 < f < 1.0:
            return f
    raise ValueError(f"{name}={value!r} is invalid; expected a number, 0 < {name} < 1")


def checked_int(name: str, value: object, minimum: int = 1) -> int:
    """`value` as an int of at least `minimum`, else a ValueError naming `name` and the value.
    Anything with `__index__` counts (numpy ints, 0-d integer tensors); a float (even 2.0), a
    bool or NaN is refused rather than rounded: a count given as one is a caller's mistake,
    and NaN would disable every comparison with it."""
    n = _as_index(value)
    if n is None or n < minimum:
        raise ValueError(f"{name}={value!r} is invalid; expected an integer >= {minimum}")
    return n


TRUE_WORDS: Final = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS: Final = frozenset({"0", "false", "no", "off"})
"""The spellings of a boolean setting, in a config file, the environment or a switch."""


def env_flag(name: str, default: bool) -> bool:
    """The boolean environment variable `name` (`default` when unset or blank), read as the
    config reads booleans: `KVTIER_NATIVE_COPY=false` was taken for "on", since only `0`
    switched it off."""
    raw = os.environ.get(name, "")
    word = raw.strip().lower()
    if not word:
        return default
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(
        f"{name}={raw!r} is invalid; expected a boolean (true/false, yes/no, on/off, 1/0)"
    )
