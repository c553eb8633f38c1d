"""Shared fixtures for kvtier's tests."""

from __future__ import annotations

import pytest

from kvtier.policies import registered_policies


@pytest.fixture(params=sorted(registered_policies()))
def policy_name(request: pytest.FixtureRequest) -> str:
    """Every registered cache policy, one test run each."""
    return str(request.param)
