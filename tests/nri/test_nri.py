"""NRI end to end: a real shim over the fake backend, plugins of tests/nri/plugin.py on its
NRI socket, and what a CRI client and a plugin see."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import os
import random
import tempfile
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from backends.fake import FakeBackend
from cri_api import api_pb2 as pb
from cri_api import nri_pb2 as nri
from shim.nri import service as service_module
from shim.nri import wire as wire_module
from shim.nri.wire import MAX_MESSAGE, MAX_MUX_PAYLOAD, MUX_HEADER, TTRPC_HEADER, CallError
from shim.server import Server
from tests.conftest import Running, make_ids, server_config
from tests.criutil import container_config, sandbox_config
from tests.nri import plugin as nri_plugin
from tests.nri.plugin import Plugin, Seen, mask
from tests.streaming.streaming_helpers import LogRecorder

LIFECYCLE = (
    nri.RUN_POD_SANDBOX,
    nri.STOP_POD_SANDBOX,
    nri.REMOVE_POD_SANDBOX,
    nri.CREATE_CONTAINER,
    nri.START_CONTAINER,
    nri.STOP_CONTAINER,
    nri.REMOVE_CONTAINER,
)


# --------------------------------------------------------------------------- helpers


async def eventually(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    """``check()``'s first truthy value (it may be a coroutine function), polled; fails after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"not true within {timeout} s: {check}")
        await asyncio.sleep(0.02)


async def failure(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code(), info.value.details() or ""


class Shim(Running):
    """A running shim, the tmp dir it lives in, and the plugins a test connected."""

    def __init__(self, server: Server, channel: grpc.aio.Channel, fake: FakeBackend, tmp: str) -> None:
        super().__init__(server, channel, fake)
        self.tmp = tmp
        self.nri_socket = os.path.join(tmp, "nri.sock")
        self.connected: list[Plugin] = []

    @property
    def plugins(self) -> list[str]:
        assert self.server.shim is not None
        return self.server.shim.nri.plugins

    async def plugin(self, name: str, idx: str = "10", events: int = 0, ready: bool = True) -> Plugin:
        p = await nri_plugin.connect(self.nri_socket, name, idx, events)
        self.connected.append(p)
        if ready:
            await p.wait_ready()
            # The plugin answered Synchronize; the shim lists it once it took the answer.
            await eventually(lambda: p.label in self.plugins)
        return p

    async def run_pod(self, name: str = "pod", **kw: Any) -> tuple[str, pb.PodSandboxConfig]:
        sc = sandbox_config(name=name, log_directory=os.path.join(self.tmp, "logs"), **kw)
        pod = (await self.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
        return pod, sc

    def create_request(self, pod: str, sc: pb.PodSandboxConfig, **kw: Any) -> pb.CreateContainerRequest:
        kw.setdefault("command", ["sleep", "3600"])
        return pb.CreateContainerRequest(pod_sandbox_id=pod, config=container_config(**kw), sandbox_config=sc)

    async def create(self, pod: str, sc: pb.PodSandboxConfig, start: bool = False, **kw: Any) -> str:
        cid = (await self.rt.CreateContainer(self.create_request(pod, sc, **kw))).container_id
        if start:
            await self.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
        return cid

    async def pods(self) -> list[pb.PodSandbox]:
        return list((await self.rt.ListPodSandbox(pb.ListPodSandboxRequest())).items)

    async def containers(self) -> list[pb.Container]:
        return list((await self.rt.ListContainers(pb.ListContainersRequest())).containers)

    async def status(self, cid: str) -> pb.ContainerStatus:
        return (await self.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))).status

    async def healthy(self) -> None:
        version = await self.rt.Version(pb.VersionRequest())
        assert version.runtime_name


@contextlib.asynccontextmanager
async def shim(tmp: str, **nri_settings: Any) -> AsyncIterator[Shim]:
    """The whole shim on a real socket, fake backend, ``[nri]`` as given; busybox pulled."""
    base = server_config(tmp)
    config = dataclasses.replace(base, nri=dataclasses.replace(base.nri, **nri_settings))
    fake = FakeBackend("fake", {"state_dir": os.path.join(tmp, "fake")})
    server = Server(config, backends={"fake": fake}, id_factory=make_ids("nri"))
    await server.start()
    channel = grpc.aio.insecure_channel(f"unix://{tmp}/cri.sock")
    s = Shim(server, channel, fake, tmp)
    try:
        await s.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox")))
        yield s
    finally:
        await channel.close()
        await server.stop(0)
        for p in s.connected:
            await p.close()


class Watch:
    def __init__(self) -> None:
        self.log = LogRecorder()
        self.unhandled: list[dict[str, Any]] = []


@pytest.fixture(autouse=True)
async def no_tracebacks(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Watch]:
    """Whatever a plugin does: no error logged by NRI, no unhandled exception in a task."""
    watch = Watch()
    monkeypatch.setattr(service_module, "log", watch.log)
    monkeypatch.setattr(wire_module, "log", watch.log)
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: watch.unhandled.append(context))
    try:
        yield watch
    finally:
        loop.set_exception_handler(previous)
    assert not watch.log.failures(), watch.log.failures()
    assert not watch.unhandled, watch.unhandled


def blocking_hook() -> tuple[Any, asyncio.Event, asyncio.Event]:
    """A hook that blocks until released: (hook, entered, release)."""
    entered, release = asyncio.Event(), asyncio.Event()

    async def hook(_req: Any) -> None:
        entered.set()
        await release.wait()

    return hook, entered, release


def failing_hook(message: str) -> Any:
    async def hook(_req: Any) -> None:
        raise RuntimeError(message)

    return hook


# --------------------------------------------------------------------------- joining and events


async def test_join_then_lifecycle_in_order(short_tmp: str) -> None:
    async with shim(short_tmp) as s:
        old_pod, old_sc = await s.run_pod("before")
        old_cid = await s.create(old_pod, old_sc, name="old", start=True)

        p = await s.plugin("watcher", events=mask(*LIFECYCLE))
        assert p.configure is not None and p.configure.runtime_name == "cri-shim"
        assert [x.id for x in p.synced_pods] == [old_pod]
        assert [(x.id, x.name, x.pod_sandbox_id) for x in p.synced_containers] == [(old_cid, "old", old_pod)]
        assert p.synced_containers[0].state == nri.CONTAINER_RUNNING
        assert s.plugins == ["10-watcher"]
        assert p.events == []

        pod, sc = await s.run_pod("web", namespace="prod", uid="uid-web")
        cid = await s.create(pod, sc, name="app", start=True)
        await s.rt.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=0))
        await s.rt.RemoveContainer(pb.RemoveContainerRequest(container_id=cid))
        await s.rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod))
        await s.rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod))

        expected = [
            Seen("RUN_POD_SANDBOX", pod, "", ""),
            Seen("CREATE_CONTAINER", pod, cid, "app"),
            Seen("START_CONTAINER", pod, cid, "app"),
            Seen("STOP_CONTAINER", pod, cid, "app"),
            Seen("REMOVE_CONTAINER", pod, cid, "app"),
            Seen("STOP_POD_SANDBOX", pod, "", ""),
            Seen("REMOVE_POD_SANDBOX", pod, "", ""),
        ]
        await eventually(lambda: len(p.events) >= len(expected))
        assert p.events == expected
        for req in p.requests:
            assert (req.pod.name, req.pod.namespace, req.pod.uid) == ("web", "prod", "uid-web")
    # The shim's stop tells the plugin.
    assert p.events[-1].event == "SHUTDOWN"


async def test_subscribed_to_everything_gets_post_events_as_state_changes(short_tmp: str) -> None:
    async with shim(short_tmp) as s:
        p = await s.plugin("all")  # events=0: every event
        pod, sc = await s.run_pod()
        cid = await s.create(pod, sc, start=True)
        await eventually(lambda: p.of("POST_START_CONTAINER"))
        assert [e.event for e in p.events] == [
            "RUN_POD_SANDBOX",
            "CREATE_CONTAINER",
            "POST_CREATE_CONTAINER",
            "START_CONTAINER",
            "POST_START_CONTAINER",
        ]
        assert p.events[-1] == Seen("POST_START_CONTAINER", pod, cid, "ctr")


async def test_a_container_that_exits_on_its_own_is_a_stop_event(short_tmp: str) -> None:
    async with shim(short_tmp) as s:
        p = await s.plugin("exits", events=mask(nri.STOP_CONTAINER))
        pod, sc = await s.run_pod()
        cid = await s.create(pod, sc, name="quitter", command=["sh", "-c", "exit 3"], start=True)
        await eventually(lambda: p.of("STOP_CONTAINER"))
        assert p.events == [Seen("STOP_CONTAINER", pod, cid, "quitter")]
        seen = p.requests[0].container
        assert (seen.state, seen.exit_code) == (nri.CONTAINER_STOPPED, 3)
        st = await s.status(cid)
        assert (st.state, st.exit_code) == (pb.CONTAINER_EXITED, 3)


# --------------------------------------------------------------------------- refusals and slow plugins


async def test_run_pod_sandbox_refused_by_a_plugin(short_tmp: str) -> None:
    async with shim(short_tmp) as s:
        p = await s.plugin("gate")
        p.hooks["RUN_POD_SANDBOX"] = failing_hook("no pods today")
        sc = sandbox_config(name="refused", log_directory=os.path.join(short_tmp, "logs"))
        code, details = await failure(s.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc)))
        assert code == grpc.StatusCode.ABORTED
        assert "10-gate" in details and "no pods today" in details
        assert await s.pods() == []
        # The plugin is told that the pod it saw is gone.
        await eventually(lambda: p.of("REMOVE_POD_SANDBOX"))
        assert p.of("RUN_POD_SANDBOX")[0].pod_id == p.of("REMOVE_POD_SANDBOX")[0].pod_id

        del p.hooks["RUN_POD_SANDBOX"]
        pod = (await s.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
        assert [(x.id, x.state) for x in await s.pods()] == [(pod, pb.SANDBOX_READY)]
        assert s.plugins == ["10-gate"]


async def test_create_container_refused_by_a_plugin(short_tmp: str) -> None:
    async with shim(short_tmp) as s:
        p = await s.plugin("gate")
        pod, sc = await s.run_pod()
        p.hooks["CREATE_CONTAINER"] = failing_hook("not this one")
        code, details = await failure(s.rt.CreateContainer(s.create_request(pod, sc, name="app")))
        assert code == grpc.StatusCode.ABORTED
        assert "10-gate" in details and "not this one" in details
        assert await s.containers() == []

        del p.hooks["CREATE_CONTAINER"]
        cid = await s.create(pod, sc, name="app", start=True)
        assert [(c.id, c.metadata.name) for c in await s.containers()] == [(cid, "app")]


async def test_a_plugin_that_does_not_answer_is_disconnected(short_tmp: str) -> None:
    async with shim(short_tmp, request_timeout=0.3) as s:
        slow = await s.plugin("slow", events=mask(nri.RUN_POD_SANDBOX))
        hook, _entered, release = blocking_hook()
        slow.hooks["RUN_POD_SANDBOX"] = hook
        sc = sandbox_config(name="waits")
        code, details = await failure(s.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc)))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "10-slow" in details
        assert s.plugins == []
        assert slow.channel is not None
        await eventually(slow.channel.closed.is_set)
        assert await s.pods() == []

        pod = (await s.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
        assert [x.id for x in await s.pods()] == [pod]
        release.set()


async def test_a_pod_is_not_listed_while_a_plugin_holds_it(short_tmp: str) -> None:
    async with shim(short_tmp, request_timeout=30.0) as s:
        p = await s.plugin("holder", events=mask(nri.RUN_POD_SANDBOX))
        hook, entered, release = blocking_hook()
        p.hooks["RUN_POD_SANDBOX"] = hook
        sc = sandbox_config(name="held")
        running = asyncio.ensure_future(s.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc)))
        await asyncio.wait_for(entered.wait(), 10)
        assert await s.pods() == []
        await s.healthy()  # other calls go on meanwhile
        assert not running.done()

        release.set()
        pod = (await asyncio.wait_for(running, 10)).pod_sandbox_id
        assert [(x.id, x.state) for x in await s.pods()] == [(pod, pb.SANDBOX_READY)]
        st = await s.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod))
        assert st.status.state == pb.SANDBOX_READY


# --------------------------------------------------------------------------- adjustments and updates


async def test_an_adjustment_is_applied(short_tmp: str) -> None:
    host_dir = tempfile.mkdtemp(dir=short_tmp)
    with open(os.path.join(host_dir, "hello.txt"), "w") as f:
        f.write("from the host\n")
    async with shim(short_tmp) as s:
        p = await s.plugin("adjuster", events=mask(nri.CREATE_CONTAINER))

        async def adjust(_req: Any) -> nri.ContainerAdjustment:
            a = nri.ContainerAdjustment(
                env=[nri.KeyValue(key="ADDED", value="by-nri"), nri.KeyValue(key="-DROPPED")],
                mounts=[
                    nri.Mount(destination="/nri-data", type="bind", source=host_dir, options=["rbind", "ro"])
                ],
                args=["sh", "-c", "echo adjusted-args; sleep 3600"],
            )
            a.annotations["nri.example.com/touched"] = "yes"
            return a

        p.hooks["CREATE_CONTAINER"] = adjust
        pod, sc = await s.run_pod()
        envs = [pb.KeyValue(key="KEPT", value=b"1"), pb.KeyValue(key="DROPPED", value=b"x")]
        cid = await s.create(pod, sc, name="app", envs=envs, log_path="app.log", start=True)

        # The plugin saw the container as the client asked for it.
        seen = p.requests[0].container
        assert "DROPPED=x" in seen.env and list(seen.args) == ["sleep", "3600"]

        st = await s.status(cid)
        assert st.annotations["nri.example.com/touched"] == "yes"
        assert [(m.container_path, m.host_path, m.readonly) for m in st.mounts] == [
            ("/nri-data", host_dir, True)
        ]
        env = await s.rt.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["env"], timeout=10))
        lines = env.stdout.decode().splitlines()
        assert "ADDED=by-nri" in lines and "KEPT=1" in lines
        assert not [line for line in lines if line.startswith("DROPPED=")]
        cat = await s.rt.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["cat", "/nri-data/hello.txt"]))
        assert (cat.exit_code, cat.stdout) == (0, b"from the host\n")
        log_file = os.path.join(short_tmp, "logs", "app.log")

        def logged() -> bool:
            if not os.path.exists(log_file):
                return False
            with open(log_file) as f:
                return "adjusted-args" in f.read()

        await eventually(logged)


@pytest.mark.parametrize(
    ("field", "adjustment"),
    [
        ("rlimits", nri.ContainerAdjustment(rlimits=[nri.POSIXRlimit(type="RLIMIT_NOFILE", hard=1, soft=1)])),
        ("linux.sysctl", nri.ContainerAdjustment(linux=nri.LinuxContainerAdjustment(sysctl={"net.x": "1"}))),
    ],
)
async def test_an_unsupported_adjustment_is_refused(
    short_tmp: str, field: str, adjustment: nri.ContainerAdjustment
) -> None:
    async with shim(short_tmp) as s:
        p = await s.plugin("adjuster", events=mask(nri.CREATE_CONTAINER))

        async def adjust(_req: Any) -> nri.ContainerAdjustment:
            return adjustment

        p.hooks["CREATE_CONTAINER"] = adjust
        pod, sc = await s.run_pod()
        code, details = await failure(s.rt.CreateContainer(s.create_request(pod, sc, name="app")))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "10-adjuster" in details and field in details
        assert await s.containers() == []

        del p.hooks["CREATE_CONTAINER"]
        cid = await s.create(pod, sc, name="app")  # the name was released
        assert [c.id for c in await s.containers()] == [cid]


async def test_update_containers_from_a_plugin(short_tmp: str) -> None:
    async with shim(short_tmp) as s:
        p = await s.plugin("tuner", events=mask(nri.CREATE_CONTAINER))
        pod, sc = await s.run_pod()
        cid = await s.create(pod, sc, start=True)
        resources = nri.LinuxResources(
            cpu=nri.LinuxCPU(shares=nri.OptionalUInt64(value=512)),
            memory=nri.LinuxMemory(limit=nri.OptionalInt64(value=256 << 20)),
        )
        missing = nri.ContainerUpdate(
            container_id="f" * 64, linux=nri.LinuxContainerUpdate(resources=resources)
        )
        resp = await p.update_containers(
            [
                nri.ContainerUpdate(container_id=cid, linux=nri.LinuxContainerUpdate(resources=resources)),
                missing,
            ]
        )
        assert [u.container_id for u in resp.failed] == [missing.container_id]
        linux = (await s.status(cid)).resources.linux
        assert (linux.cpu_shares, linux.memory_limit_in_bytes) == (512, 256 << 20)


async def test_a_plugin_changes_update_container_resources(short_tmp: str) -> None:
    async with shim(short_tmp) as s:
        p = await s.plugin("tuner", events=mask(nri.UPDATE_CONTAINER))
        pod, sc = await s.run_pod()
        cid = await s.create(pod, sc, start=True)

        async def more_shares(req: Any) -> nri.UpdateContainerResponse:
            res = nri.LinuxResources(cpu=nri.LinuxCPU(shares=nri.OptionalUInt64(value=1024)))
            update = nri.ContainerUpdate(
                container_id=req.container.id, linux=nri.LinuxContainerUpdate(resources=res)
            )
            return nri.UpdateContainerResponse(update=[update])

        p.hooks["UPDATE_CONTAINER"] = more_shares
        asked = pb.LinuxContainerResources(cpu_shares=2, memory_limit_in_bytes=128 << 20)
        await s.rt.UpdateContainerResources(pb.UpdateContainerResourcesRequest(container_id=cid, linux=asked))
        assert p.events == [Seen("UPDATE_CONTAINER", pod, cid, "ctr")]
        assert p.requests[0].linux_resources.cpu.shares.value == 2
        linux = (await s.status(cid)).resources.linux
        assert (linux.cpu_shares, linux.memory_limit_in_bytes) == (1024, 128 << 20)


async def test_update_pod_sandbox_resources_goes_to_plugins_first(short_tmp: str) -> None:
    """UpdatePodSandbox with the new resources before anything changes (a refusal is ABORTED and
    changes nothing), then PostUpdatePodSandbox with the pod as it now is."""
    async with shim(short_tmp) as s:
        p = await s.plugin("sizer", events=mask(nri.UPDATE_POD_SANDBOX, nri.POST_UPDATE_POD_SANDBOX))
        pod, _sc = await s.run_pod()
        req = pb.UpdatePodSandboxResourcesRequest(
            pod_sandbox_id=pod,
            resources=pb.LinuxContainerResources(cpu_shares=512, memory_limit_in_bytes=256 << 20),
            overhead=pb.LinuxContainerResources(memory_limit_in_bytes=32 << 20),
        )
        p.hooks["UPDATE_POD_SANDBOX"] = failing_hook("not now")
        code, details = await failure(s.rt.UpdatePodSandboxResources(req))
        assert code == grpc.StatusCode.ABORTED and "10-sizer" in details and "not now" in details
        assert not s.fake.calls_to("update_sandbox_resources")
        assert s.server.shim is not None
        sb = s.server.shim.store.sandboxes.get(pod)
        assert sb is not None and not sb.config.linux.HasField("resources")

        del p.hooks["UPDATE_POD_SANDBOX"]
        await s.rt.UpdatePodSandboxResources(req)
        await eventually(lambda: p.of("POST_UPDATE_POD_SANDBOX"))
        assert [e.event for e in p.events] == [
            "UPDATE_POD_SANDBOX",
            "UPDATE_POD_SANDBOX",
            "POST_UPDATE_POD_SANDBOX",
        ]
        update, post = p.requests[1], p.requests[2]
        assert update.linux_resources.memory.limit.value == 256 << 20
        assert update.linux_resources.cpu.shares.value == 512
        assert update.overhead_linux_resources.memory.limit.value == 32 << 20
        assert not update.pod.linux.HasField("pod_resources")  # the pod as it was
        assert post.pod.linux.pod_resources.memory.limit.value == 256 << 20  # and as it now is
        assert post.pod.linux.pod_overhead.memory.limit.value == 32 << 20


async def test_start_container_refused_leaves_it_created(short_tmp: str) -> None:
    async with shim(short_tmp) as s:
        p = await s.plugin("gate", events=mask(nri.START_CONTAINER))
        pod, sc = await s.run_pod()
        cid = await s.create(pod, sc)
        p.hooks["START_CONTAINER"] = failing_hook("not yet")
        code, details = await failure(s.rt.StartContainer(pb.StartContainerRequest(container_id=cid)))
        assert code == grpc.StatusCode.ABORTED and "10-gate" in details and "not yet" in details
        assert (await s.status(cid)).state == pb.CONTAINER_CREATED

        del p.hooks["START_CONTAINER"]
        await s.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
        assert (await s.status(cid)).state == pb.CONTAINER_RUNNING


async def test_remove_pod_sandbox_alone_tells_everything(short_tmp: str) -> None:
    async with shim(short_tmp) as s:
        p = await s.plugin("watcher", events=mask(*LIFECYCLE))
        pod, sc = await s.run_pod()
        cid = await s.create(pod, sc, name="app", start=True)
        await s.rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod))
        assert [e for e in p.events if e.event.startswith(("STOP", "REMOVE"))] == [
            Seen("STOP_CONTAINER", pod, cid, "app"),
            Seen("STOP_POD_SANDBOX", pod, "", ""),
            Seen("REMOVE_CONTAINER", pod, cid, "app"),
            Seen("REMOVE_POD_SANDBOX", pod, "", ""),
        ]


# --------------------------------------------------------------------------- bad plugins, order, off


async def closed_by_shim(reader: asyncio.StreamReader) -> bool:
    """Whether the shim ends the connection (EOF) within 10 s."""
    async with asyncio.timeout(10):
        while await reader.read(65536):
            pass
    return True


async def test_garbage_on_the_socket_ends_only_that_connection(short_tmp: str) -> None:
    async with shim(short_tmp, registration_timeout=1.0) as s:
        good = await s.plugin("good", events=mask(nri.RUN_POD_SANDBOX))
        noise = random.Random(7).randbytes(4096)
        assert MUX_HEADER.unpack_from(noise)[0] not in (1, 2)
        bad_message = TTRPC_HEADER.pack(MAX_MESSAGE + 1, 1, 1, 0)
        undecodable = TTRPC_HEADER.pack(4, 1, 1, 0) + b"\xff\xff\xff\xff"
        response_to_server = TTRPC_HEADER.pack(0, 1, 2, 0)
        garbage = {
            "random bytes": noise,
            "connection 7": MUX_HEADER.pack(7, 4) + b"abcd",
            "connection 0": MUX_HEADER.pack(0, 0),
            "oversized frame": MUX_HEADER.pack(1, MAX_MUX_PAYLOAD + 1),
            "oversized ttrpc message": MUX_HEADER.pack(1, len(bad_message)) + bad_message,
            "undecodable request": MUX_HEADER.pack(2, len(undecodable)) + undecodable,
            "response to the shim's server": MUX_HEADER.pack(2, len(response_to_server)) + response_to_server,
            "never registers": b"",
        }
        for what, data in garbage.items():
            reader, writer = await asyncio.open_unix_connection(s.nri_socket)
            try:
                with contextlib.suppress(ConnectionError):
                    writer.write(data)
                    await writer.drain()
                assert await closed_by_shim(reader), what
            finally:
                writer.close()
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()
            await s.healthy()

        # Registrations the shim refuses: a bad index, a name and index taken.
        for name, idx in (("bad", "5"), ("bad", "x1"), ("", "10"), ("good", "10")):
            with pytest.raises(CallError):
                await s.plugin(name, idx)
        assert s.plugins == ["10-good"]

        pod, _sc = await s.run_pod()
        assert good.events == [Seen("RUN_POD_SANDBOX", pod, "", "")]
        await s.healthy()


async def test_a_plugin_that_goes_away_is_forgotten(short_tmp: str) -> None:
    async with shim(short_tmp) as s:
        gone = await s.plugin("gone")
        await gone.close()
        await eventually(lambda: s.plugins == [])
        await s.run_pod()
        assert len(await s.pods()) == 1


async def test_plugins_are_called_in_index_order(short_tmp: str) -> None:
    async with shim(short_tmp) as s:
        order: list[str] = []

        def recorder(label: str) -> Any:
            async def hook(_req: Any) -> None:
                order.append(label)

            return hook

        late = await s.plugin("late", "10", events=mask(nri.RUN_POD_SANDBOX))
        early = await s.plugin("early", "05", events=mask(nri.RUN_POD_SANDBOX))
        late.hooks["RUN_POD_SANDBOX"] = recorder(late.label)
        early.hooks["RUN_POD_SANDBOX"] = recorder(early.label)
        assert s.plugins == ["05-early", "10-late"]
        await s.run_pod()
        assert order == ["05-early", "10-late"]


async def test_nri_disabled_makes_no_socket(short_tmp: str) -> None:
    async with shim(short_tmp, enable=False) as s:
        assert not os.path.exists(s.nri_socket)
        pod, sc = await s.run_pod()
        await s.create(pod, sc, start=True)
        assert len(await s.containers()) == 1
        with pytest.raises(OSError):
            await nri_plugin.connect(s.nri_socket, "nobody", "10")


async def test_stop_with_a_plugin_connected_reports_no_error(short_tmp: str, no_tracebacks: Watch) -> None:
    async with shim(short_tmp) as s:
        p = await s.plugin("stays")
    assert p.events[-1].event == "SHUTDOWN"
    # A plugin connected when the shim stops: its connection ends quietly.
    assert not no_tracebacks.unhandled, no_tracebacks.unhandled
