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
import ctypes
import os
import select
import signal
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from backends.runv.agent import containers, criu, proc, snapshot, stats, streams, vm
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
_route(snapshot.SaveRequest, snapshot.before_save)
_route(snapshot.RestoredRequest, snapshot.restored)
_route(criu.CheckpointRequest, criu.checkpoint)
_route(criu.ThawRequest, criu.thaw)
_route(criu.RestorePrepareRequest, criu.restore_prepare)


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


async def _ready(fd: int, writing: bool) -> None:
    """Until ``fd`` is readable (or writable)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    (loop.add_writer if writing else loop.add_reader)(fd, wake)
    try:
        await ready
    finally:
        (loop.remove_writer if writing else loop.remove_reader)(fd)


class Port:
    """A virtio-serial port, open for the agent's whole life, as a channel's reader and writer.

    Closing and reopening the port would tell QEMU the guest left, so a host's going
    away is read off the port instead: while no host holds its other end, poll says
    POLLHUP and a read ends at once (an end of file). The agent then waits for the
    next host on the same descriptor and starts a new channel for it.
    """

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self.poller = select.poll()
        self.poller.register(self.fd, select.POLLIN)
        self._eof = False
        self._out = b""

    def host_connected(self) -> bool:
        return not any(ev & select.POLLHUP for _fd, ev in self.poller.poll(0))

    def begin(self) -> None:
        """A new host: reads go on until it leaves."""
        self._eof = False

    # ---- the reader side of a Channel
    async def read(self, n: int) -> bytes:
        while not self._eof:
            try:
                data = os.read(self.fd, n)
            except BlockingIOError:
                await _ready(self.fd, writing=False)
                continue
            except OSError:
                data = b""
            if data:
                return data
            self._eof = True  # no host on the other end any more
        return b""

    # ---- the writer side
    def write(self, data: bytes) -> None:
        self._out += data

    async def drain(self) -> None:
        while self._out:
            if self._eof:
                self._out = b""
                raise ConnectionResetError("the host left")
            try:
                sent = os.write(self.fd, self._out)
            except BlockingIOError:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):  # a host that stopped reading
                        await _ready(self.fd, writing=True)
                continue
            except OSError as exc:
                self._out = b""
                raise ConnectionResetError(f"the host left: {exc}") from None
            self._out = self._out[sent:]

    def close(self) -> None:
        """The channel is done with this host; the port itself stays open."""
        self._eof = True
        self._out = b""

    async def wait_closed(self) -> None:
        return None


async def serve_serial(path: str, agent: Agent) -> None:
    """Serve on a virtio-serial port (a real VM): one host at a time, again after each one leaves."""
    agent.reaper.install()
    proc.become_subreaper()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, agent.stopping.set)
    port = Port(path)
    print(f"runv-agent: ready on {path}", flush=True)
    stopping = loop.create_task(agent.stopping.wait())
    try:
        while not agent.stopping.is_set():
            if not port.host_connected():
                await asyncio.wait([stopping], timeout=0.05)
                continue
            port.begin()
            channel = Channel(
                cast(asyncio.StreamReader, port), cast(asyncio.StreamWriter, port), agent.handle
            )
            agent.host = channel
            channel.start()
            closed = loop.create_task(channel.closed.wait())
            await asyncio.wait([closed, stopping], return_when=asyncio.FIRST_COMPLETED)
            if agent.stopping.is_set():
                await asyncio.sleep(0.05)  # let the shutdown answer leave
            closed.cancel()
            await channel.aclose()
    finally:
        stopping.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="runv-agent")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket", help="serve on this unix socket (the stub driver)")
    where.add_argument("--serial", help="serve on this virtio-serial port (a real VM)")
    parser.add_argument("--state", required=True)
    parser.add_argument("--cgroup-parent", default="/cri-shim-runv/agent")
    parser.add_argument("--runc", default="runc")
    parser.add_argument("--fail-boot", action="store_true", help="fault injection: die before serving")
    ns = parser.parse_args(argv)
    if ns.fail_boot:
        print("runv-agent: injected boot failure", flush=True)
        return 1
    os.makedirs(ns.state, exist_ok=True)
    agent = Agent(ns.state, ns.cgroup_parent, ns.runc)
    if ns.serial:
        _overcommit()
        asyncio.run(serve_serial(ns.serial, agent))
        _power_off()
    else:
        asyncio.run(serve(ns.socket, agent))
    return 0


def _overcommit() -> None:
    """A real VM's memory is its pod's: a container that asks for more than the VM has is left to
    its memory cgroup (OOMKilled, as on a node), not refused by the kernel's guess of what the
    small VM can hold (``vm.overcommit_memory`` 0 refuses an allocation beyond its RAM)."""
    with contextlib.suppress(OSError), open("/proc/sys/vm/overcommit_memory", "w") as fh:
        fh.write("1")


def _power_off() -> None:
    """The agent of a real VM is its init: when it is done, the VM is (QEMU runs with -no-reboot)."""
    os.sync()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.reboot(0x01234567)  # LINUX_REBOOT_CMD_RESTART: QEMU exits instead of rebooting
