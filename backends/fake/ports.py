"""The fake pods' ports: which container's server listens on which port, and port-forward's
connections to them.

A pod's containers share its network, so a port is the pod's: a server of any of its containers
(the shell's ``httpd``, a scripted server of :mod:`backends.fake.servers`) binds it, a second bind
fails with EADDRINUSE whichever container asks, and a port-forward to the pod reaches it. A server
lives until it closes its port or its container ends (:meth:`PodPorts.release`); a connection it
is serving then ends too, as a killed process's would.

Simplified from Linux: a port is bound once per pod whatever the address (a real ``127.0.0.1:80``
and ``POD_IP:80`` could coexist); an address that is neither a wildcard, a loopback nor the pod's
own cannot be bound (EADDRNOTAVAIL). Port-forward dials localhost, as runtimes do in the pod's
network namespace: a server bound to the pod's IP alone is not reached by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import ipaddress
from collections.abc import Callable

from backends.contract import PortStream
from backends.fake.shell.caller import Serve

_WILDCARDS = ("", "0.0.0.0", "::")


@dataclasses.dataclass(eq=False, slots=True)
class Listener:
    """One bound port of a pod."""

    container_id: str
    host: str  # as bound; "" for every address
    serve: Serve
    closed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    @property
    def local(self) -> bool:
        """Whether a connection to localhost reaches it."""
        return self.host in _WILDCARDS or ipaddress.ip_address(self.host).is_loopback


class PodPorts:
    """Every pod's bound ports."""

    def __init__(self) -> None:
        self._bound: dict[tuple[str, int], Listener] = {}  # (sandbox ID, port) -> its listener
        self._of: dict[str, set[tuple[str, int]]] = {}  # container ID -> what it bound

    def bind(
        self, sandbox_id: str, container_id: str, pod_ip: str, host: str, port: int, serve: Serve
    ) -> Callable[[], None]:
        """Binds ``port`` of the pod for a server of ``container_id``; returns its close."""
        listener = Listener(container_id, host, serve)
        if not listener.local and host != pod_ip:
            raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")
        key = (sandbox_id, port)
        if key in self._bound:
            raise OSError(errno.EADDRINUSE, "Address in use")
        self._bound[key] = listener
        self._of.setdefault(container_id, set()).add(key)

        def close() -> None:
            if self._bound.get(key) is listener:
                self._close(key)

        return close

    def _close(self, key: tuple[str, int]) -> None:
        listener = self._bound.pop(key)
        keys = self._of.get(listener.container_id, set())
        keys.discard(key)
        if not keys:
            self._of.pop(listener.container_id, None)
        listener.closed.set()

    def release(self, container_id: str) -> None:
        """The container ended: every port it bound closes."""
        for key in list(self._of.get(container_id, ())):
            self._close(key)

    def bound(self, sandbox_id: str) -> list[int]:
        """The pod's bound ports, in order."""
        return sorted(port for sb, port in self._bound if sb == sandbox_id)

    async def connect(self, sandbox_id: str, port: int, stream: PortStream) -> bool:
        """Serves ``stream`` by what listens on localhost:``port`` in the pod, until the server
        ends the connection or closes its port; False when nothing listens there."""
        listener = self._bound.get((sandbox_id, port))
        if listener is None or not listener.local:
            return False
        serving = asyncio.ensure_future(listener.serve(stream))
        closed = asyncio.ensure_future(listener.closed.wait())
        try:
            await asyncio.wait((serving, closed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
            if not serving.done():
                serving.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await serving
        if serving.done() and not serving.cancelled():
            serving.result()  # a server's failure is the caller's to report
        return True


@dataclasses.dataclass(frozen=True, slots=True)
class ContainerNetwork:
    """One container's side of its pod's ports: the shell's ``Network`` for its commands."""

    ports: PodPorts
    sandbox_id: str
    container_id: str
    pod_ip: str

    def listen(self, host: str, port: int, serve: Serve) -> Callable[[], None]:
        return self.ports.bind(self.sandbox_id, self.container_id, self.pod_ip, host, port, serve)
