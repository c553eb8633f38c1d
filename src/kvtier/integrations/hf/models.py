"""Small seeded random-weight transformers models for demos and tests (no download needed).

Why not transformers' default initialisation: with `initializer_range=0.02` a 256-wide
untrained model has next-token logits of standard deviation ~0.3 over the vocabulary (nearly
flat), and greedy decoding falls into a context-free 2-token cycle, so "same tokens with and
without kvtier" would check almost nothing. `make_demo_model` instead

- draws every weight from N(0, 0.05²) (`initializer_range=0.05`): the attention and MLP
  blocks then move the residual stream enough that the greedy choice depends on the context
  (a 64-token greedy run visits ~30 distinct tokens instead of 2), while staying short of the
  chaotic regime where float32 rounding gets amplified layer after layer (at 0.2 the logit
  difference between two summation orders grows ~20x);
- multiplies the final norm's gain by `logit_scale=4`, so logits have a standard deviation of
  ~3, the spread of a trained LM's logits; the median top-1 minus top-2 margin is then ~0.6.

Measured by tests/integrations/hf/test_models.py on a 6-turn chat: the smallest greedy margin
is still hundreds of times the largest logit difference that reusing offloaded KV causes, so a
token mismatch means wrong KV, not rounding. Scaling the output alone cannot do better than
that ratio (rounding differences scale with it); only sharper, less context-dependent models
can, which would make the token check weaker.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import numbers
import operator
from typing import Any, Final

import torch

__all__ = ["DEMO_ARCHS", "demo_config", "make_demo_model"]

DEMO_ARCHS: Final = ("llama", "qwen2", "mistral")
"""Architectures `make_demo_model` builds."""

_SEED_MIN: Final = -(2**63)
_SEED_MAX: Final = 2**64 - 1  # the seeds torch.manual_seed takes

_DEFAULT_SIZE: Final[dict[str, Any]] = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention, as in current Llama/Qwen2/Mistral
    "max_position_embeddings": 4096,
    "initializer_range": 0.05,
    "tie_word_embeddings": False,
}

_READ_UNDECLARED: Final = frozenset({"head_dim"})
"""Fields a config class may not define that the demo architectures' models still read
(`getattr(config, "head_dim", ...)`: Qwen2Config has no `head_dim`, Qwen2 attention takes it)."""


_SHAPE_FIELDS: Final = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "head_dim",
)
"""Sizes that must be positive ints: transformers builds a model from 0 or -1 layers, or a
0-token vocabulary, which then fails at its first forward, far from the bad value."""


def _config_class(arch: str) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
    if arch not in classes:
        raise ValueError(f"arch={arch!r} is not supported; expected one of {', '.join(DEMO_ARCHS)}")
    return classes[arch]


def _declared_fields(config_cls: Any) -> set[str]:
    """The fields `config_cls` defines: its dataclass fields (transformers 5) or its
    `__init__` parameters, the aliases of its `attribute_map`, and `_READ_UNDECLARED`."""
    if dataclasses.is_dataclass(config_cls):
        names = {f.name for f in dataclasses.fields(config_cls)}
    else:
        params = inspect.signature(config_cls.__init__).parameters.values()
        names = {p.name for p in params if p.kind is not p.VAR_KEYWORD}
    names.update(getattr(config_cls, "attribute_map", {}))
    names.discard("self")
    return names | _READ_UNDECLARED


def demo_config(arch: str = "llama", **size: Any) -> Any:
    """The config `make_demo_model(arch, **size)` builds its model from, without the model.

    A `size` field that `arch`'s config class does not define is refused: transformers would
    keep it as a stray attribute and build the default size instead (`hiden_size=8`)."""
    config_cls = _config_class(arch)
    for name in _SHAPE_FIELDS:
        value = size.get(name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1
        ):
            raise ValueError(f"{name}={value!r} is invalid; expected a positive int")
    # The strict configs refuse a numpy int where they expect int.
    ints = {n: int(v) for n, v in size.items() if n in _SHAPE_FIELDS and v is not None}
    fields = {**_DEFAULT_SIZE, **size, **ints}
    if arch == "mistral":
        fields.setdefault("sliding_window", None)
    try:
        config = config_cls(**fields)
    except Exception as e:
        # transformers 5's configs are strict dataclasses whose errors (a float field given
        # 1, sizes that do not divide) derive from Exception alone: callers catch ValueError.
        if not type(e).__name__.startswith("StrictDataclass"):
            raise
        raise ValueError(f"{config_cls.__name__} (arch={arch!r}) refused its fields: {e}") from e
    declared = _declared_fields(config_cls)
    # Keyword aliases the class consumes (`rope_theta` into `rope_parameters`) are no stray
    # attribute: only a name the config kept as given and does not define is one.
    stray = [name for name in size if name not in declared and name in vars(config)]
    if stray:
        name = stray[0]
        public = sorted(n for n in declared if not n.startswith("_"))
        close = difflib.get_close_matches(name, public, n=1)
        expected = f"did you mean {close[0]!r}?" if close else "expected a field it defines"
        raise ValueError(
            f"{name}={size[name]!r} is not a field of {config_cls.__name__} (arch={arch!r}); "
            f"{expected}"
        )
    return config


def make_demo_model(
    arch: str = "llama", seed: int = 0, *, logit_scale: float = 4.0, **size: Any
) -> tuple[Any, Any]:
    """A small float32 model of `arch` with seeded random weights, in eval mode: (model, config).

    `size` overrides config fields (`hidden_size`, `num_hidden_layers`, `vocab_size`,
    `initializer_range`, ...; a name `arch`'s config does not define is a `ValueError` that
    suggests the closest field, as is a size that is not a positive int or that the config
    class refuses); `logit_scale` (a positive finite number) multiplies the final
    norm's gain. The same `arch`, `seed` and `size` give bit-identical weights in
    every process. Mistral gets `sliding_window=None` unless `size` sets one, so the default
    model attends to its whole context like the other two.
    """
    from transformers import AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM  # untyped upstream

    _config_class(arch)  # the architecture first: the other checks name it
    try:
        index = None if isinstance(seed, bool) else operator.index(seed)  # numpy ints too
    except TypeError:
        index = None
    if index is None or not _SEED_MIN <= index <= _SEED_MAX:
        # torch.manual_seed fails past its range with "Overflow when unpacking long long".
        raise ValueError(f"seed={seed!r} is invalid; expected an int from -2**63 to 2**64 - 1")
    # True passed as 1.0, a string failed on a bare comparison error, and inf gave a model
    # whose logits are all inf or NaN.
    if (
        isinstance(logit_scale, bool)
        or not isinstance(logit_scale, numbers.Real)
        or not 0 < logit_scale < math.inf
    ):
        raise ValueError(
            f"logit_scale={logit_scale!r} is invalid; expected a positive finite float"
        )
    config = demo_config(arch, **size)
    # Seed a private generator state: the caller's global RNG stream is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Scale the final norm's gain, not the output matrix: logits are linear in it, and with
        # tied embeddings scaling the shared matrix would also scale the inputs.
        model.model.norm.weight.mul_(logit_scale)
    model.eval()
    return model, config
