"""One typed configuration object, built from defaults < file < environment < explicit dict.

Every value is parsed and checked where it enters, and a bad one raises `ConfigError` naming
the key, the value, where it came from and what was expected. Unknown keys are errors in every
layer, so a typo never passes silently.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import re
import tomllib
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar, Final, Literal, NoReturn, cast

import numpy as np
import yaml

from kvtier.base import FALSE_WORDS, TRUE_WORDS, checked_int
from kvtier.hashing import HASH_ALGORITHMS
from kvtier.policies import get_policy_cls, registered_policies

__all__ = ["ENV_PREFIX", "ConfigError", "KVTierConfig", "parse_size"]

ENV_PREFIX: Final = "KVTIER_"
"""Environment variables starting with this prefix configure kvtier; unknown ones are errors."""

_ENV_CONFIG_FILE: Final = "KVTIER_CONFIG"
# Variables with the prefix that are not settings: the config file's name, the switches of
# the transfer backends' compiled library (docs/configuration.md; kvtier.transfer.native), and
# scripts/setup.sh's (`export KVTIER_WITH_VLLM=0` made every later `load()` fail).
_ENV_NOT_SETTINGS: Final = frozenset(
    {
        _ENV_CONFIG_FILE,
        "KVTIER_NATIVE_COPY",
        "KVTIER_PORTABLE_COPY",
        "KVTIER_CACHE_DIR",
        "KVTIER_VENV",
        "KVTIER_WITH_VLLM",
    }
)
_VLLM_SOURCE: Final = "vLLM kv_connector_extra_config"
_DIRECT_SOURCE: Final = "KVTierConfig()"


class ConfigError(ValueError):
    """A configuration key or value is invalid; the message says which, from where, and why."""


# ---------------------------------------------------------------------------------------------
# Value parsers. Each accepts the native type or its string form (environment variables are
# strings; YAML and vLLM's JSON may carry either) and raises _Invalid with what it expected.


class _Invalid(Exception):
    def __init__(self, expected: str) -> None:
        super().__init__(expected)
        self.expected = expected


class _TooLarge(_Invalid):
    """A value of the right kind beyond `_MAX_INT`; `_optional` keeps its message as is."""


_SIZE_UNITS: Final = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
# [0-9], not \d: \d also matches other scripts' digits ("١٢"), which int() and Fraction() read.
# `_` groups digits of a whole number as in Python ("1_000_000"), in sizes as in integers.
_SIZE_RE: Final = re.compile(r"([0-9]+(?:_[0-9]+)*(?:\.[0-9]+)?)\s*([a-z]*)")
_INT_RE: Final = re.compile(r"\+?[0-9]+(?:_[0-9]+)*")
# Counts and sizes end up as int64 (numpy/torch sizes, slot indices): a larger value would pass
# here and fail later with OverflowError ("cannot fit 'int' into an index-sized integer").
_MAX_INT: Final = 2**63 - 1
_NONE_WORDS: Final = frozenset({"none", "null"})


def parse_size(value: str | int | np.integer[Any]) -> int:
    """Parse a byte size: an int, or a string like `"512MB"`, `"64GiB"`, `"1.5GiB"`, `"4096"`.

    Units are case-insensitive: B, KB/MB/GB/TB (powers of 1000) and KiB/MiB/GiB/TiB (powers of
    1024); a bare number is bytes. `_` may group the digits of the whole part (`"1_000_000"`,
    `"64_000MiB"`). Raises `ValueError` for negatives, fractions of a byte, unknown units and
    anything else. A numpy integer counts as an int.
    """
    if isinstance(value, np.integer):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"size {value!r} is invalid; expected an int or a string like '64GiB'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size {value} is negative; expected a number of bytes >= 0")
        return value
    match = _SIZE_RE.fullmatch(value.strip().lower())
    if match is None or match.group(2) not in ("", *_SIZE_UNITS):
        raise ValueError(
            f"size {value!r} is invalid; expected a non-negative number with an optional unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '64GiB' or '512MB'"
        )
    number, unit = match.groups()
    try:
        size = Fraction(number) * _SIZE_UNITS[unit or "b"]
    except ValueError:  # more digits than int() reads (sys.get_int_max_str_digits())
        raise ValueError(
            f"size {value[:20]!r}... has {len(number)} digits, too many for a byte size; "
            "expected e.g. '64GiB' or '512MB'"
        ) from None
    if size.denominator != 1:
        raise ValueError(f"size {value!r} is not a whole number of bytes ({float(size)})")
    return int(size)


def _parse_int(raw: object, minimum: int, expected: str) -> int:
    if isinstance(raw, str):
        if not _INT_RE.fullmatch(raw.strip()):
            raise _Invalid(expected)
        try:
            value = int(raw.strip())
        except ValueError:  # more digits than int() reads (sys.get_int_max_str_digits())
            raise _TooLarge(f"{expected} up to 2**63-1") from None
    else:
        try:
            # Any integer scalar (numpy's too, as a plain int); not a bool, a float or an array.
            value = checked_int("value", raw, minimum)
        except ValueError:
            raise _Invalid(expected) from None
    if value < minimum:
        raise _Invalid(expected)
    if value > _MAX_INT:
        raise _TooLarge(f"{expected} up to 2**63-1")
    return value


def _int_parser(minimum: int) -> Callable[[object], int]:
    expected = "a positive integer" if minimum == 1 else "a non-negative integer"
    return lambda raw: _parse_int(raw, minimum, expected)


def _parse_coalesce_depth(raw: object) -> int:
    # cudaengine.c's KVT_DEPTH_MAX; not imported, so that the config never loads torch.
    expected = "an integer from 0 (off) to 8"
    try:
        value = _parse_int(raw, 0, expected)
    except _TooLarge:
        raise _Invalid(expected) from None
    if value > 8:
        raise _Invalid(expected)
    return value


def _parse_bool(raw: object) -> bool:
    if isinstance(raw, (bool, np.bool_)):
        return bool(raw)
    if isinstance(raw, str):
        word: str | None = raw.strip().lower()
    else:
        try:
            word = str(checked_int("value", raw, 0))  # 1 and 0, numpy's included
        except ValueError:
            word = None
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise _Invalid("a boolean (true/false, yes/no, on/off, 1/0)")


def _is_none(raw: object, words: frozenset[str] = _NONE_WORDS) -> bool:
    return raw is None or (isinstance(raw, str) and raw.strip().lower() in words)


def _optional(parse: Callable[[object], Any], expected: str) -> Callable[[object], Any]:
    def parse_optional(raw: object) -> Any:
        if _is_none(raw):
            return None
        try:
            return parse(raw)
        except _TooLarge:
            raise
        except _Invalid:
            raise _Invalid(f"{expected}, or null") from None

    return parse_optional


def _parse_cpu_bytes(raw: object) -> int:
    expected = "a positive byte size such as '64GiB', '512MB' or an integer number of bytes"
    if isinstance(raw, bool) or not isinstance(raw, (int, str, np.integer)):
        raise _Invalid(expected)
    try:
        value = parse_size(raw)
    except ValueError:
        raise _Invalid(expected) from None
    if value < 1:
        raise _Invalid(expected)
    if value > _MAX_INT:
        raise _TooLarge(f"{expected}, up to 2**63-1 bytes (8EiB)")
    return value


def _choice_parser(choices: tuple[str, ...]) -> Callable[[object], str]:
    def parse_choice(raw: object) -> str:
        word = raw.strip().lower() if isinstance(raw, str) else ""
        if word not in choices:
            raise _Invalid("one of: " + ", ".join(repr(c) for c in choices))
        return word

    return parse_choice


def _parse_cache_policy(raw: object) -> str:
    names = ", ".join(registered_policies())
    expected = f"a registered cache policy ({names}) or an importable 'package.module:Class'"
    if not isinstance(raw, str) or not raw.strip():
        raise _Invalid(expected)
    spec = raw.strip()
    try:
        cls = get_policy_cls(spec)
    except (ValueError, TypeError) as e:
        # A registry miss is fully described by `expected`; an import failure needs its cause.
        raise _Invalid(f"{expected} ({e})" if ":" in spec else expected) from None
    if inspect.isabstract(cls):
        # Else accepted here and refused by the manager's constructor ("Can't instantiate
        # abstract class"), an error that names neither this key nor where it was set.
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise _Invalid(f"{expected}; {spec!r} is abstract, without {missing}")
    return spec


def _parse_pin_memory(raw: object) -> bool | None:
    if _is_none(raw, _NONE_WORDS | {"auto"}):
        return None
    try:
        return _parse_bool(raw)
    except _Invalid:
        raise _Invalid("a boolean, or auto/null (pin when a GPU is present)") from None


_CPULIST_RE: Final = re.compile(r"\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*")
_CPULIST_SPACES_RE: Final = re.compile(r" *([,-]) *")
# Far above any machine's CPU count; it keeps a typo such as "0-4000000000" from expanding to
# billions of ids.
_MAX_CPU: Final = 2**16 - 1


def _parse_cpus(raw: object) -> tuple[int, ...] | None:
    """A CPU list as taskset takes it (`"2-3,6"`), a list of ints or one int: sorted, distinct."""
    expected = f"a CPU list such as '2-3,6', [2, 3, 6] or 3 (CPU ids 0..{_MAX_CPU}), or null"
    if _is_none(raw):
        return None
    cpus: list[int] = []
    if isinstance(raw, str):
        # Spaces only beside the separators: removing them all read "2 3" as CPU 23 and
        # "0-1 5" as CPUs 0 to 15.
        text = _CPULIST_SPACES_RE.sub(r"\1", raw.strip())
        if not _CPULIST_RE.fullmatch(text):
            raise _Invalid(expected)
        try:
            for part in text.split(","):
                lo, _, hi = part.partition("-")
                first, last = (_parse_int(x, 0, expected) for x in (lo, hi or lo))
                if last < first or last > _MAX_CPU:
                    raise _Invalid(expected)
                cpus.extend(range(first, last + 1))
        except _TooLarge:  # its "up to 2**63-1" would contradict the range named
            raise _Invalid(expected) from None
    elif isinstance(raw, (list, tuple)) and raw:
        for c in raw:
            try:
                cpu = _parse_int(c, 0, expected) if not isinstance(c, str) else -1
            except _TooLarge:
                cpu = -1
            if not 0 <= cpu <= _MAX_CPU:
                raise _Invalid(expected)
            cpus.append(cpu)
    else:
        # One CPU id: the environment's "3" is one, and YAML, TOML and JSON read a bare 3 as an
        # int. _parse_int refuses bools, floats and arrays; its _TooLarge would name 2**63-1.
        try:
            cpu = _parse_int(raw, 0, expected)
        except _Invalid:
            raise _Invalid(expected) from None
        if cpu > _MAX_CPU:
            raise _Invalid(expected)
        cpus.append(cpu)
    return tuple(sorted(set(cpus)))


_PARSERS: Final[dict[str, Callable[[object], Any]]] = {
    "cpu_bytes": _optional(_parse_cpu_bytes, "a positive byte size such as '64GiB' or '512MB'"),
    "num_slots": _optional(_int_parser(1), "a positive integer"),
    "cache_policy": _parse_cache_policy,
    "store_threshold": _int_parser(0),
    "max_tracker_size": _int_parser(1),
    "blocks_per_chunk": _optional(_int_parser(1), "a positive integer"),
    "chunk_tokens": _optional(_int_parser(1), "a positive integer number of tokens"),
    "hash_algorithm": _choice_parser(HASH_ALGORITHMS),
    "enable_events": _parse_bool,
    "max_pending_events": _int_parser(1),
    "self_describing_kv_events": _parse_bool,
    "transfer_backend": _choice_parser(("auto", "cpu", "cuda")),
    "transfer_cpus": _parse_cpus,
    "transfer_avoid_submitter_cpu": _parse_bool,
    "transfer_coalesce_depth": _parse_coalesce_depth,
    "pin_memory": _parse_pin_memory,
    "offload_prompt_only": _parse_bool,
    "release_finished_blocks": _parse_bool,
}

# vLLM's kv_connector_extra_config names for kvtier fields; the other vLLM keys kvtier reads
# (store_threshold, max_tracker_size, blocks_per_chunk, offload_prompt_only) share its names.
_VLLM_ALIASES: Final = {
    "cpu_bytes_to_use": "cpu_bytes",
    "eviction_policy": "cache_policy",
    "block_size": "chunk_tokens",
}
_VLLM_MODULE_PATH: Final = "cache_policy_module_path"
# kvtier's policy plugin for vLLM's own connector (kvtier.integrations.vllm.policy, not
# imported here: it needs vLLM) answers `kvtier_<name>` with kvtier's registered <name> policy.
_VLLM_PLUGIN_MODULE: Final = "kvtier.integrations.vllm.policy"
VLLM_POLICY_PREFIX: Final = "kvtier_"
# vLLM reads these to choose the offloading spec class; they configure nothing in kvtier.
_VLLM_ROUTING_KEYS: Final = frozenset({"spec_name", "spec_module_path"})


# Keys of vLLM 0.33's own OffloadingConnector for features kvtier lacks: what they do there,
# and whether a value asks for nothing (read as vLLM reads it), which is accepted as a no-op.
# Any other value is refused by name: "unknown key" read like a typo to someone moving from
# vLLM's connector, and ignoring it would drop a tier they asked for without a word.
def _off(raw: object) -> bool:
    return isinstance(raw, (bool, int, float, type(None))) and not raw  # vLLM: bool(raw)


_VLLM_ONLY: Final[dict[str, tuple[str, Callable[[object], bool], str]]] = {
    "secondary_tiers": (
        "vLLM's secondary tiers (file system, object store, peers) behind its CPU tier",
        lambda raw: isinstance(raw, list) and not raw,
        "[]",
    ),
    # These two tune only the secondary tiers, refused above when asked for: inert.
    "tier_poll_interval_s": ("how often vLLM polls its secondary tiers", lambda raw: True, ""),
    "backpressure": ("vLLM's flow control of stores to secondary tiers", lambda raw: True, ""),
    "enable_telemetry": ("telemetry of vLLM's KVCR secondary tier", _off, "false"),
    "canonical_layout": ("vLLM's parallelism-agnostic shared host layout", _off, "false"),
    "sync_load_budget_bytes": ("vLLM's per-step byte budget of same-step loads", _off, "0"),
}


def _check_vllm_only(key: str, raw: object) -> None:
    """Accept a key of vLLM's own connector only with a value that asks for nothing."""
    what, asks_nothing, off = _VLLM_ONLY[key]
    if not asks_nothing(raw):
        raise ConfigError(
            f"{key}={_shown(raw)} (from {_VLLM_SOURCE}) sets {what}, which kvtier does not "
            f"have; expected it unset or {off}, or vLLM's own OffloadingConnector for it"
        )


# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVTierConfig:
    """kvtier's settings; docs/configuration.md describes each field.

    Build it with `load` (defaults < file < `KVTIER_*` environment < overrides), `from_dict`
    or `from_vllm_extra_config`. Direct construction parses and checks values the same way.
    """

    cpu_bytes: int | None = None
    num_slots: int | None = None
    cache_policy: str = "lru"
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    # None, not 1: an explicit 1 beside chunk_tokens is refused like any other value.
    blocks_per_chunk: int | None = None
    chunk_tokens: int | None = None
    hash_algorithm: Literal["sha256", "xxh3_128"] = "sha256"
    enable_events: bool = False
    max_pending_events: int = 100_000
    self_describing_kv_events: bool = False
    transfer_backend: Literal["auto", "cpu", "cuda"] = "auto"
    transfer_cpus: tuple[int, ...] | None = None
    transfer_avoid_submitter_cpu: bool = True
    transfer_coalesce_depth: int = 0
    pin_memory: bool | None = None
    offload_prompt_only: bool = True
    release_finished_blocks: bool = True

    # Per instance, field name -> (key that set it, layer), for errors found after parsing
    # (e.g. a budget too small for one slot). Not a field: equality and to_dict ignore it.
    _origin: ClassVar[Mapping[str, tuple[str, str]]]

    def __post_init__(self) -> None:
        origin = {name: (name, _DIRECT_SOURCE) for name in _PARSERS}
        for name, parse in _PARSERS.items():
            value = _parse_value(parse, getattr(self, name), name, _DIRECT_SOURCE)
            object.__setattr__(self, name, value)
        _check_combination(self.to_dict(), origin)
        object.__setattr__(self, "_origin", origin)

    @classmethod
    def load(
        cls,
        file: str | Path | None = None,
        env: Mapping[str, str] | None = os.environ,
        overrides: Mapping[str, Any] | None = None,
    ) -> KVTierConfig:
        """Build a config from defaults < `file` < `env` < `overrides`.

        `file` is YAML (.yaml, .yml) or TOML (.toml); when it is None, the file named by the
        `KVTIER_CONFIG` variable of `env` is read, if any. `env=None` ignores the environment.
        """
        layers: list[tuple[dict[str, Any], str]] = []
        if env is not None:
            _check_mapping(env, "env")
        source = f"file {file}"
        if file is None and env is not None and env.get(_ENV_CONFIG_FILE):
            file = env[_ENV_CONFIG_FILE]
            # A stale `export KVTIER_CONFIG=...` is otherwise hard to trace from the path alone.
            source = f"file {file} (named by {_ENV_CONFIG_FILE})"
        if file is not None:
            layers.append((_read_file(Path(file), "config " + source), source))
        if env is not None:
            layers.append(_env_layer(env))
        if overrides is not None:
            layers.append((dict(_check_mapping(overrides, "overrides")), "overrides"))
        return cls._build(layers)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KVTierConfig:
        """Build a config from defaults < `d` (kvtier field names only)."""
        return cls._build([(dict(_check_mapping(d, "from_dict()")), "dict")])

    @classmethod
    def from_vllm_extra_config(cls, extra: Mapping[str, Any]) -> KVTierConfig:
        """Build a config from vLLM's `kv_connector_extra_config`.

        vLLM's names (`cpu_bytes_to_use`, `eviction_policy`, `cache_policy_module_path`,
        `block_size`) and kvtier's field names are both accepted; vLLM's `spec_name` and
        `spec_module_path` (which pick the spec class) are ignored; keys of vLLM's own
        connector for features kvtier lacks (`secondary_tiers`, ...) are accepted only with
        the value that asks for nothing, and named as such otherwise; any other key is an
        error.
        The config of kvtier's policy plugin for vLLM (`kvtier.integrations.vllm.policy`,
        `kvtier_<name>`) means kvtier's policy `<name>`.
        """
        _check_mapping(extra, _VLLM_SOURCE)
        mapped: dict[str, Any] = {}
        labels: dict[str, str] = {}
        module_path = None
        for key, raw in extra.items():
            if key == _VLLM_MODULE_PATH:
                module_path = raw
                continue
            if key in _VLLM_ROUTING_KEYS:
                continue
            if key in _VLLM_ONLY:
                _check_vllm_only(key, raw)
                continue
            name = _VLLM_ALIASES.get(key, key)
            if name == "cpu_bytes" and isinstance(raw, float) and raw.is_integer():
                # JSON has one number type: vLLM's own spec takes int(64e9), so kvtier does too.
                raw = int(raw)
            if name in mapped:
                raise ConfigError(
                    f"{labels[name]}={_shown(mapped[name])} and {key}={_shown(raw)} "
                    f"(from {_VLLM_SOURCE}): both set {name}; expected only one of them"
                )
            mapped[name] = raw
            labels[name] = key
        if module_path is not None:
            mapped["cache_policy"] = _join_module_path(module_path, mapped.get("cache_policy"))
            labels["cache_policy"] = f"{_VLLM_MODULE_PATH}:{labels['cache_policy']}"
        return cls._build([(mapped, _VLLM_SOURCE)], labels)

    @classmethod
    def _build(
        cls, layers: list[tuple[dict[str, Any], str]], labels: Mapping[str, str] | None = None
    ) -> KVTierConfig:
        # Each layer maps field name (or, for the environment, variable name) -> raw value.
        values: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(cls)}
        origin = {name: (name, "defaults") for name in values}
        for raw_values, source in layers:
            for key, raw in raw_values.items():
                name, label = _field_for(key, raw, source, labels)
                values[name] = _parse_value(_PARSERS[name], raw, label, source)
                origin[name] = (label, source)
        _check_combination(values, origin)
        config = cls(**values)
        object.__setattr__(config, "_origin", origin)
        return config

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict; `from_dict(cfg.to_dict()) == cfg`."""
        return {name: getattr(self, name) for name in _PARSERS}

    def describe(self, name: str) -> str:
        """Field `name` as errors name it: the key that set it, its value and where it came
        from, e.g. `"KVTIER_CPU_BYTES=1024 (from environment)"`."""
        label, source = self._origin[name]
        return f"{label}={_shown(getattr(self, name))} (from {source})"

    def resolve_blocks_per_chunk(self, device_block_size: int) -> int:
        """Device blocks per chunk for an engine whose device blocks hold `device_block_size`
        tokens: `chunk_tokens // device_block_size` when `chunk_tokens` is set, else
        `blocks_per_chunk` (1 when unset). Raises `ConfigError` when `chunk_tokens` is not a
        multiple of `device_block_size`."""
        try:
            device_block_size = checked_int("device_block_size", device_block_size)
        except ValueError:
            raise ConfigError(
                f"device_block_size={device_block_size!r}: expected a positive int"
            ) from None
        if self.chunk_tokens is None:
            return 1 if self.blocks_per_chunk is None else self.blocks_per_chunk
        # Setting blocks_per_chunk too was refused on construction (_check_combination).
        blocks, rest = divmod(self.chunk_tokens, device_block_size)
        if rest:
            up = (blocks + 1) * device_block_size
            raise ConfigError(
                f"{self.describe('chunk_tokens')}: expected a multiple of the device block "
                f"size ({device_block_size} tokens); use {up}, or set blocks_per_chunk instead"
            )
        return blocks


def _check_mapping(layer: object, source: str) -> Mapping[Any, Any]:
    # A JSON string or None where a dict belongs (e.g. an unparsed kv_connector_extra_config)
    # would otherwise end in AttributeError: 'str' object has no attribute 'items'.
    if not isinstance(layer, Mapping):
        raise ConfigError(
            f"{source} is {layer!r:.80} of type {type(layer).__name__}; "
            "expected a mapping of setting names to values (a dict)"
        )
    return layer


def _shown(raw: object) -> str:
    """`repr(raw)`, or a description where repr raises: an int past 4,300 digits, or a list
    holding one."""
    try:
        return repr(raw)
    except ValueError:
        if isinstance(raw, int):
            digits = int(abs(raw).bit_length() * 0.30103) + 1
            return f"<an integer of about {digits} digits>"
        return f"<a {type(raw).__name__} too large to print>"


def _parse_value(parse: Callable[[object], Any], raw: object, label: str, source: str) -> Any:
    try:
        return parse(raw)
    except _Invalid as e:
        raise ConfigError(f"{label}={_shown(raw)} (from {source}): expected {e.expected}") from None


def _field_for(
    key: object, raw: object, source: str, labels: Mapping[str, str] | None
) -> tuple[str, str]:
    """Map a layer's key to (field name, label used in messages); unknown keys are errors."""
    if not isinstance(key, str):
        raise ConfigError(f"{_shown(key)}={_shown(raw)} (from {source}): expected a string key")
    if source == "environment":
        # Upper case only, as documented: KVTIER_cache_policy beside KVTIER_CACHE_POLICY would
        # set one field twice, with the environment's order picking the winner.
        suffix = key[len(ENV_PREFIX) :]
        name = suffix.lower() if suffix.isupper() else ""
        # The variables that are not settings too: a typo of one (KVTIER_NATIVECOPY) was
        # told "did you mean 'KVTIER_CPU_BYTES'?", a setting it has nothing to do with.
        known = [_ENV_CONFIG_FILE] + [ENV_PREFIX + n.upper() for n in _PARSERS]
        known += sorted(_ENV_NOT_SETTINGS - {_ENV_CONFIG_FILE})
    else:
        name = key
        known = list(_PARSERS)
        if source == _VLLM_SOURCE:
            # The routing keys too: accepted (and ignored), so a list without them misleads.
            known += [
                *_VLLM_ALIASES,
                _VLLM_MODULE_PATH,
                *sorted(_VLLM_ROUTING_KEYS),
                *_VLLM_ONLY,
            ]
    if name not in _PARSERS:
        # vLLM's names, which only from_vllm_extra_config reads: spelling-based matching sent
        # KVTIER_BLOCK_SIZE to KVTIER_MAX_TRACKER_SIZE, and eviction_policy nowhere.
        vllm_name = key[len(ENV_PREFIX) :].lower() if source == "environment" else key
        alias = _VLLM_ALIASES.get(vllm_name) if source != _VLLM_SOURCE else None
        if alias is not None:
            known_name = ENV_PREFIX + alias.upper() if source == "environment" else alias
            hint = f"did you mean {known_name!r}? ({vllm_name!r} is vLLM's name for it); "
        else:
            close = difflib.get_close_matches(
                key.upper() if source == "environment" else key, known, n=1
            )
            hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(
            f"{key}={_shown(raw)} (from {source}): unknown key; {hint}expected one of: "
            + ", ".join(known)
        )
    label = labels.get(name, key) if labels else key
    return name, label


def _env_layer(env: Mapping[str, str]) -> tuple[dict[str, Any], str]:
    # A key that is no string is kept, for _field_for to refuse as in every other layer (its
    # `key.startswith` raised AttributeError here).
    return {
        key: value
        for key, value in env.items()
        if not isinstance(key, str) or (key.startswith(ENV_PREFIX) and key not in _ENV_NOT_SETTINGS)
    }, "environment"


_YAML_INT_TAG: Final = "tag:yaml.org,2002:int"
# YAML 1.2's core schema: an integer is decimal digits. PyYAML resolves YAML 1.1's forms too
# (010 octal 8, 0x10, 0b11, 1:30 sexagesimal 90), which the environment reads as 10 or
# refuses; left as strings, kvtier's own parsers judge them as they judge the environment's.
_YAML_DECIMAL_RE: Final = re.compile(r"^[-+]?[0-9]+$")


_YAML_MERGE_TAG: Final = "tag:yaml.org,2002:merge"


class _ConfigLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in one mapping (PyYAML keeps the last
    one silently, TOML refuses it) and reads only decimal integers as ints.

    A merge key (`<<`) still brings in values that the mapping's own keys override, as YAML
    defines; a key that two merged mappings both set is refused, since PyYAML's choice between
    them depends on whether the two key strings are one object in memory.
    """

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        # Mappings already flattened (by id; every node lives as long as the load). A mapping
        # merged into another is flattened there first; a second pass, when it is built
        # itself, would take the keys it merged for its own and report them as given twice.
        self._flattened: set[int] = set()

    def construct_decimal_int(self, node: yaml.ScalarNode) -> int | str:
        text = self.construct_scalar(node)
        # SafeConstructor reads a leading 0 as octal. Other text reaches this tag only
        # through an explicit `!!int`, and stays a string like the untagged form.
        return int(text) if _YAML_DECIMAL_RE.match(text) else text

    def _refuse(self, node: yaml.Node, problem: str, mark: yaml.Mark) -> NoReturn:
        raise yaml.constructor.ConstructorError(
            "while constructing a mapping", node.start_mark, problem, mark
        )

    def _key(self, key_node: yaml.Node) -> object:
        key = self.construct_object(key_node)
        # An unhashable key is refused by SafeConstructor itself, with its position.
        return key if isinstance(key, Hashable) else object()

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        if id(node) in self._flattened:
            return
        self._flattened.add(id(node))
        own: dict[object, Any] = {}
        sources: list[yaml.Node] = []
        merged_at = None
        for key_node, value_node in node.value:
            if key_node.tag == _YAML_MERGE_TAG:
                if merged_at is not None:  # PyYAML merged both, the first winning
                    problem = (
                        "found merge key '<<' twice; expected it once, with a list "
                        "(<<: [*a, *b]) to merge several mappings"
                    )
                    self._refuse(node, problem, key_node.start_mark)
                merged_at = key_node
                seq = isinstance(value_node, yaml.SequenceNode)
                sources = value_node.value if seq else [value_node]
                continue
            if key_node.tag == "tag:yaml.org,2002:value":  # `=` as a key, as SafeLoader reads it
                key_node.tag = "tag:yaml.org,2002:str"
            key = self._key(key_node)
            if key in own:
                problem = f"found key {_shown(key)} twice; expected each key once"
                self._refuse(node, problem, key_node.start_mark)
            own[key] = (key_node, value_node)
        merged: dict[object, Any] = {}
        for source in sources:
            if not isinstance(source, yaml.MappingNode):
                kind = "scalar" if isinstance(source, yaml.ScalarNode) else "sequence"
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"expected a mapping or a list of mappings to merge, found a {kind}",
                    source.start_mark,
                )
            self.flatten_mapping(source)
            for key_node, value_node in source.value:
                key = self._key(key_node)
                if key in merged:
                    problem = (
                        f"found key {_shown(key)} in two of the mappings merged by '<<'; "
                        "expected it in one of them, or set in this mapping to override both"
                    )
                    self._refuse(node, problem, key_node.start_mark)
                merged[key] = (key_node, value_node)
        node.value = [pair for key, pair in merged.items() if key not in own]
        node.value += list(own.values())


_ConfigLoader.yaml_implicit_resolvers = {
    first: [
        (tag, _YAML_DECIMAL_RE if tag == _YAML_INT_TAG else regexp) for tag, regexp in resolvers
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_ConfigLoader.add_constructor(_YAML_INT_TAG, _ConfigLoader.construct_decimal_int)


def _read_file(path: Path, name: str) -> dict[str, Any]:
    """The file's mapping; `name` is how errors call the file ("config file X ...")."""
    suffix = path.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            with path.open(encoding="utf-8") as f:
                data = yaml.load(f, Loader=_ConfigLoader)
        elif suffix == ".toml":
            # utf-8-sig: a leading byte order mark (Notepad's, PowerShell's) is skipped, as
            # PyYAML skips it; tomllib refused it as "Invalid statement (at line 1, column 1)".
            text = path.read_bytes().decode("utf-8-sig")
            try:
                data = tomllib.loads(text)
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{name} is not valid TOML: {_toml_problem(e, text)}") from e
        else:
            raise ConfigError(f"{name}: unknown format {suffix!r}; expected .yaml, .yml or .toml")
    except OSError as e:
        raise ConfigError(f"{name} cannot be read: {e}") from e
    except UnicodeDecodeError as e:  # both parsers decode as they read; neither names the file
        raise ConfigError(f"{name} is not UTF-8 text: {e}") from e
    except yaml.YAMLError as e:
        hint = ""
        if isinstance(e, yaml.scanner.ScannerError) and "'\\t'" in (e.problem or ""):
            # PyYAML refuses a tab to indent and, unlike YAML 1.2, after `key:` too.
            hint = "\nindent with spaces, and put a space, not a tab, after 'key:'"
        raise ConfigError(f"{name} is not valid YAML: {e}{hint}") from e
    except ConfigError:
        raise
    except ValueError as e:  # a number the parser cannot convert: an int of 4,300+ digits
        raise ConfigError(f"{name} holds a value it cannot read: {e}") from e
    if data is None:  # an empty YAML file, or one of comments only: no settings
        return {}
    if not isinstance(data, dict):
        # A str is often another format's line: `cpu_bytes=64GiB`, `cpu_bytes 64GiB`.
        raise ConfigError(
            f"{name} holds a {type(data).__name__}; expected a mapping of setting names to "
            f"values such as 'cpu_bytes: 64GiB', not {_shown(data):.80}"
        )
    return cast(dict[str, Any], data)


_TOML_AT_RE: Final = re.compile(r"\(at line ([0-9]+), column [0-9]+\)$")


def _toml_problem(error: tomllib.TOMLDecodeError, text: str) -> str:
    """tomllib's message with the text of the line it names: "Cannot overwrite a value (at
    line 3, column 19)" alone names neither the key set twice nor the table declared twice."""
    message = str(error)
    match = _TOML_AT_RE.search(message)
    lines = text.splitlines()
    if match is None or not 1 <= int(match.group(1)) <= len(lines):
        return message
    line = lines[int(match.group(1)) - 1].strip()
    if message.startswith("Cannot overwrite a value"):
        message += "; a key may be set once"
    return f"{message}, in: {line[:120]!r}"


def _join_module_path(module_path: object, name: object) -> str:
    # vLLM looks `eviction_policy` up in its registry first and imports it from
    # cache_policy_module_path only when it is not a registered name.
    if not isinstance(module_path, str) or not module_path.strip() or ":" in module_path:
        raise ConfigError(
            f"{_VLLM_MODULE_PATH}={module_path!r} (from {_VLLM_SOURCE}): "
            "expected a Python module path such as 'my_pkg.policies'"
        )
    if not isinstance(name, str) or not name.strip() or ":" in name:
        raise ConfigError(
            f"{_VLLM_MODULE_PATH}={module_path!r} with eviction_policy={name!r} "
            f"(from {_VLLM_SOURCE}): expected eviction_policy to name a class in that module"
        )
    module_path, name = module_path.strip(), name.strip()
    if name in registered_policies():
        return name
    if module_path == _VLLM_PLUGIN_MODULE:
        # The plugin config for vLLM's OffloadingConnector (docs/vllm.md): its class wraps
        # kvtier's own policy, which kvtier's connector uses directly.
        policy = name.removeprefix(VLLM_POLICY_PREFIX)
        if name.startswith(VLLM_POLICY_PREFIX) and policy in registered_policies():
            return policy
        names = ", ".join(VLLM_POLICY_PREFIX + n for n in registered_policies())
        raise ConfigError(
            f"{_VLLM_MODULE_PATH}={module_path!r} with eviction_policy={name!r} "
            f"(from {_VLLM_SOURCE}): expected one of that module's policies ({names}), or a "
            "registered kvtier policy name alone, e.g. eviction_policy='arc'"
        )
    return f"{module_path}:{name}"


def _check_combination(values: Mapping[str, Any], origin: Mapping[str, tuple[str, str]]) -> None:
    def where(name: str) -> str:
        label, source = origin[name]
        return f"{label}={values[name]!r} (from {source})"

    if values["cpu_bytes"] is not None and values["num_slots"] is not None:
        raise ConfigError(
            f"{where('cpu_bytes')} and {where('num_slots')}: expected only one of them to be set"
        )
    # As vLLM refuses block_size with blocks_per_chunk: even values that agree for one engine
    # block size disagree for another.
    if values["chunk_tokens"] is not None and values["blocks_per_chunk"] is not None:
        raise ConfigError(
            f"{where('chunk_tokens')} and {where('blocks_per_chunk')}: expected only one of "
            "them to be set (both size a chunk: in tokens and in device blocks)"
        )
