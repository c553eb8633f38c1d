"""Policy parameters that are not numbers get an error naming them (review 4)."""

from __future__ import annotations

import pytest

from kvtier.policies import KVAwarePolicy, S3FIFOPolicy


@pytest.mark.parametrize("bad", ["0.1", None, [0.1], 0, 1.0, float("nan")])
def test_fraction_parameters_get_a_clear_error(bad: object) -> None:
    # A str or None raised "'<' not supported between instances", naming no setting.
    with pytest.raises(ValueError, match=r"window=.* is invalid; expected a number"):
        KVAwarePolicy(16, window=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"small_ratio=.* is invalid; expected a number"):
        S3FIFOPolicy(16, small_ratio=bad)  # type: ignore[arg-type]
