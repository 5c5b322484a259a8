"""Hollow nodes: many isolated fake CRI nodes served by one process, as kubemark's hollow nodes.

``cri-shim hollow --nodes N`` runs N complete shims on one event loop. Node i
is a :class:`shim.server.Server` of its own, built from a per-node copy of the
configuration:

- its CRI socket is the ``--socket-template`` with ``{i}`` replaced;
- its records are under ``STATE_ROOT/node-{i}`` (the fake's images under
  ``STATE_ROOT/node-{i}/backends/HANDLER``);
- each handler is a fake backend of its own (images, pods, containers, call
  log), whose pods take their IPs from the node's own range;
- its streaming server listens on its own port (the configured one plus i, or
  a random one when it is 0, the default);
- NRI is off, unless ``[nri] socket_path`` has ``{i}``: then node i serves NRI
  plugins on that path with ``{i}`` replaced.

Each node's socket is served by the native transport (shim/transport/native/:
HTTP/2 on the event loop, no threads) unless ``--transport grpcio`` says otherwise:
with a hundred nodes polled by their kubelets, grpcio's per-call thread
hand-offs cost a core's fifth where the native server costs a twentieth.

Nothing is shared between two nodes but the process, its event loop and the
logging set-up (every log line carries ``node=i``): a pod run, an image pulled
or a fault injected on one node is not seen on another. Only ``fake``
handlers can be hollow: docker and runv nodes would share one engine or host.

Nodes start one after the other; if one cannot start, those already started
are stopped and the command exits non-zero naming the node. SIGTERM or SIGINT
stops every node (in-flight RPCs get ``[server] shutdown_grace``) and removes
their sockets. Under systemd, READY=1 is sent once every node serves.

The command itself (its arguments, the logging set-up, the exit status) is
:mod:`shim.cli`'s, which imports this module when it is run; this module does
not import it back.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import grp
import ipaddress
import itertools
import os
from collections.abc import Coroutine, Sequence
from typing import Any

import structlog

from shim.config import Config, HandlerConfig
from shim.server import Server, ServerError, parse_listen, sd_notify, stop_signals

log = structlog.get_logger("hollow")

DEFAULT_SOCKET_TEMPLATE = "/run/cri-shim/node-{i}.sock"
DEFAULT_STATE_ROOT = "/var/lib/cri-shim/hollow"
DEFAULT_POD_CIDR = "10.0.0.0/8"
# The fake records every backend call in a bounded log (10,000 by default).
# A hundred nodes polled for hours would hold a million records: a hollow
# node keeps the last 1,000 unless its handler's ``max_calls`` says otherwise.
NODE_MAX_CALLS = 1000

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class HollowError(Exception):
    """The nodes cannot be planned or started; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    index: int
    socket: str
    state_dir: str
    pod_cidr: str


def _network(text: str) -> Network:
    return ipaddress.ip_network(text)


def _split(net: Network, parts: int, what: str) -> list[Network]:
    """``net`` cut into ``parts`` equal power-of-two subnets (the first ``parts`` of them)."""
    prefix = net.prefixlen + (parts - 1).bit_length()
    if net.max_prefixlen - prefix < 2:
        raise HollowError(f"{what} {net} is too small to give {parts} ranges of 4 addresses or more")
    return list(itertools.islice(net.subnets(new_prefix=prefix), parts))


def pod_cidrs(spec: str, nodes: int) -> list[str]:
    """Each node's pod range: ``spec`` with ``{i}`` replaced, or ``spec`` split into ``nodes`` parts."""
    if "{i}" not in spec:
        try:
            base = _network(spec)
        except ValueError as exc:
            raise HollowError(f"--pod-cidr-template {spec!r}: {exc}") from None
        return [str(n) for n in _split(base, nodes, "--pod-cidr-template")]
    nets: list[tuple[int, Network]] = []
    for i in range(nodes):
        try:
            nets.append((i, _network(spec.replace("{i}", str(i)))))
        except ValueError as exc:
            raise HollowError(f"--pod-cidr-template {spec!r}: node {i}: {exc}") from None
    ordered = sorted(nets, key=lambda n: (n[1].version, int(n[1].network_address)))
    for (i, a), (j, b) in itertools.pairwise(ordered):
        if a.version == b.version and a.overlaps(b):
            raise HollowError(f"--pod-cidr-template {spec!r}: node {i}'s {a} overlaps node {j}'s {b}")
    return [str(n) for _, n in nets]


def plan(nodes: int, socket_template: str, state_root: str, pod_cidr: str) -> list[NodeSpec]:
    """Check the templates and say where each node lives, before anything starts."""
    if nodes < 1:
        raise HollowError(f"--nodes {nodes}: at least one node is needed")
    if nodes > 1 and "{i}" not in socket_template:
        raise HollowError(f"--socket-template {socket_template!r} must contain {{i}} (the node's index)")
    template = socket_template.removeprefix("unix://")
    sockets = []
    for i in range(nodes):
        try:
            _, path = parse_listen(template.replace("{i}", str(i)))
        except ServerError as exc:
            raise HollowError(f"--socket-template: node {i}: {exc}") from None
        sockets.append(path)
    cidrs = pod_cidrs(pod_cidr, nodes)
    root = os.path.abspath(state_root)
    return [NodeSpec(i, sockets[i], os.path.join(root, f"node-{i}"), cidrs[i]) for i in range(nodes)]


def check_config(base: Config, nodes: int) -> None:
    """What would fail the same way on every node, refused before the first one starts."""
    not_fake = sorted(f"[handlers.{n}] (type {h.type})" for n, h in base.handlers.items() if h.type != "fake")
    if not_fake:
        raise HollowError(
            "hollow nodes serve fake handlers only; a docker or runv handler would be shared "
            f"by every node: {', '.join(not_fake)}"
        )
    if base.streaming.port and base.streaming.port + nodes - 1 > 65535:
        raise HollowError(
            f"[streaming] port {base.streaming.port}: node {nodes - 1} would need port "
            f"{base.streaming.port + nodes - 1}; use port 0 (a random port per node)"
        )
    if base.server.socket_group:
        try:
            grp.getgrnam(base.server.socket_group)
        except KeyError:
            raise HollowError(f"[server] socket_group: no group named {base.server.socket_group!r}") from None


def node_config(base: Config, node: NodeSpec) -> Config:
    """The configuration of one node: its socket, state, pod range and streaming port."""
    server = dataclasses.replace(
        base.server, listen=f"unix://{node.socket}", state_dir=node.state_dir, metrics_listen=""
    )
    streaming = base.streaming
    if streaming.port:
        streaming = dataclasses.replace(streaming, port=streaming.port + node.index)
    names = sorted(base.handlers)
    # Two fake handlers on one node must not hand out the same address.
    ranges = _split(_network(node.pod_cidr), len(names), f"node {node.index}'s pod range")
    handlers = {}
    for name, net in zip(names, ranges, strict=True):
        h = base.handlers[name]
        # A state_dir in the file would be shared by every node: each keeps its own.
        opts = {k: v for k, v in h.options.items() if k != "state_dir"}
        opts["pod_cidr"] = str(net)
        opts.setdefault("max_calls", NODE_MAX_CALLS)
        handlers[name] = HandlerConfig(name, h.type, opts)
    # One NRI socket is one node's: each node gets its own when the path has {i},
    # and none otherwise (node 0 would take the shared one, the rest warn).
    nri = base.nri
    if "{i}" in nri.socket_path:
        nri = dataclasses.replace(nri, socket_path=nri.socket_path.replace("{i}", str(node.index)))
    else:
        nri = dataclasses.replace(nri, enable=False)
    return dataclasses.replace(base, server=server, streaming=streaming, handlers=handlers, nri=nri)


class Hollow:
    """N servers on one event loop, started and stopped together."""

    def __init__(self, base: Config, nodes: Sequence[NodeSpec]) -> None:
        check_config(base, len(nodes))
        self.config = base
        self.nodes = list(nodes)
        self.servers = [Server(node_config(base, n), notify=False) for n in self.nodes]
        # Every task of node i (its RPCs included: grpc.aio creates them from
        # the server's own task) logs with node=i.
        self._contexts = []
        for n in self.nodes:
            ctx = contextvars.copy_context()
            ctx.run(structlog.contextvars.bind_contextvars, node=n.index)
            self._contexts.append(ctx)
        self._attempted = 0

    def _in_node(self, i: int, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(coro, context=self._contexts[i])

    async def start(self, stop: asyncio.Event | None = None) -> None:
        """Start every node in turn; on a failure stop those started and raise HollowError.

        Returns early, with the nodes started so far serving, when ``stop`` is set meanwhile.
        """
        for i, node in enumerate(self.nodes):
            if stop is not None and stop.is_set():
                return
            self._attempted = i + 1
            try:
                await self._in_node(i, self.servers[i].start())
            except Exception as exc:
                await self.stop(0)
                reason = str(exc) if isinstance(exc, (ServerError, OSError)) else repr(exc)
                raise HollowError(f"node {node.index} ({node.socket}) did not start: {reason}") from exc
        first, last = self.nodes[0], self.nodes[-1]
        log.info(
            "hollow.ready",
            nodes=len(self.nodes),
            sockets=f"{first.socket} .. {last.socket}",
            pod_cidrs=f"{first.pod_cidr} .. {last.pod_cidr}",
            state_root=os.path.dirname(first.state_dir),
        )

    async def stop(self, grace: float | None = None) -> None:
        """Stop every node that was started (or tried to), together."""
        attempted, self._attempted = self._attempted, 0
        tasks = [self._in_node(i, self.servers[i].stop(grace)) for i in range(attempted)]
        for node, result in zip(
            self.nodes, await asyncio.gather(*tasks, return_exceptions=True), strict=False
        ):
            if isinstance(result, BaseException):
                log.error("hollow.stop_failed", node=node.index, error=repr(result))

    async def run_until_signalled(self) -> None:
        stop = stop_signals()
        await self.start(stop)
        sd_notify("READY=1")
        await stop.wait()
        log.info("hollow.stopping", nodes=self._attempted)
        sd_notify("STOPPING=1")
        await self.stop()
        log.info("hollow.stopped")


__all__ = ["Hollow", "HollowError", "NodeSpec", "node_config", "plan", "pod_cidrs"]
