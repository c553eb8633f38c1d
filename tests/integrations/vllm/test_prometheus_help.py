"""The Prometheus help of `vllm:kvtier_loaded_tokens_total` says what it counts: tokens vLLM
planned to load from kvtier, failed loads included (test_connector_stats counts a failed
load's tokens there), not only tokens that arrived."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import make_vllm_config
from test_vllm import EXTRA, MODULE, vllm_loaded

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm


def test_loaded_tokens_help_counts_failed_loads(vllm_loaded: None) -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    registry = CollectorRegistry()

    class Prom(KVConnectorProm):
        _gauge_cls = staticmethod(lambda **kw: Gauge(registry=registry, **kw))  # type: ignore[assignment]
        _counter_cls = staticmethod(lambda **kw: Counter(registry=registry, **kw))  # type: ignore[assignment]
        _histogram_cls = staticmethod(lambda **kw: Histogram(registry=registry, **kw))  # type: ignore[assignment]

    config = make_vllm_config("KVTierConnector", EXTRA, 64, MODULE)
    Prom(config, ["model_name", "engine"], {0: ["tiny", "0"]})
    (help_text,) = [m.documentation for m in registry.collect() if m.name.endswith("loaded_tokens")]
    assert "failed" in help_text and "and vLLM loaded" not in help_text, help_text
