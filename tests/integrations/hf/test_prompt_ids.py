"""`generate_one` names a prompt's bad token id and its position, where torch's conversion
would not: an id past int64 ("Overflow when unpacking long long"), a uint64 id past 2**63 - 1
(wrapped to a negative id and reported as that), a bool among ints (read as 0 or 1), a string
or None. Nothing is left held afterwards: the generator serves the next prompt."""

from __future__ import annotations

from typing import Any

import pytest

from helpers import assert_generator_clean

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
np = pytest.importorskip("numpy")

from kvtier.config import KVTierConfig  # noqa: E402
from kvtier.integrations.hf.generator import KVTierGenerator  # noqa: E402
from kvtier.integrations.hf.models import make_demo_model  # noqa: E402


@pytest.fixture(scope="module")
def gen() -> Any:
    model, _ = make_demo_model("llama", 0, num_hidden_layers=1)
    with KVTierGenerator(model, KVTierConfig(num_slots=8), max_blocks=8) as g:
        yield g


@pytest.mark.parametrize(
    ("prompt", "error", "names"),
    [
        ([2**70, 1], IndexError, f"token id {2**70} at position 0"),
        ([1, 2**63], IndexError, f"token id {2**63} at position 1"),
        (np.array([1, 2**64 - 1], dtype=np.uint64), IndexError, f"token id {2**64 - 1} at "),
        (torch.tensor([1, 2, 2**63], dtype=torch.uint64), IndexError, f"id {2**63} at position 2"),
        ([5, True], TypeError, "token id True at position 1"),
        ((3, False), TypeError, "token id False at position 1"),
        (["a", "b"], TypeError, "token id 'a' at position 0"),
        ([1, None], TypeError, "token id None at position 1"),
        ([np.int64(4), "x"], TypeError, "token id 'x' at position 1"),  # a numpy int is an id
        ("abc", TypeError, "expected one prompt's integer token ids"),
    ],
)
def test_a_bad_token_id_is_named_with_its_position(
    gen: Any, prompt: Any, error: type[Exception], names: str
) -> None:
    with pytest.raises(error) as info:
        gen.generate_one(prompt, 2)
    assert names in str(info.value), info.value
    assert "-1" not in str(info.value)  # never the wrapped id
    assert_generator_clean(gen)  # the refused prompt left nothing held
    assert gen.generate_one([1, 2, 3], 2).tokens.shape == (2,)


def test_uint64_ids_in_range_still_run(gen: Any) -> None:
    a = gen.generate_one(torch.tensor([1, 5, 9], dtype=torch.uint64), 2)
    b = gen.generate_one([1, 5, 9], 2)
    assert torch.equal(a.tokens, b.tokens)
