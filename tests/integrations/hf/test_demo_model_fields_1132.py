"""make_demo_model's size fields: bad values are ValueErrors that name them, before a model is
built, and numpy ints are taken as ints."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers")

from kvtier.integrations.hf.models import demo_config, make_demo_model


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_hidden_layers", -1),  # built, then failed at forward: "__len__() should return >= 0"
        ("num_hidden_layers", 0),
        ("vocab_size", 0),  # built, then failed at forward in index_select
        ("hidden_size", 0),  # ZeroDivisionError inside the rotary embedding's setup
        ("head_dim", 2.0),
        ("num_key_value_heads", True),
    ],
)
def test_non_positive_or_non_int_sizes_are_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"{field}={value!r} is invalid; expected a positive int"):
        make_demo_model("llama", **{field: value})


@pytest.mark.parametrize(
    ("size", "names"),
    [
        ({"initializer_range": 1}, "initializer_range"),  # strict dataclass: float field, int
        ({"hidden_size": 30, "num_attention_heads": 4}, "not a multiple"),
    ],
)
def test_the_config_class_refusals_are_value_errors(size: dict[str, Any], names: str) -> None:
    with pytest.raises(ValueError, match=rf"(?s)LlamaConfig \(arch='llama'\) refused.*{names}"):
        demo_config("llama", **size)


def test_numpy_ints_are_taken_as_ints() -> None:
    config = demo_config("qwen2", hidden_size=np.int64(64), num_hidden_layers=np.int32(2))
    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)
    assert type(config.hidden_size) is int
