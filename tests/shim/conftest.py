"""The services under test, built fresh for each test (tests/shim/services_kit.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.shim.services_kit import Kit, open_kit


@pytest.fixture
async def kit(tmp_path: Path) -> AsyncIterator[Kit]:
    async with open_kit(str(tmp_path)) as k:
        yield k
