"""The primary host-memory tier: slot-addressed pool bookkeeping."""

from kvtier.cpu.manager import CPUOffloadingManager
from kvtier.cpu.spec import CPULoadStoreSpec

__all__ = ["CPULoadStoreSpec", "CPUOffloadingManager"]
