"""The guest agent's request handling in-process, over a real channel (no VM, no root)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backends.runv.agent import messages as m
from backends.runv.agent import vm
from backends.runv.agent.client import AgentClient
from backends.runv.agent.guest import Guest
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
    assert hello.version == vm.VERSION and hello.containers == 0
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


async def test_network_gives_the_nic_what_cni_gave_its_interface(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MAC before the link is up, every address, then the routes, IPv6 ones with -6."""
    ran: list[list[str]] = []

    async def run(argv: list[str]) -> None:
        ran.append(argv)

    g = Guest(str(tmp_path), "/test")
    monkeypatch.setattr(g, "run", run)
    req = m.NetworkRequest(
        interface="eth0",
        name="eth0",
        address="10.252.0.5/24",
        more_addresses=["fd00::5/64"],
        mtu=1450,
        mac="0a:58:0a:fc:00:05",
        routes=[m.Route("default", "10.252.0.1"), m.Route("fd01::/64", "fd00::1"), m.Route("10.9.0.0/16")],
    )
    assert await vm.network(g, req) == m.NetworkResult(name="eth0")
    assert ran == [
        ["ip", "link", "set", "dev", "eth0", "address", "0a:58:0a:fc:00:05"],
        ["ip", "link", "set", "dev", "eth0", "mtu", "1450"],
        ["ip", "addr", "replace", "10.252.0.5/24", "dev", "eth0"],
        ["ip", "addr", "replace", "fd00::5/64", "dev", "eth0"],
        ["ip", "link", "set", "dev", "eth0", "up"],
        ["ip", "route", "replace", "default", "via", "10.252.0.1", "dev", "eth0"],
        ["ip", "-6", "route", "replace", "fd01::/64", "via", "fd00::1", "dev", "eth0"],
        ["ip", "route", "replace", "10.9.0.0/16", "dev", "eth0"],
    ]
