"""Fixtures for tests against the real Docker Engine started by scripts/testenv/up.

Without an engine the tests skip, except in CI (CI=true) where a missing
engine is a failure: a green run must have exercised the backend.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import docker
import pytest

from backends.docker import labels as lbl
from tests.docker.dockerkit import BUSYBOX, ENDPOINT, PAUSE, Harness, harnessed, unstarted_backend


def _engine_problem() -> str | None:
    path = ENDPOINT.removeprefix("unix://")
    if ENDPOINT.startswith("unix://") and not os.path.exists(path):
        return f"no Docker engine socket at {path}; run scripts/testenv/up"
    try:
        client = docker.APIClient(base_url=ENDPOINT, version="1.41", timeout=5)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:
        return f"no Docker engine at {ENDPOINT} ({exc}); run scripts/testenv/up"
    return None


def _remove_stale_test_containers(client: docker.APIClient) -> None:
    """Containers of earlier test runs that died before their clean-up (instance test-PID, PID gone)."""
    for row in client.containers(all=True, filters={"label": lbl.INSTANCE}):
        instance = (row.get("Labels") or {}).get(lbl.INSTANCE, "")
        pid = instance.removeprefix("test-")
        if instance.startswith("test-") and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            client.remove_container(row["Id"], force=True)


@pytest.fixture(scope="session")
def engine() -> Iterator[docker.APIClient]:
    problem = _engine_problem()
    if problem:
        if os.environ.get("CI") == "true":
            pytest.fail(problem)
        pytest.skip(problem)
    client = docker.APIClient(base_url=ENDPOINT, version="1.41", timeout=60)
    _remove_stale_test_containers(client)
    # The images the tests use come from the local registry; pull them once.
    for ref in (BUSYBOX, PAUSE):
        client.pull(ref)
    yield client
    client.close()


@pytest.fixture
async def harness(engine: docker.APIClient) -> AsyncIterator[Harness]:
    async with harnessed(unstarted_backend(), engine) as h:
        yield h
