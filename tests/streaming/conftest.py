from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from shim.streaming import StreamingConfig, StreamingServer
from tests.streaming.streaming_helpers import FakeRuntime, echo_server, task_origin


@pytest.fixture
def runtime() -> FakeRuntime:
    return FakeRuntime()


@pytest.fixture
def config() -> StreamingConfig:
    return StreamingConfig(stream_creation_timeout=5.0)


@pytest.fixture
async def server(runtime: FakeRuntime, config: StreamingConfig) -> AsyncIterator[StreamingServer]:
    srv = StreamingServer(runtime, config)
    await srv.start()
    yield srv
    await srv.stop()
    # Nothing of the server may outlive stop().
    leftovers = [t for t in asyncio.all_tasks() if not t.done() and "shim/streaming" in task_origin(t)]
    assert not leftovers, leftovers


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    srv, port = await echo_server()
    yield port
    srv.close()
    await srv.wait_closed()
