"""What the backend knows of each live pod beyond the shim's records: its VM, its agent
connection, its containers and the processes the shim follows in it."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from backends import contract
from backends.runv.agent.client import AgentClient
from backends.runv.agent.protocol import STAMP, Ch, Stream
from backends.runv.hypervisor import VM


@dataclasses.dataclass(eq=False)
class Pod:
    sandbox_id: str
    vm: VM
    agent: AgentClient | None = None
    agent_version: int = 0  # of its operations (Hello): 2 and later stamp and replay output
    containers: set[str] = dataclasses.field(default_factory=set)
    stopping: bool = False
    dead: bool = False
    monitor: asyncio.Task[None] | None = None
    procs: dict[str, VmProcess] = dataclasses.field(default_factory=dict)  # started containers
    # A warm VM's network, wired before any pod asked for it: its IP (held in the IPAM under
    # ``holder`` until a pod takes it) and the VM's interface, up.
    warm_net: dict[str, str] | None = None


class VmProcess:
    """A container in the VM as the shim follows it: the agent's output stream, the exit.

    The stream is subscribed before the container starts (the agent keeps a
    backlog until then) and ends when the agent closes it (all output sent) or
    the channel goes (VM stopped or dead).
    """

    def __init__(self, stream: Stream, stamped: bool = False) -> None:
        self._stream = stream
        self._stamped = stamped  # each frame starts with the agent's time of it (guest.STAMP)
        self.exit = contract.ExitLatch()

    async def output(self) -> AsyncIterator[contract.Output]:
        stream = self._stream
        stamp = STAMP.size if self._stamped else 0
        try:
            async for ch, data in stream.received():
                at = STAMP.unpack_from(data)[0] if stamp and len(data) >= stamp else 0
                yield contract.Output("stderr" if ch == Ch.STDERR else "stdout", data[stamp:], at)
        finally:
            stream.forget()
