"""The guest agent: serves the agent protocol inside a VM and runs containers with runc.

This module is the connection and the dispatch: an operation name selects a request
type (``messages``) and its handler; the handlers live by concern in ``vm`` (hello,
setup, network, shutdown), ``containers`` (lifecycle and the OCI bundle), ``streams``
(output, attach, exec, resize, port-forward) and ``stats``, over the shared state of
``guest``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from backends.runv.agent import containers, proc, stats, streams, vm
from backends.runv.agent.guest import Guest
from backends.runv.agent.messages import (
    AttachRequest,
    CreateRequest,
    ExecKillRequest,
    ExecRequest,
    HelloRequest,
    ListRequest,
    Message,
    MetricsRequest,
    NetworkRequest,
    OutputRequest,
    PortForwardRequest,
    RemoveRequest,
    Request,
    ResizeRequest,
    SetupRequest,
    ShutdownRequest,
    SignalRequest,
    StartRequest,
    StateRequest,
    StatsRequest,
    UpdateRequest,
    WaitRequest,
)
from backends.runv.agent.protocol import AgentError, Channel

Q = TypeVar("Q", bound=Request[Any])
Handler = Callable[[Guest, Any], Awaitable[Message]]
Route = tuple[type[Request[Any]], Handler]


# operation name -> (request type, handler)
ROUTES: dict[str, Route] = {}


def _route(req: type[Q], handler: Callable[[Guest, Q], Awaitable[Message]]) -> None:
    """Add a table entry; mypy checks that ``handler`` takes a ``req``."""
    ROUTES[req.OP] = (req, handler)


_route(HelloRequest, vm.hello)
_route(SetupRequest, vm.setup)
_route(NetworkRequest, vm.network)
_route(ShutdownRequest, vm.shutdown)
_route(CreateRequest, containers.create)
_route(StartRequest, containers.start)
_route(SignalRequest, containers.signal_)
_route(WaitRequest, containers.wait)
_route(StateRequest, containers.state)
_route(ListRequest, containers.list_)
_route(RemoveRequest, containers.remove)
_route(UpdateRequest, containers.update)
_route(OutputRequest, streams.output)
_route(AttachRequest, streams.attach)
_route(ExecRequest, streams.exec_)
_route(ExecKillRequest, streams.exec_kill)
_route(ResizeRequest, streams.resize)
_route(PortForwardRequest, streams.port_forward)
_route(StatsRequest, stats.stats)
_route(MetricsRequest, stats.metrics)


class Agent(Guest):
    async def handle(self, op: str, args: dict[str, Any], payload: bytes) -> dict[str, Any]:
        route = ROUTES.get(op)
        if route is None:
            raise AgentError("unimplemented", f"unknown operation {op!r}")
        req_type, handler = route
        req = req_type.from_dict(args)  # an `invalid` error naming the field
        result = await handler(self, req)
        return result.to_dict()


async def serve(socket_path: str, agent: Agent) -> None:
    agent.reaper.install()
    proc.become_subreaper()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        channel = Channel(reader, writer, agent.handle)
        agent.host = channel  # the newest host connection receives events
        channel.start()
        await channel.closed.wait()

    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    server = await asyncio.start_unix_server(on_connect, path=socket_path)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, agent.stopping.set)
    async with server:
        await agent.stopping.wait()
        await asyncio.sleep(0.05)  # let the shutdown answer leave


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="runv-agent")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--state", required=True)
    parser.add_argument("--cgroup-parent", default="/cri-shim-runv/agent")
    parser.add_argument("--runc", default="runc")
    parser.add_argument("--fail-boot", action="store_true", help="fault injection: die before serving")
    ns = parser.parse_args(argv)
    if ns.fail_boot:
        print("runv-agent: injected boot failure", flush=True)
        return 1
    os.makedirs(ns.state, exist_ok=True)
    asyncio.run(serve(ns.socket, Agent(ns.state, ns.cgroup_parent, ns.runc)))
    return 0
