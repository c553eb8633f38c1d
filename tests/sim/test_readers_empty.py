"""Trace readers: a line with no hash ids but a prompt, and null fields."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.sim.readers import read_mooncake
from kvtier.sim.trace import TraceFormatError


@pytest.mark.parametrize(("length", "needed"), [(10, 1), (512, 1), (513, 2), (5000, 10)])
def test_empty_hash_ids_with_a_prompt_name_what_is_expected(
    tmp_path: Path, length: int, needed: int
) -> None:
    """It said 'expected -511..0': a range of lengths that has no valid member but 0."""
    path = tmp_path / "t.jsonl"
    path.write_text(f'{{"input_length": 3, "hash_ids": [1]}}\n{{"input_length": {length}, '
                    '"hash_ids": []}\n')  # fmt: skip
    with pytest.raises(TraceFormatError) as info:
        list(read_mooncake(path))
    message = str(info.value)
    assert message == (
        f"{path}:2: input_length={length} does not fit 0 blocks (hash_ids is empty); expected "
        f"input_length=0, or {needed} hash ids of 512-token blocks"
    )
    assert "-511" not in message


def test_an_empty_request_is_still_read(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"input_length": 0, "hash_ids": []}\n')
    [request] = read_mooncake(path)
    assert request.keys == [] and request.input_length == 0


def test_null_is_absent_for_an_optional_field_only(tmp_path: Path) -> None:
    """`"output_length": null` was reported as a missing field; like `timestamp`, null means
    "not given", which an optional field may be and a required one may not."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"input_length": 3, "output_length": null, "hash_ids": [1]}\n')
    [request] = read_mooncake(path)
    assert request.output_length == 0
    path.write_text('{"input_length": null, "hash_ids": [1]}\n')
    with pytest.raises(TraceFormatError, match=r":1: input_length=null is invalid; expected an "):
        list(read_mooncake(path))
    path.write_text('{"hash_ids": [1]}\n')
    with pytest.raises(TraceFormatError, match=r":1: missing field 'input_length'"):
        list(read_mooncake(path))
