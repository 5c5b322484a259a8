"""The runtime side of NRI: the socket plugins dial, their registration, and every
pod and container event delivered to them in order.

How a plugin joins: it dials ``[nri] socket_path`` and calls ``Runtime.RegisterPlugin``
(name and a two-digit index); the shim calls its ``Configure`` (the plugin answers
with the events it wants), then ``Synchronize`` with every pod and container that
exists; from then on it gets each event it subscribed to. Plugins are called one
after the other in index order.

Ordering: every event and every synchronisation goes through one queue, worked off
by one task — as NRI's own runtime library does with one lock. So a plugin sees the
events of a pod or container in the order they happened, a plugin that joins while
a pod is being created either finds it in Synchronize or gets its events, never
neither and never both, and a plugin's Synchronize that takes long holds back the
events that follow it (not the CRI calls that do not wait for a plugin).

Which events wait for the plugins (the CRI call fails if one refuses): RunPodSandbox
(after the backend made the pod, before it is visible), CreateContainer (before the
backend creates the container: plugins may adjust it, see convert.adjust),
StartContainer, UpdateContainerResources and UpdatePodSandboxResources (UpdatePodSandbox,
before the backend sees the new resources). Notifications (StopPodSandbox,
RemovePodSandbox, StopContainer — also for a container that exited on its own —,
RemoveContainer and the Post- events, PostUpdatePodSandbox among them) are queued and
never fail the CRI call; a plugin's error for them is logged.

A plugin that does not answer within ``request_timeout`` (``registration_timeout``
while it joins) is disconnected, and a CRI call that was waiting for it fails with
DEADLINE_EXCEEDED; so does one that a plugin refused, with ABORTED and the plugin's
message. Either way the CRI call leaves nothing behind and may be retried.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import structlog
from google.protobuf.message import Message

from backends.contract import ContainerRecord, SandboxRecord
from cri_api import api_pb2 as pb
from cri_api import nri_pb2 as nri
from shim import __version__
from shim.config import NriConfig
from shim.cri.errors import AbortedError, DeadlineExceededError, FailedPreconditionError
from shim.nri import convert
from shim.nri.wire import CODE_INVALID_ARGUMENT, CODE_UNIMPLEMENTED, CallError, Channel, ClosedError

log = structlog.get_logger("nri")

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
NRI_VERSION = "v0.10.0"  # the NRI API version this side speaks
SYNC_CHUNK = 2 << 20  # bytes of pods and containers per Synchronize call (ttrpc's limit is 4 MiB)
_INDEX = re.compile(r"^[0-9]{2}$")

T = TypeVar("T")
Updater = Callable[[str, pb.LinuxContainerResources], Awaitable[None]]
Snapshot = Callable[[], tuple[list[SandboxRecord], list[ContainerRecord]]]

# The events with a method of their own: (method, request type, response type).
_METHODS: dict[int, tuple[str, type[Message], type[Message]]] = {
    nri.RUN_POD_SANDBOX: ("RunPodSandbox", nri.RunPodSandboxRequest, nri.RunPodSandboxResponse),
    nri.STOP_POD_SANDBOX: ("StopPodSandbox", nri.StopPodSandboxRequest, nri.StopPodSandboxResponse),
    nri.REMOVE_POD_SANDBOX: ("RemovePodSandbox", nri.RemovePodSandboxRequest, nri.RemovePodSandboxResponse),
    nri.UPDATE_POD_SANDBOX: ("UpdatePodSandbox", nri.UpdatePodSandboxRequest, nri.UpdatePodSandboxResponse),
    nri.POST_UPDATE_POD_SANDBOX: (
        "PostUpdatePodSandbox",
        nri.PostUpdatePodSandboxRequest,
        nri.PostUpdatePodSandboxResponse,
    ),
    nri.CREATE_CONTAINER: ("CreateContainer", nri.CreateContainerRequest, nri.CreateContainerResponse),
    nri.START_CONTAINER: ("StartContainer", nri.StartContainerRequest, nri.StartContainerResponse),
    nri.UPDATE_CONTAINER: ("UpdateContainer", nri.UpdateContainerRequest, nri.UpdateContainerResponse),
    nri.STOP_CONTAINER: ("StopContainer", nri.StopContainerRequest, nri.StopContainerResponse),
    nri.REMOVE_CONTAINER: ("RemoveContainer", nri.RemoveContainerRequest, nri.RemoveContainerResponse),
}
_NAMES = {e: nri.Event.Name(e) for e in nri.Event.values()}


class PluginFailed(Exception):
    """A plugin refused or did not answer an event the CRI call waits for."""

    def __init__(self, plugin: Plugin, event: int, why: str, timed_out: bool) -> None:
        super().__init__(f"NRI plugin {plugin.label} {why} {_NAMES[event]}")
        self.timed_out = timed_out

    def cri_error(self) -> Exception:
        return DeadlineExceededError(str(self)) if self.timed_out else AbortedError(str(self))


class Plugin:
    """One connected plugin."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.name = ""
        self.idx = ""
        self.events = 0  # bit (e - 1) for each event e
        self.registered: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    @property
    def label(self) -> str:
        return f"{self.idx}-{self.name}" if self.name else "(unregistered)"

    def wants(self, event: int) -> bool:
        return bool(self.events & (1 << (event - 1)))


class Nri:
    """NRI for one shim: ``start`` listens; the ``*_sandbox``/``*_container`` methods are
    called by the CRI services at each event."""

    def __init__(self, config: NriConfig, snapshot: Snapshot, updater: Updater) -> None:
        self.config = config
        self._snapshot = snapshot
        self._updater = updater
        self._plugins: list[Plugin] = []  # synchronised, in call order
        self._connections: set[asyncio.Task[Any]] = set()
        self._jobs: collections.deque[tuple[Callable[[], Awaitable[Any]], asyncio.Future[Any]]] = (
            collections.deque()
        )
        self._wake = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        self._server: asyncio.AbstractServer | None = None
        self.socket_path = ""

    # ------------------------------------------------------------------ life
    async def start(self) -> None:
        """Listen on the socket. Never fails the shim's start: a path in use by a live
        runtime, or one this process may not create, leaves NRI off with a warning."""
        path = self.config.socket_path
        try:
            await asyncio.to_thread(_clear_stale, path)
            self._server = await asyncio.start_unix_server(self._accept, path=path)
            os.chmod(path, 0o600)
        except (OSError, _InUse) as exc:
            log.warning("nri.off", socket=path, reason=str(exc))
            if self._server is not None:
                self._server.close()
                self._server = None
            return
        self.socket_path = path
        self._worker = asyncio.ensure_future(self._work())
        log.info("nri.listening", socket=path)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for plugin in list(self._plugins):
            with contextlib.suppress(Exception):
                await plugin.channel.call(PLUGIN_SERVICE, "Shutdown", nri.Empty(), 0.5)
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        if self.socket_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
            self.socket_path = ""

    @property
    def plugins(self) -> list[str]:
        return [p.label for p in self._plugins]

    # ------------------------------------------------------------------ events
    async def run_pod_sandbox(self, sb: SandboxRecord) -> None:
        await self._hook(nri.RUN_POD_SANDBOX, sb, None)

    async def stop_pod_sandbox(self, sb: SandboxRecord) -> None:
        await self._tell(nri.STOP_POD_SANDBOX, sb, None)

    async def remove_pod_sandbox(self, sb: SandboxRecord) -> None:
        await self._tell(nri.REMOVE_POD_SANDBOX, sb, None)

    async def update_pod_sandbox(
        self,
        sb: SandboxRecord,
        overhead: pb.LinuxContainerResources | None,
        resources: pb.LinuxContainerResources | None,
    ) -> None:
        """UpdatePodSandboxResources, before anything changes: a plugin may refuse it."""
        if not self._subscribed(nri.UPDATE_POD_SANDBOX):
            return
        req = nri.UpdatePodSandboxRequest(pod=convert.pod(sb))
        if overhead is not None:
            convert.resources_from_cri(overhead, req.overhead_linux_resources)
        if resources is not None:
            convert.resources_from_cri(resources, req.linux_resources)
        await self._hook(nri.UPDATE_POD_SANDBOX, sb, None, req)

    def post_update_pod_sandbox(self, sb: SandboxRecord) -> None:
        """The pod's resources changed (the pod message carries the new ones)."""
        self._notify(nri.POST_UPDATE_POD_SANDBOX, sb, None)

    async def create_container(self, sb: SandboxRecord, c: ContainerRecord) -> pb.ContainerConfig | None:
        """The container's config as the plugins adjusted it, or None if none did."""
        answers = await self._hook(nri.CREATE_CONTAINER, sb, c)
        adjusted: pb.ContainerConfig | None = None
        for plugin, payload in answers:
            resp = nri.CreateContainerResponse.FromString(payload)
            if resp.HasField("adjust") and resp.adjust.ByteSize():
                if adjusted is None:
                    adjusted = pb.ContainerConfig()
                    adjusted.CopyFrom(c.config)
                with _applicable(plugin, "adjusted", c):
                    convert.adjust(adjusted, resp.adjust)
            self._apply_updates(plugin, resp.update, skip=c.id)
        return adjusted

    def post_create_container(self, sb: SandboxRecord, c: ContainerRecord) -> None:
        self._notify(nri.POST_CREATE_CONTAINER, sb, c)

    async def start_container(self, sb: SandboxRecord, c: ContainerRecord) -> None:
        await self._hook(nri.START_CONTAINER, sb, c)

    def post_start_container(self, sb: SandboxRecord, c: ContainerRecord) -> None:
        self._notify(nri.POST_START_CONTAINER, sb, c)

    async def update_container(
        self, sb: SandboxRecord, c: ContainerRecord, resources: pb.LinuxContainerResources
    ) -> pb.LinuxContainerResources:
        """The resources to set, as the plugins changed them."""
        if not self._subscribed(nri.UPDATE_CONTAINER):
            return resources
        out = pb.LinuxContainerResources()
        out.CopyFrom(resources)
        extra = nri.UpdateContainerRequest(pod=convert.pod(sb), container=convert.container(c))
        convert.resources_from_cri(resources, extra.linux_resources)
        for plugin, payload in await self._hook(nri.UPDATE_CONTAINER, sb, c, extra):
            resp = nri.UpdateContainerResponse.FromString(payload)
            for u in resp.update:
                if u.container_id == c.id and u.linux.HasField("resources"):
                    with _applicable(plugin, "updated", c):
                        convert.apply_resources(u.linux.resources, out)
            self._apply_updates(plugin, resp.update, skip=c.id)
        return out

    def post_update_container(self, sb: SandboxRecord, c: ContainerRecord) -> None:
        self._notify(nri.POST_UPDATE_CONTAINER, sb, c)

    def stop_container(self, sb: SandboxRecord | None, c: ContainerRecord) -> None:
        self._notify(nri.STOP_CONTAINER, sb, c)

    async def remove_container(self, sb: SandboxRecord | None, c: ContainerRecord) -> None:
        await self._tell(nri.REMOVE_CONTAINER, sb, c)

    # ------------------------------------------------------------------ dispatch
    def _subscribed(self, event: int) -> bool:
        return any(p.wants(event) for p in self._plugins)

    async def _hook(
        self, event: int, sb: SandboxRecord, c: ContainerRecord | None, request: Message | None = None
    ) -> list[tuple[Plugin, bytes]]:
        if not self._subscribed(event):
            return []
        req = request or _request(event, convert.pod(sb), convert.container(c) if c is not None else None)
        try:
            return await self._submit(lambda: self._deliver(event, req, wait=True))
        except PluginFailed as exc:
            raise exc.cri_error() from None

    async def _tell(self, event: int, sb: SandboxRecord | None, c: ContainerRecord | None) -> None:
        """Deliver a notification and wait until the plugins had it; never raises."""
        future = self._notify(event, sb, c)
        if future is not None:
            await asyncio.wait([future])

    def _notify(
        self, event: int, sb: SandboxRecord | None, c: ContainerRecord | None
    ) -> asyncio.Future[Any] | None:
        if not self._subscribed(event):
            return None
        # The messages are made now, so that they say what was true at the event.
        req = _request(
            event, convert.pod(sb) if sb is not None else None, convert.container(c) if c else None
        )
        future = self._submit(lambda: self._deliver(event, req, wait=False))
        future.add_done_callback(_consume)
        return future

    def _submit(self, job: Callable[[], Awaitable[T]]) -> asyncio.Future[T]:
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._jobs.append((job, future))
        self._wake.set()
        return future

    async def _work(self) -> None:
        while True:
            while not self._jobs:
                self._wake.clear()
                await self._wake.wait()
            job, future = self._jobs.popleft()
            if future.done():
                continue
            try:
                result = await job()
            except Exception as exc:
                if not future.done():
                    future.set_exception(exc)
            else:
                if not future.done():
                    future.set_result(result)

    async def _deliver(self, event: int, req: Message, wait: bool) -> list[tuple[Plugin, bytes]]:
        """Call every subscribed plugin in turn; their answers. With ``wait`` (the CRI
        call waits) the first refusal stops the round and raises PluginFailed."""
        answers = []
        for plugin in list(self._plugins):
            if not plugin.wants(event) or plugin not in self._plugins:
                continue
            try:
                answers.append((plugin, await self._call_event(plugin, event, req)))
            except CallError as exc:
                log.warning(
                    "nri.plugin_refused", plugin=plugin.label, nri_event=_NAMES[event], error=str(exc)
                )
                if wait:
                    raise PluginFailed(plugin, event, f"refused: {exc}; in", timed_out=False) from None
            except TimeoutError:
                self._drop(plugin, f"no answer to {_NAMES[event]} within {self.config.request_timeout} s")
                if wait:
                    raise PluginFailed(plugin, event, "did not answer in time to", timed_out=True) from None
            except ClosedError:
                self._drop(plugin, "connection closed")
        return answers

    async def _call_event(self, plugin: Plugin, event: int, req: Message) -> bytes:
        timeout = self.config.request_timeout
        method = _METHODS.get(event)
        if method is not None:
            try:
                return await plugin.channel.call(PLUGIN_SERVICE, method[0], req, timeout)
            except CallError as exc:
                if exc.code != CODE_UNIMPLEMENTED or event in (nri.CREATE_CONTAINER, nri.UPDATE_CONTAINER):
                    raise
                # An older plugin: the same event as a state change.
        change = nri.StateChangeEvent(event=event)  # type: ignore[arg-type]
        if req.HasField("pod"):
            change.pod.CopyFrom(req.pod)  # type: ignore[attr-defined]
        if req.DESCRIPTOR.fields_by_name.get("container") and req.HasField("container"):
            change.container.CopyFrom(req.container)  # type: ignore[attr-defined]
        await plugin.channel.call(PLUGIN_SERVICE, "StateChange", change, timeout)
        return b""

    def _apply_updates(self, plugin: Plugin, updates: Any, skip: str = "") -> None:
        """Updates a plugin asked for other containers in an event's answer: made in the
        background (they take the containers' locks, which the event's caller may hold)."""
        for u in updates:
            if u.container_id == skip or not u.linux.HasField("resources"):
                continue
            task = asyncio.ensure_future(self._update_one(plugin, u))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _update_one(self, plugin: Plugin, u: nri.ContainerUpdate) -> bool:
        try:
            res = pb.LinuxContainerResources()
            convert.apply_resources(u.linux.resources, res)
            await self._updater(u.container_id, res)
        except Exception as exc:
            report = log.info if u.ignore_failure else log.warning
            report("nri.update_failed", plugin=plugin.label, container_id=u.container_id, error=str(exc))
            return False
        return True

    def _drop(self, plugin: Plugin, why: str) -> None:
        if plugin in self._plugins:
            self._plugins.remove(plugin)
            log.warning("nri.plugin_disconnected", plugin=plugin.label, reason=why)
        plugin.channel.close()

    # ------------------------------------------------------------------ plugins joining
    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        plugin: Plugin | None = None

        async def handle(service: str, method: str, payload: bytes) -> bytes:
            assert plugin is not None
            return await self._runtime_request(plugin, service, method, payload)

        channel = Channel(reader, writer, handle)
        plugin = Plugin(channel)
        reading = asyncio.ensure_future(channel.run())
        try:
            await self._join(plugin)
            await reading
        except asyncio.CancelledError:
            # The shim is stopping: the connection ends here, quietly (asyncio's server
            # callback would log a cancelled connection task as an error).
            channel.close()
        except Exception as exc:  # whatever one plugin does, the shim goes on
            log.warning("nri.plugin_failed", plugin=plugin.label, error=str(exc) or type(exc).__name__)
        finally:
            channel.close()
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            if plugin in self._plugins:
                self._plugins.remove(plugin)
                log.info("nri.plugin_gone", plugin=plugin.label, reason=channel.error or "closed")
            self._connections.discard(task)

    async def _join(self, plugin: Plugin) -> None:
        cfg = self.config
        closed: asyncio.Future[Any] = asyncio.ensure_future(plugin.channel.closed.wait())
        try:
            async with asyncio.timeout(cfg.registration_timeout):
                await asyncio.wait([plugin.registered, closed], return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            raise TimeoutError(f"did not register within {cfg.registration_timeout} s") from None
        finally:
            closed.cancel()
        if not plugin.registered.done():
            return  # gone before registering
        configure = nri.ConfigureRequest(
            runtime_name="cri-shim",
            runtime_version=__version__,
            registration_timeout=int(cfg.registration_timeout * 1000),
            request_timeout=int(cfg.request_timeout * 1000),
            NRI_version=NRI_VERSION,
        )
        payload = await plugin.channel.call(PLUGIN_SERVICE, "Configure", configure, cfg.registration_timeout)
        events = nri.ConfigureResponse.FromString(payload).events
        plugin.events = events if events > 0 else (1 << (nri.LAST - 1)) - 1
        await self._submit(lambda: self._synchronize(plugin))
        log.info(
            "nri.plugin_joined",
            plugin=plugin.label,
            events=[name for e, name in _NAMES.items() if e and e < nri.LAST and plugin.wants(e)],
        )

    async def _synchronize(self, plugin: Plugin) -> None:
        """Tell the plugin what exists, then make it one of those called: one job of the
        queue, so no event falls between the two."""
        sandboxes, containers = self._snapshot()
        pods = [convert.pod(sb) for sb in sandboxes]
        ctrs = [convert.container(c) for c in containers]
        chunks: list[nri.SynchronizeRequest] = [nri.SynchronizeRequest()]
        size = 0
        for item in (*pods, *ctrs):
            n = item.ByteSize() + 8
            if size + n > SYNC_CHUNK and size:
                chunks[-1].more = True
                chunks.append(nri.SynchronizeRequest())
                size = 0
            if isinstance(item, nri.PodSandbox):
                chunks[-1].pods.append(item)
            else:
                assert isinstance(item, nri.Container)
                chunks[-1].containers.append(item)
            size += n
        for chunk in chunks:
            payload = await plugin.channel.call(
                PLUGIN_SERVICE, "Synchronize", chunk, self.config.registration_timeout
            )
            resp = nri.SynchronizeResponse.FromString(payload)
            self._apply_updates(plugin, resp.update)
        if plugin.channel.closed.is_set():
            return
        self._plugins.append(plugin)
        self._plugins.sort(key=lambda p: (p.idx, p.name))

    async def _runtime_request(self, plugin: Plugin, service: str, method: str, payload: bytes) -> bytes:
        if service != RUNTIME_SERVICE:
            raise CallError(CODE_UNIMPLEMENTED, f"no service {service!r}")
        if method == "RegisterPlugin":
            req = nri.RegisterPluginRequest.FromString(payload)
            if plugin.registered.done():
                raise CallError(CODE_INVALID_ARGUMENT, f"plugin {plugin.label} is registered already")
            if not req.plugin_name or not _INDEX.match(req.plugin_idx):
                raise CallError(
                    CODE_INVALID_ARGUMENT,
                    f"plugin name {req.plugin_name!r} and index {req.plugin_idx!r}: "
                    "a name and a two-digit index are needed",
                )
            taken = {p.label for p in self._plugins}
            if f"{req.plugin_idx}-{req.plugin_name}" in taken:
                raise CallError(
                    CODE_INVALID_ARGUMENT, f"plugin {req.plugin_idx}-{req.plugin_name} is connected already"
                )
            plugin.name, plugin.idx = req.plugin_name, req.plugin_idx
            plugin.registered.set_result(None)
            return nri.Empty().SerializeToString()
        if method == "UpdateContainers":
            if plugin not in self._plugins:
                raise CallError(CODE_INVALID_ARGUMENT, "UpdateContainers before the plugin was synchronised")
            upd = nri.UpdateContainersRequest.FromString(payload)
            failed = nri.UpdateContainersResponse()
            for u in upd.update:
                if not await self._update_one(plugin, u) and not u.ignore_failure:
                    failed.failed.append(u)
            for e in upd.evict:
                log.warning(
                    "nri.evict_refused", plugin=plugin.label, container_id=e.container_id, reason=e.reason
                )
            return failed.SerializeToString()
        raise CallError(CODE_UNIMPLEMENTED, f"{service}/{method} is not implemented")


def _request(event: int, pod: nri.PodSandbox | None, ctr: nri.Container | None) -> Message:
    method = _METHODS.get(event)
    if method is None:
        msg = nri.StateChangeEvent(event=event)  # type: ignore[arg-type]
        if pod is not None:
            msg.pod.CopyFrom(pod)
        if ctr is not None:
            msg.container.CopyFrom(ctr)
        return msg
    req = method[1]()
    if pod is not None:
        req.pod.CopyFrom(pod)  # type: ignore[attr-defined]
    if ctr is not None and "container" in req.DESCRIPTOR.fields_by_name:
        req.container.CopyFrom(ctr)  # type: ignore[attr-defined]
    return req


@contextlib.contextmanager
def _applicable(plugin: Plugin, did: str, c: ContainerRecord) -> Iterator[None]:
    """Around applying what ``plugin`` ``did`` to container ``c``: a change the CRI backends
    cannot apply (AdjustmentError) is refused as FailedPrecondition."""
    try:
        yield
    except convert.AdjustmentError as exc:
        raise FailedPreconditionError(
            f"NRI plugin {plugin.label} {did} {exc} of container {c.id}, which the CRI backends cannot apply"
        ) from None


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("nri.event_failed", error=str(future.exception()))


class _InUse(Exception):
    pass


def _clear_stale(path: str) -> None:
    """Make the socket's folder; remove a socket nobody listens on any more."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # stale: nobody answers
        return
    finally:
        probe.close()
    raise _InUse(f"{path} is served by another process (another runtime's NRI?)")
