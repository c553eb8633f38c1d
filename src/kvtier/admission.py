"""Admission policies: whether a chunk is worth storing at all.

The manager asks its admission policy once per `prepare_store` about the keys that are not
already present. A rejected key costs nothing: no slot, no eviction, no event.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import ClassVar, TypeVar

from kvtier.base import OffloadKey, ReqContext, checked_int


class AdmissionPolicy(ABC):
    """Decides which offered keys get a slot."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""

    @abstractmethod
    def admit(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
        """Return the subset of `keys` (absent from the tier) worth storing, in order."""

    def preview(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[OffloadKey] | None:
        """What `admit(keys, ctx)` would return, without recording anything; None if this policy
        cannot tell without recording.

        The manager previews first so that a `prepare_store` that finds no room (and returns
        None) leaves the policy untouched; it calls `record` only for a store that goes ahead. A
        stateful policy that returns None here is recorded even for stores that find no room.
        """
        return None

    def record(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Learn from an offer whose decision `preview` gave: `admit` without the answer."""
        self.admit(keys, ctx)

    def clear(self) -> None:  # noqa: B027 - stateless policies need nothing
        """Forget everything learned (called on cache reset)."""

    def table_sizes(self) -> dict[str, int]:
        """Sizes of internal tables, so tests can check their bounds."""
        return {}


_A = TypeVar("_A", bound=type[AdmissionPolicy])
_REGISTRY: dict[str, type[AdmissionPolicy]] = {}


def register_admission_policy(name: str, description: str) -> Callable[[_A], _A]:
    """Class decorator: make an `AdmissionPolicy` available by `name`."""

    def decorate(cls: _A) -> _A:
        if not (isinstance(cls, type) and issubclass(cls, AdmissionPolicy)):
            raise TypeError(
                f"admission policy {name!r}: {cls!r} is not a kvtier.admission.AdmissionPolicy "
                "class"
            )
        if type(name) is not str or not name:
            # `kvtier policies` sorts the names: one that is not a str broke the listing.
            raise TypeError(f"admission policy name {name!r} is invalid; expected a non-empty str")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(
                f"admission policy {name!r} is already registered by {_REGISTRY[name]}"
            )
        cls.name = name
        cls.description = description
        _REGISTRY[name] = cls
        return cls

    return decorate


def registered_admission_policies() -> dict[str, type[AdmissionPolicy]]:
    """Registered admission policies by name."""
    return dict(sorted(_REGISTRY.items()))


@register_admission_policy("always", "stores every offered chunk that is not already present")
class AlwaysAdmit(AdmissionPolicy):
    """Admits every key."""

    def admit(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
        return list(keys)

    def preview(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
        return list(keys)

    def record(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        pass


# Request ids a tracked key keeps in a tuple before a set: below it a tuple is cheaper to build
# and to search (the usual thresholds are 2-8); above it copying and scanning a tuple on every
# sighting made a huge threshold quadratic in the requests sharing a chunk.
_TUPLE_IDS = 8


@register_admission_policy(
    "reuse",
    "stores a chunk only once it has been offered by store_threshold different requests",
)
class ReuseAdmission(AdmissionPolicy):
    """Admit a key on its `store_threshold`-th sighting, counting each request at most once.

    A request that offers the same key again (a retry after "no room", a re-offer after
    preemption, or after other requests offered it in between) does not raise its count, so one
    long request cannot make its own blocks look popular. The tracker keeps the most recently
    offered `max_tracker_size` keys; the keys of the offer in progress are never dropped to make
    room for each other. Only keys absent from the tier are offered: a chunk the tier holds is
    not counted while it stays there, and once evicted it starts again from its last count,
    if the tracker still has it.

    Each tracked key keeps the ids of the distinct requests that offered it, up to
    `store_threshold` of them (past that the key is admitted for good), so its memory is bounded
    by the distinct requests seen, up to the threshold, and a sighting costs O(1) whatever the
    threshold.
    """

    def __init__(self, store_threshold: int = 2, max_tracker_size: int = 64_000) -> None:
        try:
            threshold = checked_int("store_threshold", store_threshold, minimum=2)
        except ValueError:
            raise ValueError(
                f"store_threshold={store_threshold!r} is invalid for reuse admission; "
                "expected an int >= 2 (below 2 every chunk is admitted: use 'always')"
            ) from None
        self.store_threshold = threshold
        self.max_tracker_size = checked_int("max_tracker_size", max_tracker_size)
        # key -> ids of the distinct requests that offered it, the first `store_threshold` of
        # them (one id alone would count A, B, A as three); least recently offered first. A
        # tuple while short, a set beyond (see _TUPLE_IDS).
        self._seen: OrderedDict[OffloadKey, tuple[str, ...] | set[str]] = OrderedDict()

    def admit(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
        admitted = self.preview(keys, ctx)
        self.record(keys, ctx)
        return admitted

    def preview(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
        seen, req_id, threshold = self._seen, ctx.req_id, self.store_threshold
        admitted = []
        for key in keys:
            entry = seen.get(key)
            # An untracked key is on its first sighting, below every threshold (>= 2).
            if entry is not None and len(entry) + (req_id not in entry) >= threshold:
                admitted.append(key)
        return admitted

    def record(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        seen = self._seen
        req_id, threshold = ctx.req_id, self.store_threshold
        fresh: dict[OffloadKey, None] = {}  # a dict: a key offered twice is one new entry
        for key in keys:
            entry = seen.get(key)
            if entry is None:
                fresh[key] = None
                continue
            # Past the threshold the key is admitted for good: more ids would change nothing.
            num_ids = len(entry)
            if num_ids < threshold and req_id not in entry:
                if isinstance(entry, set):
                    entry.add(req_id)
                elif num_ids < _TUPLE_IDS:
                    seen[key] = (*entry, req_id)
                else:
                    seen[key] = {*entry, req_id}
            seen.move_to_end(key)
        # Make room for this offer's new keys by dropping the oldest entries of earlier offers;
        # the entries of this offer were just moved to the young end, so they are never dropped.
        num_offered = len(keys) if len(keys) < 2 else len(set(keys))
        overflow = len(seen) + len(fresh) - self.max_tracker_size
        num_older = len(seen) - (num_offered - len(fresh))
        for _ in range(min(overflow, num_older)):
            seen.popitem(last=False)
        for key in list(fresh)[: self.max_tracker_size - len(seen)]:
            seen[key] = (req_id,)

    def clear(self) -> None:
        self._seen.clear()

    def table_sizes(self) -> dict[str, int]:
        return {"tracker": len(self._seen)}


def make_admission_policy(
    store_threshold: int = 0, max_tracker_size: int = 64_000
) -> AdmissionPolicy:
    """The admission policy for vLLM-style settings: reuse filtering from threshold 2 up."""
    threshold = checked_int("store_threshold", store_threshold, minimum=0)
    # Checked whatever the threshold: a bad size was accepted and ignored below 2, then
    # refused by the same settings with the threshold raised.
    max_tracker_size = checked_int("max_tracker_size", max_tracker_size)
    if threshold < 2:
        return AlwaysAdmit()
    return ReuseAdmission(threshold, max_tracker_size)
