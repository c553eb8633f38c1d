"""Config values that passed parsing and broke later, inputs that were not mappings, and the
setup script's own `KVTIER_` variables."""

from __future__ import annotations

import re
from typing import Any

import pytest

from kvtier.config import ConfigError, KVTierConfig, parse_size
from kvtier.cpu import CPUOffloadingManager


@pytest.mark.parametrize("name", ["num_slots", "max_tracker_size", "max_pending_events"])
@pytest.mark.parametrize("value", [2**63, 10**30, str(2**64)])
def test_counts_beyond_int64_are_refused_where_they_enter(name: str, value: Any) -> None:
    """num_slots=10**30 was accepted, then CPUOffloadingManager failed with OverflowError
    "cannot fit 'int' into an index-sized integer"."""
    with pytest.raises(
        ConfigError, match=rf"^{name}=.*: expected a positive integer up to 2\*\*63-1$"
    ):
        KVTierConfig.from_dict({name: value})


def test_the_largest_count_is_kept() -> None:
    assert KVTierConfig(num_slots=2**63 - 1).num_slots == 2**63 - 1


def test_a_huge_num_slots_no_longer_reaches_the_manager_as_an_overflow() -> None:
    with pytest.raises(ConfigError, match="num_slots="):
        cfg = KVTierConfig(num_slots=10**30)
        assert cfg.num_slots is not None
        CPUOffloadingManager.from_config(cfg.num_slots, cfg)


@pytest.mark.parametrize(
    "extra",
    [
        {"cpu_bytes_to_use": 1e300},
        {"cpu_bytes_to_use": str(2**63)},
        {"cpu_bytes_to_use": f"{2**33}GiB"},  # 2**63 bytes
    ],
)
def test_cpu_bytes_beyond_int64_is_refused(extra: dict[str, Any]) -> None:
    """JSON's 1e300 became a 301-digit byte budget."""
    with pytest.raises(ConfigError, match=r"cpu_bytes_to_use=.*up to 2\*\*63-1 bytes"):
        KVTierConfig.from_vllm_extra_config(extra)


def test_a_size_with_more_digits_than_int_reads_names_the_problem() -> None:
    """It raised Python's 'Exceeds the limit (4300 digits) for integer string conversion'."""
    with pytest.raises(ValueError, match=r"^size '1{20}'\.\.\. has 5000 digits, too many"):
        parse_size("1" * 5000)


@pytest.mark.parametrize("text", ["١٢", "１２", "١٢MiB"])
def test_non_ascii_digits_are_not_numbers(text: str) -> None:
    """`\\d` matched Arabic-Indic and full-width digits, which int() reads: '١٢' was 12."""
    with pytest.raises(ConfigError, match="store_threshold="):
        KVTierConfig.from_dict({"store_threshold": text.removesuffix("MiB")})
    with pytest.raises(ValueError, match="is invalid"):
        parse_size(text)
    with pytest.raises(ConfigError, match="transfer_cpus="):
        KVTierConfig.from_dict({"transfer_cpus": text.removesuffix("MiB")})


def test_coalesce_depth_message_is_its_own_range() -> None:
    with pytest.raises(ConfigError, match=r"expected an integer from 0 \(off\) to 8$"):
        KVTierConfig(transfer_coalesce_depth=2**64)


@pytest.mark.parametrize(
    ("call", "source"),
    [
        (lambda v: KVTierConfig.from_vllm_extra_config(v), "vLLM kv_connector_extra_config"),
        (lambda v: KVTierConfig.from_dict(v), "from_dict()"),
        (lambda v: KVTierConfig.load(env={}, overrides=v), "overrides"),
        (lambda v: KVTierConfig.load(env=v), "env"),
    ],
)
@pytest.mark.parametrize("value", ['{"cpu_bytes_to_use": "64GiB"}', 7])
def test_a_layer_that_is_not_a_mapping_is_a_config_error(
    call: Any, source: str, value: object
) -> None:
    """A JSON string where vLLM's dict belongs ended in AttributeError: 'str' object has no
    attribute 'items'."""
    with pytest.raises(
        ConfigError,
        match=rf"^{re.escape(source)} is .* of type {type(value).__name__}; expected a mapping",
    ):
        call(value)


@pytest.mark.parametrize("name", ["KVTIER_WITH_VLLM", "KVTIER_VENV"])
def test_setup_script_variables_are_not_settings(name: str) -> None:
    """README's `bash scripts/test.sh` documents `KVTIER_WITH_VLLM=0`; once exported, every
    `KVTierConfig.load()` failed with 'unknown key'."""
    assert KVTierConfig.load(env={name: "0"}) == KVTierConfig()


@pytest.mark.parametrize("cpus", ["99999999999999999999999", [2**70], "0-99999999999999999999"])
def test_a_cpu_id_past_int64_names_the_cpu_range_alone(cpus: Any) -> None:
    with pytest.raises(ConfigError, match=r"\(CPU ids 0\.\.65535\), or null$"):
        KVTierConfig.from_dict({"transfer_cpus": cpus})


def test_an_int_too_long_to_print_is_named_by_its_size() -> None:
    # repr() of an int past 4,300 digits raises ValueError, which escaped naming no key.
    with pytest.raises(ConfigError, match=r"^num_slots=<an integer of about 5001 digits>"):
        KVTierConfig.from_dict({"num_slots": 10**5000})


@pytest.mark.parametrize(("suffix", "line"), [(".yaml", "num_slots: "), (".toml", "num_slots = ")])
def test_a_file_with_an_int_too_long_to_read_names_the_file(
    tmp_path: Any, suffix: str, line: str
) -> None:
    path = tmp_path / f"kvtier{suffix}"
    path.write_text(line + "9" * 5000 + "\n")
    named = re.escape(f"config file {path} (named by KVTIER_CONFIG)")
    with pytest.raises(ConfigError, match=rf"^{named} holds a value"):
        KVTierConfig.load(env={"KVTIER_CONFIG": str(path)})


def test_a_value_too_long_to_print_is_named_wherever_it_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^transfer_cpus=<a list too large to print>"):
        KVTierConfig.from_dict({"transfer_cpus": [10**5000]})
    with pytest.raises(ConfigError, match=r"^nope=<an integer of about 5001 digits> .*unknown key"):
        KVTierConfig.from_dict({"nope": 10**5000})
