"""The services over the fake backend, in process: scripting, injection, spying, events."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from backends.fake import PROGRAM_ANNOTATION, FakeBackend
from cri_api import api_pb2 as pb
from shim.cri.errors import UnavailableError
from shim.cri.events import EventHub
from tests.conftest import Running, make_ids, server_config
from tests.criutil import container_config, sandbox_config


class Clock:
    def __init__(self) -> None:
        self.now = 1_600_000_000_000_000_000

    def __call__(self) -> int:
        self.now += 1000
        return self.now


@pytest.fixture
async def scripted(short_tmp: str) -> AsyncIterator[Running]:
    from shim.server import Server

    clock = Clock()
    fake = FakeBackend(
        "fake",
        {
            "state_dir": os.path.join(short_tmp, "fake"),
            "exec": [{"cmd": ["cat", "/etc/hostname"], "stdout": "scripted\n", "exit_code": 0}],
            "images": {"example.com/app": {"uid": 1001, "username": "app", "size": 12345}},
            "missing_images": ["example.com/missing*"],
            "latency": {"image_fs_info": 0.2},
        },
        clock=clock,
    )
    server = Server(server_config(short_tmp), backends={"fake": fake}, clock=clock, id_factory=make_ids("s"))
    await server.start()
    channel = grpc.aio.insecure_channel(f"unix://{short_tmp}/cri.sock")
    try:
        yield Running(server, channel, fake)
    finally:
        await channel.close()
        await server.stop(0)


async def make(r: Running, tmp: str, **ckw: object) -> str:
    await r.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox")))
    sc = sandbox_config(log_directory=os.path.join(tmp, "logs"))
    pod = (await r.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
    cc = container_config(log_path="c.log", **ckw)  # type: ignore[arg-type]
    req = pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
    return (await r.rt.CreateContainer(req)).container_id


async def test_deterministic_ids_and_clock(scripted: Running, short_tmp: str) -> None:
    import hashlib

    cid = await make(scripted, short_tmp)
    st = (await scripted.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))).status
    assert st.created_at % 1000 == 0 and 1_600_000_000_000_000_000 < st.created_at < 1_600_000_000_100_000_000
    assert cid == hashlib.sha256(b"s-2").hexdigest()  # the pod took s-1


async def test_polled_queries_are_answered_without_waiting(scripted: Running, short_tmp: str) -> None:
    """The kubelet's per-object polls settle inside ``begin``: no coroutine, so the native
    transport answers them without a task (found and missing objects alike, verbose too)."""
    from shim.cri.codes import Code
    from shim.cri.servicer import CriServicer

    cid = await make(scripted, short_tmp)
    sandbox_id = (await scripted.rt.ListPodSandbox(pb.ListPodSandboxRequest())).items[0].id
    servicer = CriServicer(scripted.server.shim)
    rpcs = {rpc.name: rpc for rpc in servicer.runtime_rpcs}
    cases = [
        ("ContainerStatus", pb.ContainerStatusRequest(container_id=cid), Code.OK),
        ("ContainerStatus", pb.ContainerStatusRequest(container_id=cid, verbose=True), Code.OK),
        ("ContainerStatus", pb.ContainerStatusRequest(container_id="f" * 64), Code.NOT_FOUND),
        ("PodSandboxStatus", pb.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id), Code.OK),
        ("PodSandboxStatus", pb.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=True), Code.OK),
        ("PodSandboxStatus", pb.PodSandboxStatusRequest(pod_sandbox_id="f" * 64), Code.NOT_FOUND),
        ("Version", pb.VersionRequest(), Code.OK),
    ]
    for name, req, want in cases:
        outcome = servicer.begin(rpcs[name], req)
        assert isinstance(outcome, tuple), name
        assert outcome[0] == want, (name, outcome)


async def test_program_output_over_time_and_exit(scripted: Running, short_tmp: str) -> None:
    prog = {
        "output": ["first", {"after": 0.2, "stream": "stderr", "line": "later"}],
        "exit_code": 4,
        "exit_after": 0.3,
    }
    cid = await make(scripted, short_tmp, annotations={PROGRAM_ANNOTATION: json.dumps(prog)})
    await scripted.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    st = (await scripted.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))).status
    assert st.state == pb.CONTAINER_RUNNING
    await asyncio.sleep(0.5)
    st = (await scripted.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))).status
    assert (st.state, st.exit_code, st.reason) == (pb.CONTAINER_EXITED, 4, "Error")
    with open(os.path.join(short_tmp, "logs", "c.log")) as f:
        lines = f.read().splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == ["stdout F first", "stderr F later"]


async def test_bad_program_annotation_fails_create(scripted: Running, short_tmp: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await make(scripted, short_tmp, annotations={PROGRAM_ANNOTATION: "{nope"})
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert PROGRAM_ANNOTATION in (info.value.details() or "")


async def test_stop_honours_timeout(scripted: Running, short_tmp: str) -> None:
    prog = {"ignore_sigterm": True}
    cid = await make(scripted, short_tmp, annotations={PROGRAM_ANNOTATION: json.dumps(prog)})
    await scripted.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    t0 = time.monotonic()
    await scripted.rt.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=1))
    assert time.monotonic() - t0 >= 0.9
    st = (await scripted.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))).status
    assert (st.state, st.exit_code) == (pb.CONTAINER_EXITED, 137)


async def test_stop_of_a_slow_container_does_not_block_others(scripted: Running, short_tmp: str) -> None:
    cid = await make(scripted, short_tmp, annotations={PROGRAM_ANNOTATION: '{"ignore_sigterm": true}'})
    await scripted.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    stop = asyncio.ensure_future(
        scripted.rt.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=2))
    )
    await asyncio.sleep(0.1)
    t0 = time.monotonic()
    await scripted.rt.ListContainers(pb.ListContainersRequest())
    await scripted.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))
    assert time.monotonic() - t0 < 0.5
    await stop


async def test_exec_rules_and_builtins(scripted: Running, short_tmp: str) -> None:
    cid = await make(scripted, short_tmp)
    await scripted.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    out = await scripted.rt.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["cat", "/etc/hostname"]))
    assert out.stdout == b"scripted\n"
    out = await scripted.rt.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["ls", "/etc"]))
    assert out.stdout.split() == [b"group", b"hostname", b"hosts", b"passwd", b"resolv.conf"]
    out = await scripted.rt.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["nginx", "-t"]))
    assert out.exit_code == 127 and out.stderr == b"sh: nginx: not found\n"


async def test_images_rules_auth_and_missing(scripted: Running) -> None:
    r = scripted
    auth = pb.AuthConfig(username="u", password="p")
    ref = (
        await r.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="example.com/app:1"), auth=auth))
    ).image_ref
    assert r.fake.pulls[-1] == ("example.com/app:1", auth)
    st = (await r.im.ImageStatus(pb.ImageStatusRequest(image=pb.ImageSpec(image="example.com/app:1")))).image
    assert (st.id, st.uid.value, st.username, st.size) == (ref, 1001, "app", 12345)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await r.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="example.com/missing:1")))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    # The pause image is pinned.
    images = (await r.im.ListImages(pb.ListImagesRequest())).images
    assert [
        i.pinned for i in images if "registry.k8s.io/pause:3.10" in i.repo_tags
    ] == []  # not configured here


async def test_injected_errors_are_fifo_then_succeed(scripted: Running) -> None:
    r = scripted
    r.fake.inject_error("run_sandbox", UnavailableError("first"))
    r.fake.inject_error("run_sandbox", UnavailableError("second"))
    sc = sandbox_config()
    for expected in ("first", "second"):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await r.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))
        assert info.value.details() == expected
    await r.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))
    calls = r.fake.calls_to("run_sandbox")
    assert len(calls) == 3 and all(len(c.args[0]) == 64 for c in calls)


async def test_injected_latency_does_not_block_other_rpcs(scripted: Running) -> None:
    slow = asyncio.ensure_future(scripted.im.ImageFsInfo(pb.ImageFsInfoRequest()))
    await asyncio.sleep(0.02)
    t0 = time.monotonic()
    await scripted.rt.Version(pb.VersionRequest())
    assert time.monotonic() - t0 < 0.15
    await slow


async def test_stats_grow(scripted: Running, short_tmp: str) -> None:
    cid = await make(scripted, short_tmp)
    await scripted.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    a = (await scripted.rt.ContainerStats(pb.ContainerStatsRequest(container_id=cid))).stats
    await asyncio.sleep(0.3)
    b = (await scripted.rt.ContainerStats(pb.ContainerStatsRequest(container_id=cid))).stats
    assert b.cpu.usage_core_nano_seconds.value > a.cpu.usage_core_nano_seconds.value
    assert b.memory.working_set_bytes.value >= a.memory.working_set_bytes.value > 0


async def test_slow_event_subscriber_never_blocks() -> None:
    hub = EventHub(queue_size=4)
    slow = hub.subscribe()
    fast = hub.subscribe()
    first = [asyncio.ensure_future(g.__anext__()) for g in (slow, fast)]
    await asyncio.sleep(0)  # both are subscribed and waiting
    assert hub.subscriber_count == 2
    hub.publish(pb.ContainerEventResponse(container_id="a"))
    assert [(await f).container_id for f in first] == ["a", "a"]
    # Nobody reads now: publishing never waits, and each reader keeps the newest events.
    for i in range(100):
        hub.publish(pb.ContainerEventResponse(container_id=str(i)))
    for g in (slow, fast):
        assert [(await g.__anext__()).container_id for _ in range(4)] == ["96", "97", "98", "99"]
    await slow.aclose()
    await fast.aclose()
    assert hub.subscriber_count == 0


async def test_exit_during_start_is_recorded_after_it(scripted: Running, short_tmp: str) -> None:
    from backends.contract import ExitInfo

    fake = scripted.fake
    original = fake.lifecycle.start_container

    async def start_then_die(container, sandbox):  # type: ignore[no-untyped-def]
        started = await original(container, sandbox)
        started.process.end()  # all its output written
        started.process.exit.set(ExitInfo(exit_code=5, finished_at=started.started_at + 1))
        return started

    fake.lifecycle.start_container = start_then_die  # type: ignore[method-assign]
    events = scripted.rt.GetContainerEvents(pb.GetEventsRequest())
    got: list[int] = []

    async def collect() -> None:
        async for e in events:
            got.append(e.container_event_type)

    task = asyncio.create_task(collect())
    await asyncio.sleep(0.05)
    cid = await make(scripted, short_tmp)
    await scripted.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    st = (await scripted.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))).status
    assert (st.state, st.exit_code) == (pb.CONTAINER_EXITED, 5)
    assert 0 < st.started_at <= st.finished_at
    await asyncio.sleep(0.05)
    task.cancel()
    assert got == [pb.CONTAINER_CREATED_EVENT, pb.CONTAINER_STARTED_EVENT, pb.CONTAINER_STOPPED_EVENT]
