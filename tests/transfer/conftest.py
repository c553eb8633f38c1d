"""Fixtures for transfer tests."""

from __future__ import annotations

import pytest

from kvtier.transfer.testing import LAYOUTS


@pytest.fixture(params=sorted(LAYOUTS))
def layout(request: pytest.FixtureRequest) -> str:
    """Every supported layout."""
    return str(request.param)
