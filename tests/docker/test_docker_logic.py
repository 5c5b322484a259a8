"""The docker backend's logic over the recording fake engine: no dockerd needed, so not marked docker."""

from __future__ import annotations

import asyncio
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from backends.contract import ContainerRecord, SandboxRecord
from backends.contract.errors import (
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from backends.docker import DockerBackend
from backends.docker import labels as lbl
from backends.docker.fake_engine import FakeEngine
from cri_api import api_pb2 as pb
from cri_api import api_pb2_grpc
from shim.config import parse
from shim.server import Server
from tests.conftest import make_ids, server_config
from tests.criutil import sandbox_config
from tests.docker.dockerkit import BUSYBOX, PAUSE, Events, container_record, sandbox_record


class Kit:
    def __init__(self, engine: FakeEngine, backend: DockerBackend, events: Events) -> None:
        self.engine, self.backend, self.events = engine, backend, events
        self.logs: dict[str, Sink] = {}

    async def pod(self) -> SandboxRecord:
        sb = sandbox_record()
        await self.backend.lifecycle.run_sandbox(sb)
        sb.committed = True
        return sb

    async def running(self, sb: SandboxRecord, **config: object) -> ContainerRecord:
        ct = container_record(sb, ["sleep", "1000"], **config)  # type: ignore[arg-type]
        await self.backend.lifecycle.create_container(ct, sb)
        ct.committed = True
        self.logs[ct.id] = Sink()
        await self.events.start(self.backend.lifecycle, ct, sb, self.logs[ct.id])
        return ct


class Sink:
    def __init__(self) -> None:
        self.data: list[tuple[str, bytes]] = []
        self.closed = 0

    def write(self, stream: str, data: bytes, at: int = 0) -> None:
        self.data.append((stream, data))

    def flush_partial(self) -> None:
        pass

    def close(self, flush: bool = True) -> None:
        self.closed += 1


async def new_kit(engine: FakeEngine | None = None) -> Kit:
    engine = engine or FakeEngine()
    if not engine.images:
        engine.add_image(PAUSE)
        engine.add_image(BUSYBOX)
    events = Events()
    backend = DockerBackend("docker", engine=engine, pause_image=PAUSE, instance="logic")
    await backend.lifecycle.start(events)
    await asyncio.sleep(0)  # the event watcher subscribes
    return Kit(engine, backend, events)


@pytest.fixture
async def kit() -> AsyncIterator[Kit]:
    k = await new_kit()
    yield k
    await k.events.close()
    await k.backend.lifecycle.close()


async def test_lifecycle_maps_to_engine_calls(kit: Kit) -> None:
    sb = await kit.pod()
    ct = await kit.running(sb)
    eid = ct.backend_data["engine_id"]
    assert kit.engine.containers[eid].running
    assert ct.backend_data["pid"] == kit.engine.containers[eid].pid
    info = await kit.backend.lifecycle.stop_container(ct, 5)
    assert (info.exit_code, info.reason) == (143, "Error")
    assert await kit.events.exit_of(ct.id, timeout=5) == info  # the process ends with the stop's exit
    await kit.backend.lifecycle.remove_container(ct)
    await kit.backend.lifecycle.stop_sandbox(sb)
    await kit.backend.lifecycle.remove_sandbox(sb)
    assert kit.engine.containers == {}
    ops = [op for op, _ in kit.engine.calls if op.endswith("_container")]
    assert ops[:2] == ["create_container", "start_container"]
    assert kit.backend.states.containers == {} and kit.backend.states.sandboxes == {}


async def test_failed_sandbox_start_leaves_nothing(kit: Kit) -> None:
    kit.engine.fail("start_container", InternalError("no network"))
    sb = sandbox_record()
    with pytest.raises(InternalError):
        await kit.backend.lifecycle.run_sandbox(sb)
    assert kit.engine.containers == {}
    assert "engine_id" not in sb.backend_data
    assert kit.backend.states.sandboxes == {}


async def test_leftover_of_the_same_name_is_replaced(kit: Kit) -> None:
    sb = sandbox_record()
    await kit.engine.create_container(lbl.sandbox_name(sb.id, sb.config), {"Image": PAUSE})
    await kit.backend.lifecycle.run_sandbox(sb)
    assert len(kit.engine.containers) == 1
    assert kit.engine.count("remove_container") == 1


async def test_exit_reported_once_with_oom_reason(kit: Kit) -> None:
    sb = await kit.pod()
    ct = await kit.running(sb)
    kit.engine.exit(ct.backend_data["engine_id"], 137, oom=True, oom_event_first=False)
    info = await kit.events.exit_of(ct.id, timeout=5)
    assert (info.exit_code, info.reason) == (137, "OOMKilled")
    reported = dict(kit.events.exits)
    await kit.backend.lifecycle._events._check_watched()  # a reconnect looks again: nothing new
    await asyncio.sleep(0.1)
    assert kit.events.exits == reported and len(reported) == 1


async def test_plain_exit_and_sandbox_death(kit: Kit) -> None:
    sb = await kit.pod()
    ct = await kit.running(sb)
    kit.engine.write(ct.backend_data["engine_id"], "stdout", b"bye\n")
    kit.engine.exit(ct.backend_data["engine_id"], 3)
    info = await kit.events.exit_of(ct.id, timeout=5)
    assert (info.exit_code, info.reason) == (3, "Error")
    sink = kit.logs[ct.id]
    assert isinstance(sink, Sink) and ("stdout", b"bye\n") in sink.data  # timestamps stripped
    kit.engine.exit(sb.backend_data["engine_id"], 0)
    for _ in range(50):
        if sb.id in kit.events.not_ready:
            break
        await asyncio.sleep(0.02)
    assert kit.events.not_ready[sb.id] == "pause container exited"


async def test_a_last_line_the_engine_logs_after_the_stream_ended_is_in_the_log(kit: Kit) -> None:
    """`printf DONE; exit 1`: the engine ends the followed stream before DONE is in its log, and
    says the container died later; the kubelet reads the log (FallbackToLogsOnError) once it
    sees the exit, so DONE must be in it by then."""
    sb = await kit.pod()
    ct = await kit.running(sb)
    eid = ct.backend_data["engine_id"]
    for _ in range(100):  # until the shim follows the log
        if kit.engine.following(eid):
            break
        await asyncio.sleep(0.01)
    kit.engine.exit_with_late_output(eid, 1, b"DONE", die_after=0.3)
    info = await kit.events.exit_of(ct.id, timeout=5)
    assert info.exit_code == 1
    assert kit.logs[ct.id].data == [("stdout", b"DONE")]


async def test_a_tty_containers_last_line_after_its_stream_ended_is_in_the_log_once(kit: Kit) -> None:
    """With a TTY the engine's records carry no time: the last read starts at the log's start
    and skips what was written (neither lost nor written twice)."""
    sb = await kit.pod()
    ct = await kit.running(sb, tty=True)
    eid = ct.backend_data["engine_id"]
    kit.engine.write(eid, "stdout", b"hello\r\n")
    for _ in range(100):
        if kit.logs[ct.id].data:
            break
        await asyncio.sleep(0.01)
    kit.engine.exit_with_late_output(eid, 1, b"DONE", die_after=0.3)
    assert (await kit.events.exit_of(ct.id, timeout=5)).exit_code == 1
    assert b"".join(d for _, d in kit.logs[ct.id].data) == b"hello\r\nDONE"


async def test_exit_heard_while_engine_down_is_reported_later(kit: Kit) -> None:
    sb = await kit.pod()
    ct = await kit.running(sb)
    kit.engine.fail("inspect_container", UnavailableError("down"))
    kit.engine.exit(ct.backend_data["engine_id"], 1)
    await asyncio.sleep(0.2)
    assert ct.id not in kit.events.exits
    info = await kit.events.exit_of(ct.id, timeout=5)  # the recheck a second later
    assert info.exit_code == 1


async def test_remove_drops_all_per_object_state(kit: Kit) -> None:
    sb = await kit.pod()
    ct = await kit.running(sb)
    st = kit.backend.states.containers[ct.id]
    st.cpu_prev = (1, 1)
    kit.backend.states.sandboxes[sb.id].cpu_prev = (1, 1)
    process = st.process
    assert process is not None and ct.id in kit.events.io
    await kit.events.stop(kit.backend.lifecycle, ct, 0)
    await kit.backend.lifecycle.remove_container(ct)
    await kit.backend.lifecycle.stop_sandbox(sb)
    await kit.backend.lifecycle.remove_sandbox(sb)
    await asyncio.sleep(0)
    assert kit.backend.states.containers == {} and kit.backend.states.sandboxes == {}
    assert process.exit.info is not None and ct.id not in kit.events.io  # nothing follows it any more


async def test_recovery_adopts_marks_and_removes(kit: Kit) -> None:
    sb = await kit.pod()
    running = await kit.running(sb)
    gone = await kit.running(sb, name="gone")
    stray = container_record(sb, ["true"], name="stray")
    await kit.backend.lifecycle.create_container(stray, sb)  # never committed: a leftover
    del kit.engine.containers[gone.backend_data["engine_id"]]
    kit.engine.exit(running.backend_data["engine_id"], 0)
    await kit.backend.lifecycle.close()

    later = await new_kit(kit.engine)
    try:
        for r in (sb, running, gone):
            r.backend_data.pop("engine_id", None)
        sbs, cts = await later.backend.lifecycle.recover([sb], [running, gone])
        assert sbs[sb.id].exists and sbs[sb.id].running
        assert cts[running.id].exists and not cts[running.id].running
        assert cts[running.id].exit is not None and cts[running.id].exit.reason == "Completed"
        assert not cts[gone.id].exists
        assert kit.engine.by_cri_id(stray.id) is None
        assert running.backend_data["engine_id"]
        assert later.backend.states.sandboxes[sb.id].watched
    finally:
        await later.backend.lifecycle.close()


async def test_hugepage_reasons_passed_over_are_said_once(kit: Kit, monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[tuple[int, str, list[tuple[str, int]]]] = []

    def set_hugetlb(pid: int, eid: str, limits: list[tuple[str, int]]) -> list[str]:
        said.append((pid, eid, limits))
        return ["no hugetlb controller"]

    monkeypatch.setattr(kit.backend._shared.cgroups, "set_hugetlb", set_hugetlb)
    sb = await kit.pod()
    limit = pb.HugepageLimit(page_size="2MB", limit=2 << 20)
    res = pb.LinuxContainerResources(hugepage_limits=[limit])
    a = await kit.running(sb, linux=pb.LinuxContainerConfig(resources=res))
    await kit.running(sb, name="b", linux=pb.LinuxContainerConfig(resources=res))
    assert [s[2] for s in said] == [[("2MB", 2 << 20)]] * 2
    assert said[0][:2] == (a.backend_data["pid"], a.backend_data["engine_id"])
    assert kit.backend.lifecycle._hugetlb_said == {"no hugetlb controller"}


async def test_engine_down_is_unavailable() -> None:
    engine = FakeEngine()
    engine.down = True
    k = await new_kit(engine)
    try:
        health = await k.backend.lifecycle.health()
        assert not health.runtime_ready and health.reason == "DockerDaemonNotReady"
        with pytest.raises(UnavailableError):
            await k.backend.images.list_images()
        with pytest.raises(UnavailableError):
            await k.backend.lifecycle.run_sandbox(sandbox_record())
    finally:
        await k.backend.lifecycle.close()


async def test_missing_image_is_not_found_and_creates_nothing(kit: Kit) -> None:

    sb = await kit.pod()
    ct = container_record(sb, ["true"])
    ct.config.image.image = "127.0.0.1:5000/absent:1"
    with pytest.raises(NotFoundError):
        await kit.backend.lifecycle.create_container(ct, sb)
    assert kit.engine.count("create_container") == 1  # the pause container only
    assert ct.id not in kit.backend.states.containers


async def test_exec_sync_through_the_engine(kit: Kit) -> None:
    sb = await kit.pod()
    ct = await kit.running(sb)
    result = await kit.backend.exec.exec_sync(ct, ["echo", "ok"])
    assert (result.exit_code, result.stdout) == (0, b"ok\n")
    assert ("exec_create", ["echo", "ok"]) in kit.engine.calls


def test_the_shim_hands_the_cni_section_to_a_handler_on_cni(tmp_path: Path) -> None:
    text = (
        f'[server]\nstate_dir = "{tmp_path}"\n[handlers.docker]\npod_network = "cni"\n'
        f'[cni]\nconf_dir = "{tmp_path}/net.d"\nbin_dirs = ["/x"]\nplugin_timeout = 4\n'
    )
    backend = Server(parse(tomllib.loads(text)))._build_backends()["docker"]
    assert isinstance(backend, DockerBackend)
    cni = backend._shared.cni
    assert cni is not None and cni.adds
    settings = cni.network.client.settings
    assert (settings.conf_dir, settings.bin_dirs, settings.plugin_timeout) == (
        f"{tmp_path}/net.d",
        ("/x",),
        4.0,
    )
    assert settings.cache_dir == f"{tmp_path}/cni/docker"  # under the state dir, one cache per handler
    assert cni.pin_dir == f"{tmp_path}/backends/docker/netns"


async def test_pod_resources_are_the_kubelets_cgroup_and_need_one(kit: Kit) -> None:
    """UpdatePodSandboxResources: the engine has no pod-level object, so no engine call; a pod
    with a cgroup parent (the kubelet's pod cgroup, resized before the call) is accepted, one
    without has no pod-level cgroup at all and is refused."""
    req = pb.UpdatePodSandboxResourcesRequest(resources=pb.LinuxContainerResources(cpu_shares=512))
    kubelets = sandbox_record(linux=pb.LinuxPodSandboxConfig(cgroup_parent="/kubepods/burstable/pod1"))
    await kit.backend.lifecycle.run_sandbox(kubelets)
    before = len(kit.engine.calls)
    await kit.backend.resources.update_sandbox_resources(kubelets, req)
    assert len(kit.engine.calls) == before
    bare = await kit.pod()
    with pytest.raises(FailedPreconditionError, match="no cgroup_parent"):
        await kit.backend.resources.update_sandbox_resources(bare, req)


async def test_a_pod_in_its_own_user_namespace_is_refused_saying_why(short_tmp: str) -> None:
    """hostUsers: false on docker: Status says the handler has no user namespaces, and the pod is
    refused (INVALID_ARGUMENT) with the reason: the engine's userns-remap is daemon-wide."""
    engine = FakeEngine()
    engine.add_image(PAUSE)
    backend = DockerBackend("docker", engine=engine, pause_image=PAUSE, instance="logic-userns")
    server = Server(
        server_config(short_tmp, default_handler="docker"),
        backends={"docker": backend},
        id_factory=make_ids(),
    )
    await server.start()
    channel = grpc.aio.insecure_channel(f"unix://{short_tmp}/cri.sock")
    try:
        rt = api_pb2_grpc.RuntimeServiceStub(channel)
        status = await rt.Status(pb.StatusRequest())
        assert {h.name: h.features.user_namespaces for h in status.runtime_handlers} == {
            "": False,
            "docker": False,
        }
        cfg = sandbox_config()
        opts = cfg.linux.security_context.namespace_options.userns_options
        opts.mode = pb.POD
        opts.uids.add(container_id=0, host_id=65536, length=65536)
        opts.gids.add(container_id=0, host_id=65536, length=65536)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await rt.RunPodSandbox(pb.RunPodSandboxRequest(config=cfg))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = info.value.details() or ""
        assert "does not support user namespaces" in details and "daemon-wide" in details, details
        assert not engine.containers and not (await rt.ListPodSandbox(pb.ListPodSandboxRequest())).items
    finally:
        await channel.close()
        await server.stop(0)


@pytest.mark.parametrize(
    ("engine_driver", "parent", "refused"),
    [
        ("systemd", "kubepods-besteffort-pod1.slice", ""),
        ("systemd", "/kubepods/besteffort/pod1", "is not a systemd slice"),
        ("cgroupfs", "/kubepods/besteffort/pod1", ""),
        ("cgroupfs", "kubepods-besteffort-pod1.slice", "is a systemd slice name"),
    ],
    ids=["systemd-slice", "systemd-path", "cgroupfs-path", "cgroupfs-slice"],
)
async def test_cgroup_driver_is_the_engines_and_parents_must_match_it(
    engine_driver: str, parent: str, refused: str
) -> None:
    """RuntimeConfig reports the engine's driver (it reads the cgroup parents), whatever was
    configured; a cgroup parent in the other driver's form is refused before the engine sees it."""
    engine = FakeEngine()
    engine.info_answer["CgroupDriver"] = engine_driver
    other = "cgroupfs" if engine_driver == "systemd" else "systemd"
    engine.add_image(PAUSE)
    events = Events()
    backend = DockerBackend(
        "docker", engine=engine, pause_image=PAUSE, instance="logic-cg", cgroup_driver=other
    )
    await backend.lifecycle.start(events)
    try:
        want = pb.SYSTEMD if engine_driver == "systemd" else pb.CGROUPFS
        assert backend.lifecycle.runtime_config().linux.cgroup_driver == want
        sb = sandbox_record(linux=pb.LinuxPodSandboxConfig(cgroup_parent=parent))
        if refused:
            with pytest.raises(InvalidArgumentError, match=refused):
                await backend.lifecycle.run_sandbox(sb)
            assert not engine.containers
        else:
            await backend.lifecycle.run_sandbox(sb)
            (pause,) = engine.containers.values()
            assert pause.config["HostConfig"]["CgroupParent"] == parent
    finally:
        await events.close()
        await backend.lifecycle.close()


async def test_a_death_heard_during_the_start_is_reported(kit: Kit) -> None:
    """The container dies between the start's inspect (which says Running) and the moment the
    backend watches it: its die event, heard meanwhile, is not lost."""
    sb = await kit.pod()
    ct = container_record(sb, ["true"])
    await kit.backend.lifecycle.create_container(ct, sb)
    ct.committed = True
    eid = ct.backend_data["engine_id"]
    engine = kit.engine
    plain = engine.inspect_container

    async def inspect_then_die(engine_id: str) -> dict[str, Any]:
        info = await plain(engine_id)
        if engine_id == eid and info["State"]["Running"]:
            engine.exit(eid, 0)
            await asyncio.sleep(0.1)  # the event watcher hears the die before the start watches
        return info

    engine.inspect_container = inspect_then_die  # type: ignore[method-assign]
    await kit.events.start(kit.backend.lifecycle, ct, sb, Sink())
    engine.inspect_container = plain  # type: ignore[method-assign]
    info = await kit.events.exit_of(ct.id, timeout=5)
    assert info.exit_code == 0


async def test_a_pool_closed_while_the_engine_creates_an_item_leaves_no_container() -> None:
    """The engine finishes a create it has received even when the pool's refill is cancelled:
    the item it made must go with the pool, not stay behind as a created pause container."""
    from backends.docker.warm import PoolSettings

    class SlowCreate(FakeEngine):
        def __init__(self) -> None:
            super().__init__()
            self.creating = asyncio.Event()
            self.release = asyncio.Event()

        async def create_container(self, name: str, config: dict[str, Any]) -> str:
            self.creating.set()
            await asyncio.shield(self.release.wait())  # the engine does not stop when the caller does
            return await super().create_container(name, config)

    engine = SlowCreate()
    engine.add_image(PAUSE)
    events = Events()
    backend = DockerBackend(
        "docker", engine=engine, pause_image=PAUSE, instance="logic", pool=PoolSettings(size=1)
    )
    await backend.lifecycle.start(events)
    await asyncio.wait_for(engine.creating.wait(), 5)
    closing = asyncio.ensure_future(backend.lifecycle.close())
    await asyncio.sleep(0.05)
    engine.release.set()
    await asyncio.wait_for(closing, 5)
    await events.close()
    assert [c.name for c in engine.containers.values()] == []
