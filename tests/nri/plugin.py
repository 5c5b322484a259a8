"""A small NRI plugin for tests: the shim's own ``Channel`` with the roles swapped.

It dials the shim's NRI socket, registers, answers Configure with the events the test
chose and Synchronize by recording what exists, and records every event it gets, in
order, as ``Seen(event, pod_id, container_id, container_name)``. A test may set a hook
per event (``plugin.hooks["CREATE_CONTAINER"] = ...``): an async callable given the
request, which may return an answer (a ``ContainerAdjustment`` for CreateContainer, or
the whole response message), raise (the shim then sees an error status), or block.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from google.protobuf.message import Message

from cri_api import nri_pb2 as nri
from shim.nri.service import PLUGIN_SERVICE, RUNTIME_SERVICE
from shim.nri.wire import CODE_UNIMPLEMENTED, PLUGIN_CONN, RUNTIME_CONN, CallError, Channel

Hook = Callable[[Message], Awaitable[Any]]

# Plugin method → (event name, request type, response type).
METHODS: dict[str, tuple[str, type[Message], type[Message]]] = {
    "RunPodSandbox": ("RUN_POD_SANDBOX", nri.RunPodSandboxRequest, nri.RunPodSandboxResponse),
    "StopPodSandbox": ("STOP_POD_SANDBOX", nri.StopPodSandboxRequest, nri.StopPodSandboxResponse),
    "RemovePodSandbox": ("REMOVE_POD_SANDBOX", nri.RemovePodSandboxRequest, nri.RemovePodSandboxResponse),
    "UpdatePodSandbox": ("UPDATE_POD_SANDBOX", nri.UpdatePodSandboxRequest, nri.UpdatePodSandboxResponse),
    "PostUpdatePodSandbox": (
        "POST_UPDATE_POD_SANDBOX",
        nri.PostUpdatePodSandboxRequest,
        nri.PostUpdatePodSandboxResponse,
    ),
    "CreateContainer": ("CREATE_CONTAINER", nri.CreateContainerRequest, nri.CreateContainerResponse),
    "StartContainer": ("START_CONTAINER", nri.StartContainerRequest, nri.StartContainerResponse),
    "UpdateContainer": ("UPDATE_CONTAINER", nri.UpdateContainerRequest, nri.UpdateContainerResponse),
    "StopContainer": ("STOP_CONTAINER", nri.StopContainerRequest, nri.StopContainerResponse),
    "RemoveContainer": ("REMOVE_CONTAINER", nri.RemoveContainerRequest, nri.RemoveContainerResponse),
    "StateChange": ("STATE_CHANGE", nri.StateChangeEvent, nri.Empty),
    "Shutdown": ("SHUTDOWN", nri.Empty, nri.Empty),
}


class Seen(NamedTuple):
    event: str  # an nri_pb2.Event name, or SHUTDOWN
    pod_id: str
    container_id: str
    container_name: str


def mask(*events: int) -> int:
    """ConfigureResponse.events for these nri_pb2.Event values."""
    return sum(1 << (e - 1) for e in events)


class Plugin:
    def __init__(self, name: str, idx: str, events: int) -> None:
        self.name, self.idx, self.mask = name, idx, events
        self.events: list[Seen] = []
        self.requests: list[Any] = []  # the request of each event in ``events``
        self.hooks: dict[str, Hook] = {}
        self.configure: nri.ConfigureRequest | None = None
        self.synced_pods: list[nri.PodSandbox] = []
        self.synced_containers: list[nri.Container] = []
        self.synchronized = asyncio.Event()
        self.channel: Channel | None = None
        self._reader: asyncio.Task[None] | None = None

    @property
    def label(self) -> str:
        return f"{self.idx}-{self.name}"

    async def _handle(self, service: str, method: str, payload: bytes) -> bytes:
        if service != PLUGIN_SERVICE:
            raise CallError(CODE_UNIMPLEMENTED, f"no service {service}")
        if method == "Configure":
            self.configure = nri.ConfigureRequest.FromString(payload)
            return nri.ConfigureResponse(events=self.mask).SerializeToString()
        if method == "Synchronize":
            sync = nri.SynchronizeRequest.FromString(payload)
            self.synced_pods.extend(sync.pods)
            self.synced_containers.extend(sync.containers)
            if not sync.more:
                self.synchronized.set()
            return nri.SynchronizeResponse().SerializeToString()
        if method not in METHODS:
            raise CallError(CODE_UNIMPLEMENTED, f"no method {method}")
        event, req_type, resp_type = METHODS[method]
        req = req_type.FromString(payload)
        if isinstance(req, nri.StateChangeEvent):
            event = nri.Event.Name(req.event)
        pod = getattr(req, "pod", None)
        ctr = getattr(req, "container", None)
        self.events.append(Seen(event, pod.id if pod else "", ctr.id if ctr else "", ctr.name if ctr else ""))
        self.requests.append(req)
        answer = None
        hook = self.hooks.get(event)
        if hook is not None:
            try:
                answer = await hook(req)
            except Exception as exc:
                raise CallError(2, str(exc) or type(exc).__name__) from None
        if isinstance(answer, nri.ContainerAdjustment):
            answer = nri.CreateContainerResponse(adjust=answer)
        return (answer or resp_type()).SerializeToString()

    async def call(self, method: str, request: Message, response: type[Message], timeout: float = 5.0) -> Any:
        assert self.channel is not None
        return response.FromString(await self.channel.call(RUNTIME_SERVICE, method, request, timeout))

    async def wait_ready(self, timeout: float = 10.0) -> None:
        """Until the shim synchronised this plugin (it is then called for events)."""
        async with asyncio.timeout(timeout):
            await self.synchronized.wait()

    async def update_containers(self, updates: list[nri.ContainerUpdate]) -> nri.UpdateContainersResponse:
        req = nri.UpdateContainersRequest(update=updates)
        resp: nri.UpdateContainersResponse = await self.call(
            "UpdateContainers", req, nri.UpdateContainersResponse
        )
        return resp

    def of(self, event: str) -> list[Seen]:
        return [s for s in self.events if s.event == event]

    async def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


async def connect(path: str, name: str, idx: str, events: int = 0) -> Plugin:
    """A plugin connected and registered (not yet synchronised: see ``wait_ready``)."""
    plugin = Plugin(name, idx, events)
    reader, writer = await asyncio.open_unix_connection(path)
    plugin.channel = Channel(reader, writer, plugin._handle, calls_on=RUNTIME_CONN, serves_on=PLUGIN_CONN)
    plugin._reader = asyncio.ensure_future(plugin.channel.run())
    try:
        await plugin.call(
            "RegisterPlugin", nri.RegisterPluginRequest(plugin_name=name, plugin_idx=idx), nri.Empty
        )
    except BaseException:
        await plugin.close()
        raise
    return plugin
