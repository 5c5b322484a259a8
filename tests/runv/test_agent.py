"""The guest agent's request handling in-process, over a real channel (no VM, no root)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backends.runv.agent import messages as m
from backends.runv.agent.client import AgentClient
from backends.runv.agent.protocol import Channel
from backends.runv.agent.server import Agent
from shim.cri import errors


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
    hello = await client.call(m.HelloRequest())
    assert hello.version == 1 and hello.containers == 0
    assert await client.call(m.ListRequest()) == m.ContainerList(containers=[])


@pytest.mark.parametrize(
    "req",
    [
        m.StateRequest(id="nope"),
        m.StartRequest(id="nope"),
        m.SignalRequest(id="nope"),
        m.WaitRequest(id="nope"),
        m.ExecRequest(id="nope", stream=99, args=["true"]),
        m.StatsRequest(id="nope"),
        m.OutputRequest(id="nope", stream=99),
    ],
    ids=lambda r: r.OP,
)
async def test_unknown_container_is_not_found(client: AgentClient, req: m.Request[m.Message]) -> None:
    with pytest.raises(errors.NotFoundError, match="nope"):
        await client.call(req)


async def test_remove_is_idempotent_and_unknown_op(client: AgentClient) -> None:
    assert await client.call(m.RemoveRequest(id="never-existed")) == m.Empty()
    with pytest.raises(errors.UnimplementedError, match="frobnicate"):
        await client.raw("frobnicate", {})


async def test_create_reports_bad_rootfs(client: AgentClient, tmp_path: Path) -> None:
    spec = m.ContainerSpec(args=["true"], rootfs=m.Rootfs(path=str(tmp_path / "missing")))
    with pytest.raises(errors.FailedPreconditionError):
        await client.call(m.CreateRequest(id="c1", spec=spec))
    assert await client.call(m.ListRequest()) == m.ContainerList()  # nothing half-created


@pytest.mark.parametrize(
    ("op", "args", "field"),
    [
        ("start", {}, "id: missing"),
        ("signal", {"id": "c1", "signal": "TERM"}, "signal: expected int, got str"),
        ("create", {"id": "c1", "spec": {"args": ["sh", 1]}}, r"spec.args\[1\]: expected str, got int"),
        (
            "create",
            {"id": "c1", "spec": {"args": [], "rootfs": []}},
            "spec.rootfs: expected object, got list",
        ),
        ("exec", {"id": "c1", "stream": True, "args": []}, "stream: expected int, got bool"),
        ("setup", {"sysctls": {"net.x": 1}}, "sysctls.net.x: expected str, got int"),
    ],
    ids=["missing", "wrong-type", "list-item", "nested-object", "bool-is-not-int", "map-value"],
)
async def test_bad_arguments_are_invalid_naming_the_field(
    client: AgentClient, op: str, args: dict[str, object], field: str
) -> None:
    with pytest.raises(errors.InvalidArgumentError, match=f"agent {op}: {field}"):
        await client.raw(op, dict(args))
    assert await client.call(m.ListRequest()) == m.ContainerList()
