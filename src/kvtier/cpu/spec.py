"""Load/store specs of the primary host (CPU) tier."""

from __future__ import annotations

from kvtier.base import BlockIDsLoadStoreSpec


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Host slot ids, co-indexed with the keys of the call that produced them."""

    medium = "CPU"
