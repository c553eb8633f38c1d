"""The cache-policy strategy and its registry.

A `CachePolicy` orders the *evictable* keys of one tier (stored, ready, not pinned) and picks
victims. The manager owns everything else (slots, ref counts, events), so a new policy is one
small class and no manager change.
"""

from __future__ import annotations

import importlib
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import ClassVar, TypeVar

from kvtier.base import OffloadKey, ReqContext, checked_int


def checked_protected(protected: Collection[OffloadKey]) -> Collection[OffloadKey]:
    """`protected` as a set, dict or frozenset (one given is returned as it is), else a
    TypeError naming it. One key given as the collection was taken for a collection of its
    bytes (ints), so the key it meant to protect could be evicted."""
    if isinstance(protected, (set, frozenset, dict)):
        return protected
    if isinstance(protected, (bytes, bytearray, memoryview, str)):
        raise TypeError(
            f"protected={protected!r:.80} is one {type(protected).__name__} object; expected "
            "a collection of offload keys (bytes)"
        )
    try:
        return set(protected)  # O(1) membership; a repeated key counts once
    except TypeError:
        raise TypeError(
            f"protected={protected!r:.80} is not a collection of offload keys (bytes)"
        ) from None


class CachePolicy(ABC):
    """Eviction order of one tier's evictable keys.

    The manager calls `insert` when a stored key becomes readable, `pin`/`unpin` around loads
    (a pinned key is out of the candidate set; unpinning counts as a use), `touch` for uses,
    and `evict` to make room. `touch` and `pin` ignore keys the policy does not hold as
    candidates, `unpin` keys it does not hold pinned, `remove` keys it does not hold at all
    and `insert` keys it holds already (pinned ones included), so the manager need not filter.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""

    def __init__(self, capacity: int) -> None:
        self.capacity = checked_int("capacity", capacity)

    @abstractmethod
    def __len__(self) -> int:
        """Number of eviction candidates held."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether `key` is an eviction candidate."""

    @abstractmethod
    def insert(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        """Newly stored `keys` became evictable; keys already held, pinned or not, are
        ignored."""

    @abstractmethod
    def touch(self, keys: Iterable[OffloadKey], ctx: ReqContext | None) -> None:
        """`keys` were used; unknown and pinned keys are ignored."""

    @abstractmethod
    def pin(self, keys: Iterable[OffloadKey]) -> None:
        """Take `keys` out of the candidate set while a transfer reads them."""

    @abstractmethod
    def unpin(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        """Return pinned `keys` to the candidate set, counted as a use."""

    @abstractmethod
    def remove(self, keys: Iterable[OffloadKey]) -> None:
        """Forget `keys` without recording them as evicted (pinned keys included)."""

    @abstractmethod
    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        """Remove and return exactly `n` candidates not in `protected`, or `None` and change
        nothing when fewer than `n` are available."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every key and all history (ghost lists, frequencies)."""

    def on_request_finished(self, ctx: ReqContext) -> None:  # noqa: B027 - optional hook
        """A request ended; policies that learn per request override this."""

    def prefix_extended(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:  # noqa: B027
        """`keys` (head first, held or not) are one request's chunks up to the deepest it has
        just stored, as `OffloadingManager.prefix_extended` describes. Not a use: a policy
        that orders by recency moves the held ones to its newest end, head last, and counts
        nothing; others ignore it."""

    def table_sizes(self) -> dict[str, int]:
        """Sizes of the policy's internal tables, so tests can check their bounds."""
        return {"candidates": len(self)}


_P = TypeVar("_P", bound=type[CachePolicy])

_REGISTRY: dict[str, type[CachePolicy]] = {}


def register_policy(name: str, description: str) -> Callable[[_P], _P]:
    """Class decorator: make a `CachePolicy` available by `name`."""

    def decorate(cls: _P) -> _P:
        if not (isinstance(cls, type) and issubclass(cls, CachePolicy)):
            # Else the manager was built around it and failed at its first store, on a
            # missing `insert`; a "package.module:Class" path is refused the same way.
            raise TypeError(
                f"cache policy {name!r}: {cls!r} is not a kvtier.policies.CachePolicy class"
            )
        if type(name) is not str or not name:
            # `kvtier policies` sorts the names: one that is not a str broke the listing.
            raise TypeError(f"cache policy name {name!r} is invalid; expected a non-empty str")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"cache policy {name!r} is already registered by {_REGISTRY[name]}")
        cls.name = name
        cls.description = description
        _REGISTRY[name] = cls
        return cls

    return decorate


def registered_policies() -> dict[str, type[CachePolicy]]:
    """Registered cache policies by name."""
    _load_builtins()
    return dict(sorted(_REGISTRY.items()))


def get_policy_cls(spec: str | type[CachePolicy]) -> type[CachePolicy]:
    """Resolve a registered name, a `"package.module:Class"` path, or a class itself."""
    if isinstance(spec, type):
        if not issubclass(spec, CachePolicy):
            raise TypeError(f"{spec!r} is not a CachePolicy subclass")
        return spec
    if not isinstance(spec, str):
        # Else the registry lookup fails with "unhashable type" or "argument of type 'int' is
        # not iterable", naming neither the spec nor what was expected.
        raise TypeError(
            f"cache policy {spec!r} has type {type(spec).__name__}; expected a registered "
            "name, a 'package.module:Class' string or a CachePolicy subclass"
        )
    _load_builtins()
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cache policy {spec!r} cannot be imported: {e}") from e
        except Exception as e:
            # The module itself failed (a SyntaxError, a NameError...): a bad spec like the
            # others, not a crash, but named with where it happened, as a traceback would.
            raise ValueError(f"cache policy {spec!r} cannot be imported: {_raised_at(e)}") from e
        if not (isinstance(obj, type) and issubclass(obj, CachePolicy)):
            raise ValueError(f"cache policy {spec!r} is not a kvtier.policies.CachePolicy class")
        return obj
    names = ", ".join(sorted(_REGISTRY))
    raise ValueError(
        f"unknown cache policy {spec!r}; expected one of: {names}, or 'package.module:Class'"
    )


def _raised_at(e: Exception) -> str:
    """`e`'s type and message, and the file and line of the imported code that raised it."""
    if isinstance(e, SyntaxError) and e.filename is not None:
        return f"{type(e).__name__}: {e.msg} ({e.filename}:{e.lineno})"
    frames = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if f.filename not in (__file__, importlib.__file__) and not f.filename.startswith("<")
    ]
    if not frames and isinstance(e, (ValueError, TypeError)):
        return str(e)  # importlib's: an empty or relative module path (':Class', '.mod:Class')
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    message = " ".join(str(e).splitlines())  # one error line
    return f"{type(e).__name__}: {message}{where}"


def make_policy(spec: str | type[CachePolicy], capacity: int) -> CachePolicy:
    """Build the policy named by `spec` for a tier of `capacity` slots."""
    return get_policy_cls(spec)(capacity)


def _load_builtins() -> None:
    # Importing the package registers every built-in policy.
    importlib.import_module("kvtier.policies")
