"""Fixtures for the connector tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine_sim import Engine


@pytest.fixture
def engine() -> Iterator[Engine]:
    """A fresh simulated engine (`engine_sim.Engine`), its transfer worker shut down after."""
    e = Engine()
    yield e
    e.close()
