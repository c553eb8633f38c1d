"""kvtier inside vLLM 0.33: the `KVTierConnector` KV connector, and kvtier's cache policies
for vLLM's own `OffloadingConnector` (`kvtier.integrations.vllm.policy`). See docs/vllm.md."""

from kvtier.integrations.vllm.connector import KVTierConnector

__all__ = ["KVTierConnector"]
