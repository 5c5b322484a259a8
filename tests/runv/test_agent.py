"""The guest agent's request handling in-process, over a real channel (no VM, no root)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backends.runv.agent.client import AgentClient
from backends.runv.agent.protocol import Channel
from backends.runv.agent.server import Agent
from shim import errors


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[AgentClient]:
    agent = Agent(str(tmp_path), "/test")
    a, b = socket.socketpair()
    r1, w1 = await asyncio.open_connection(sock=a)
    r2, w2 = await asyncio.open_connection(sock=b)
    agent.host = Channel(r2, w2, agent.handle)
    agent.host.start()
    c = AgentClient(r1, w1, lambda n, body: None, timeout=2.0)
    yield c
    await c.close()
    await agent.host.aclose()


async def test_hello_and_empty_list(client: AgentClient) -> None:
    hello = await client.call("hello")
    assert hello["version"] == 1 and hello["containers"] == 0
    assert await client.call("list") == {"containers": []}


@pytest.mark.parametrize("op", ["state", "start", "signal", "wait", "exec", "stats", "output"])
async def test_unknown_container_is_not_found(client: AgentClient, op: str) -> None:
    with pytest.raises(errors.NotFoundError, match="nope"):
        await client.call(op, id="nope", stream=99, args=["true"])


async def test_remove_is_idempotent_and_unknown_op(client: AgentClient) -> None:
    assert await client.call("remove", id="never-existed") == {}
    with pytest.raises(errors.UnimplementedError, match="frobnicate"):
        await client.call("frobnicate")


async def test_create_reports_bad_rootfs(client: AgentClient, tmp_path: Path) -> None:
    spec = {"rootfs": {"path": str(tmp_path / "missing")}, "args": ["true"]}
    with pytest.raises(errors.FailedPreconditionError):
        await client.call("create", id="c1", spec=spec)
    assert await client.call("list") == {"containers": []}  # nothing half-created
