"""Worker reports are checked field by field before any is applied: a dataclass checks no
types, and a truthy `success` string had a failed load served as good data."""

from __future__ import annotations

import numpy as np
import pytest

from engine_sim import sent_load
from kvtier.base import TransferResult


@pytest.mark.parametrize("success", ["False", "0", None, 1, 1.0])
def test_a_load_reported_with_a_success_that_is_not_a_bool_is_refused_then_failed(
    success: object,
) -> None:
    m, s, load_id = sent_load(1)
    with pytest.raises(ValueError, match=rf"job {load_id} has success=.*expected a bool"):
        s.on_worker_results([TransferResult(load_id, success)])  # type: ignore[arg-type]
    assert m.get_stats().pinned == 2 and s.num_jobs_in_flight() == 2  # nothing applied
    assert s.fail_unreported() == [load_id]
    done = s.take_finished()
    assert (done.recving, done.failed_loads, done.failed_load_blocks) == ({"b"}, {"b"}, {4})
    assert s.bytes_loaded == 0


@pytest.mark.parametrize(
    ("nbytes", "seconds", "field"),
    [
        (-4096, 0.1, "bytes"),
        (4096.0, 0.1, "bytes"),
        (True, 0.1, "bytes"),
        ("4096", 0.1, "bytes"),
        (4096, float("nan"), "seconds"),
        (4096, float("inf"), "seconds"),
        (4096, -0.5, "seconds"),
        (4096, "0.1", "seconds"),
    ],
)
def test_bad_figures_are_refused_before_the_batch_is_applied(
    nbytes: object, seconds: object, field: str
) -> None:
    m, s, load_id = sent_load(1)
    good = TransferResult(load_id, True, 4096, 0.25)
    bad = TransferResult(load_id, True, nbytes, seconds)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=rf"{field}=.*expected"):
        s.on_worker_results([good, bad])
    assert (s.bytes_loaded, s.load_seconds) == (0, 0.0)
    assert m.get_stats().pinned == 2 and s.num_jobs_in_flight() == 2
    s.on_worker_results([good])  # the job is still in flight and takes a good report
    assert s.take_finished().recving == {"b"}
    assert (s.bytes_loaded, s.load_seconds) == (4096, 0.25)


def test_numpy_fields_are_taken_as_what_they_hold() -> None:
    _, s, load_id = sent_load(1)
    s.on_worker_results([TransferResult(load_id, np.bool_(True), np.int64(512), np.float32(0.5))])  # type: ignore[arg-type]
    done = s.take_finished()
    assert (done.recving, done.failed_loads) == ({"b"}, set())
    assert (s.bytes_loaded, s.load_seconds) == (512, 0.5)
