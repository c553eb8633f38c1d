"""`transfer_worker_from_config`: a `transfer_*` setting this machine or these KV tensors cannot
honour is a `ConfigError` naming the settings; a mistake of the caller's own stays a plain
`ValueError`, which must not blame settings left at their defaults."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvtier.config import ConfigError, KVTierConfig
from kvtier.transfer import HostPool, KVCacheRegistration
from kvtier.transfer.factory import make_transfer_worker, transfer_worker_from_config
from kvtier.transfer.native import library
from kvtier.transfer.testing import make_layout


def _pool() -> tuple[KVCacheRegistration, HostPool]:
    reg = KVCacheRegistration(make_layout("flash", torch.float16))
    return reg, HostPool(reg, 2, num_slots=4, pin=False)


def test_the_default_config_builds_the_factorys_worker() -> None:
    reg, pool = _pool()
    worker = transfer_worker_from_config(reg, pool, KVTierConfig())
    plain = make_transfer_worker(reg, pool)
    try:
        assert type(worker) is type(plain)
    finally:
        worker.shutdown()
        plain.shutdown()


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ({"transfer_cpus": (65535,)}, r"transfer_cpus=\(65535,\).*no CPU \[65535\]"),
        ({"transfer_backend": "cuda"}, r"^transfer_backend='cuda'.*on a CUDA device"),
    ],
)
def test_a_setting_the_machine_cannot_honour_is_a_config_error(
    setting: dict[str, Any], needle: str
) -> None:
    if "transfer_cpus" in setting and library() is None:
        pytest.skip("needs the compiled engine, which places copy threads")
    reg, pool = _pool()
    with pytest.raises(ConfigError, match=needle):
        transfer_worker_from_config(reg, pool, KVTierConfig(**setting))


def test_the_callers_own_mistakes_are_not_blamed_on_the_config() -> None:
    reg, pool = _pool()
    other, _ = _pool()
    with pytest.raises(ValueError, match="different KVCacheRegistration") as info:
        transfer_worker_from_config(other, pool, KVTierConfig())
    assert not isinstance(info.value, ConfigError)
    with pytest.raises(ValueError, match="fault_injector=3 must be a callable") as info:
        transfer_worker_from_config(reg, pool, KVTierConfig(), fault_injector=3)  # type: ignore[arg-type]
    assert not isinstance(info.value, ConfigError)
