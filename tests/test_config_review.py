"""Configuration edge cases from a serving engineer's side: CPU lists with spaces, and an
environment mapping with a key that is no string."""

from __future__ import annotations

import pytest

from kvtier.config import ConfigError, KVTierConfig


@pytest.mark.parametrize("value", ["2 3", "0-1 5", "1 0", "2,3 4"])
def test_a_space_inside_a_cpu_list_is_refused_not_joined(value: str) -> None:
    """Removing every space read "2 3" as CPU 23 and "0-1 5" as CPUs 0 to 15, silently."""
    with pytest.raises(ConfigError, match=r"KVTIER_TRANSFER_CPUS=.*expected a CPU list"):
        KVTierConfig.load(env={"KVTIER_TRANSFER_CPUS": value})
    with pytest.raises(ConfigError, match=r"transfer_cpus=.*\(from dict\): expected a CPU list"):
        KVTierConfig.from_dict({"transfer_cpus": value})


@pytest.mark.parametrize(
    ("value", "cpus"),
    [(" 2 - 3 , 6 ", (2, 3, 6)), ("2-3, 6", (2, 3, 6)), ("\t4\n", (4,)), ("0 ,1", (0, 1))],
)
def test_spaces_beside_separators_are_still_allowed(value: str, cpus: tuple[int, ...]) -> None:
    assert KVTierConfig.load(env={"KVTIER_TRANSFER_CPUS": value}).transfer_cpus == cpus


def test_an_environment_key_that_is_no_string_is_a_config_error() -> None:
    """Every other layer refuses such a key with "expected a string key"; the environment's
    filter raised AttributeError ('int' object has no attribute 'startswith')."""
    env: dict[object, str] = {1: "x", "KVTIER_NUM_SLOTS": "4"}
    with pytest.raises(ConfigError, match=r"^1='x' \(from environment\): expected a string key$"):
        KVTierConfig.load(env=env)  # type: ignore[arg-type]  # what a caller may pass
