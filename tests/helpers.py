"""Small helpers shared by kvtier's tests (importable because pytest puts tests/ on the path)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import pytest

from kvtier.base import OffloadKey, make_offload_key


def key(i: int, group: int = 0) -> OffloadKey:
    """A deterministic test key: 8 bytes of `i` plus the group index."""
    return make_offload_key(i.to_bytes(8, "big"), group)


def keys(*ids: int) -> list[OffloadKey]:
    """Several test keys."""
    return [key(i) for i in ids]


def refused_argv(
    main: Callable[[], None],
    argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> str:
    """Run a benchmark's `main()` with `argv`, expect argparse to refuse it; its stderr."""
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit):
        main()
    return capsys.readouterr().err


def brute_force_hits(stream: Sequence[Hashable], capacity: int) -> int:
    """Most hits any cache of `capacity` can get over `stream`: every store, bypass and victim
    choice tried (exponential; for OPT's tests on short streams)."""

    @functools.cache
    def best(t: int, cache: frozenset[Hashable]) -> int:
        if t == len(stream):
            return 0
        k = stream[t]
        if k in cache:
            return 1 + best(t + 1, cache)
        options = [best(t + 1, cache)]  # bypass
        if len(cache) < capacity:
            options.append(best(t + 1, cache | {k}))
        else:
            options.extend(best(t + 1, (cache - {v}) | {k}) for v in cache)
        return max(options)

    return best(0, frozenset())


def assert_generator_clean(gen: Any) -> None:
    """A `KVTierGenerator` after `flush()` holds nothing: no job, request, pin or block."""
    gen.flush()
    assert gen.scheduler.num_jobs_in_flight() == 0
    assert gen.scheduler.num_requests() == 0
    assert gen.manager.get_stats().pinned == 0
    assert bool(gen._free.all())


def interrupt_once(
    fn: Callable[..., Any], when: str, armed: list[bool] | None = None
) -> Callable[..., Any]:
    """`fn`, whose first call raises KeyboardInterrupt before (`when="before"`) or after it
    runs `fn`, as a signal can arrive on either side of a call; later calls just run it.
    `armed` ([True]) may be shared by several, so that only the first of them fires."""
    armed = [True] if armed is None else armed

    def call(*args: Any) -> Any:
        if armed.pop() if armed else False:
            if when == "before":
                raise KeyboardInterrupt
            fn(*args)
            raise KeyboardInterrupt
        return fn(*args)

    return call


class LibWith:
    """A compiled (ctypes) library with some functions replaced."""

    def __init__(self, real: Any, **replaced: Callable[..., Any]) -> None:
        self.real = real
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def random_ids(n: int, seed: int, vocab: int) -> Any:
    """`n` seeded random token ids below `vocab`, as a 1-D int64 tensor."""
    import torch

    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
