"""`make_demo_model` refuses a seed torch cannot take with a ValueError naming it (before,
`torch.manual_seed` failed with "Overflow when unpacking long long"), and still takes every
seed torch does, numpy ints included."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
np = pytest.importorskip("numpy")

from kvtier.integrations.hf.models import make_demo_model  # noqa: E402

TINY = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "vocab_size": 64}


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30, 1.5, True, "0"])
def test_a_seed_torch_cannot_take_is_named(seed: object) -> None:
    with pytest.raises(ValueError, match=r"seed=.* is invalid; expected an int from -2\*\*63"):
        make_demo_model("llama", seed, **TINY)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63), np.int64(7)])
def test_every_seed_torch_takes_still_builds(seed: int) -> None:
    a, _ = make_demo_model("llama", seed, **TINY)
    b, _ = make_demo_model("llama", int(seed), **TINY)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
