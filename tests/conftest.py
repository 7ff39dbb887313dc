"""Fixtures shared by the suite: the tiny models every engine test builds on (made here, in memory:
nothing is downloaded) and the device-check mode."""

from __future__ import annotations

import pytest

from tests.device_check import DeviceCheck
from tests.tiny import tiny_loaded


@pytest.fixture(scope="session")
def tiny_pair():
    """A tiny Llama target (2 layers) and a 1-layer draft with different weights, sharing a vocabulary."""
    return tiny_loaded("llama", seed=0), tiny_loaded("llama", seed=1, layers=1)


@pytest.fixture(scope="session")
def tiny_target():
    return tiny_loaded("llama", seed=0)


@pytest.fixture
def device_check():
    """A :class:`DeviceCheck` mode, entered for the test's duration."""
    with DeviceCheck() as mode:
        yield mode
