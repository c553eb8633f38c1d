"""kvtier's connector metrics with KVTierConnector inside vLLM's `MultiConnector`.

`MultiConnector` ships `{"KVTierConnector": <kvtier's dict>}` to the front end, whose
`build_kv_connector_stats` rebuilds each entry through
`KVConnectorFactory.get_connector_class_by_name`: kvtier must be in vLLM's connector registry
there, or every stats interval raises in the front end's logger."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import make_engine
from test_connector_stats import through_vllm_loggers
from test_vllm import EXTRA, MODULE, PROMPT, store_a_then_forget_on_device, vllm_loaded

__all__ = ["vllm_loaded"]  # the module-scoped fixture, shared with test_vllm

HERE = Path(__file__).resolve().parent

MULTI_EXTRA: dict[str, Any] = {
    "connectors": [
        {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": MODULE,
            "kv_role": "kv_both",
            "kv_connector_extra_config": EXTRA,
        }
    ]
}


def test_counters_through_a_multiconnector_reach_vllms_loggers(vllm_loaded: None) -> None:
    engine = make_engine("MultiConnector", MULTI_EXTRA, module_path=None)
    store_a_then_forget_on_device(engine)
    engine.add("b", [*PROMPT, 5])
    engine.run_until(["b"])
    # As the engine core serializes them for the front end: plain dicts.
    payloads = [json.loads(json.dumps(s.kv_connector_stats)) for s in engine.stats]
    payloads = [p for p in payloads if p]
    assert payloads and all(set(p) == {"KVTierConnector"} for p in payloads)

    registry, lines = through_vllm_loggers(engine.scheduler.vllm_config, payloads)

    side = engine.scheduler.connector.sub_connectors[0].scheduler_side
    labels = {"model_name": "tiny", "engine": "0"}
    loaded = registry.get_sample_value("vllm:kvtier_loaded_bytes_total", labels)
    assert loaded == side.scheduler.bytes_loaded > 0
    (line,) = lines
    assert f"'loaded_bytes': {side.scheduler.bytes_loaded}" in line, line


FRONT_END = """
from engine import make_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorLogging,
    KVConnectorProm,
)

# Only vLLM imports kvtier here: VllmConfig's checks resolve the children's classes.
config = make_vllm_config("MultiConnector", {extra!r}, 64, None)
# The front end's StatLoggerManager: the log line's logger, then the Prometheus one.
logging = KVConnectorLogging(config.kv_transfer_config)
prom = KVConnectorProm(config, ["model_name", "engine"], {{0: ["tiny", "0"]}})
payload = {{"KVTierConnector": {{"loaded_bytes": 4096, "load_seconds": 0.5}}}}
prom.observe(payload)
logging.observe(payload)
lines = []
logging.log(lambda fmt, *args: lines.append(fmt % args))
print(lines[0])
"""


def test_a_front_end_process_rebuilds_multiconnector_stats(vllm_loaded: None) -> None:
    import kvtier

    # The kvtier under test (an old tree on PYTHONPATH included), and engine.py.
    src = str(Path(kvtier.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, str(HERE)]), HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-c", FRONT_END.format(extra=MULTI_EXTRA)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "KVTierConnector={'loaded_bytes': 4096" in done.stdout, done.stdout
