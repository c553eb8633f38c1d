"""Policy parameters that are not numbers get an error naming them (review 4)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.policies import KVAwarePolicy, S3FIFOPolicy


@pytest.mark.parametrize(
    "bad", ["0.1", None, [0.1], 0, 1.0, float("nan"), True, np.float32(1.5), np.bool_(True)]
)
def test_fraction_parameters_get_a_clear_error(bad: object) -> None:
    # A str or None raised "'<' not supported between instances", naming no setting.
    with pytest.raises(ValueError, match=r"window=.* is invalid; expected a number"):
        KVAwarePolicy(16, window=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"small_ratio=.* is invalid; expected a number"):
        S3FIFOPolicy(16, small_ratio=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("ratio", [np.float32(0.25), np.float64(0.25), 0.25])
def test_fraction_parameters_take_any_real_number(ratio: object) -> None:
    assert KVAwarePolicy(400, window=ratio)._win_target == 100  # type: ignore[arg-type]
    assert S3FIFOPolicy(400, small_ratio=ratio)._small_target == 100  # type: ignore[arg-type]
