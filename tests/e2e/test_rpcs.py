"""Every RPC of both services through a real socket and the generated stubs, with exact codes."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from backends.fake import FakeBackend
from cri_api import api_pb2 as pb
from cri_api import api_pb2_grpc
from shim.server import Server
from tests.conftest import Running, make_ids, server_config
from tests.criutil import container_config, sandbox_config

RUNTIME_RPCS = {m.name for m in pb.DESCRIPTOR.services_by_name["RuntimeService"].methods}
IMAGE_RPCS = {m.name for m in pb.DESCRIPTOR.services_by_name["ImageService"].methods}


async def code_of(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value.code()


async def pod_with_container(r: Running, tmp: str, command: list[str] | None = None) -> tuple[str, str]:
    await r.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox")))
    sc = sandbox_config(log_directory=os.path.join(tmp, "logs"))
    pod = (await r.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
    cc = container_config(command=command, log_path="c.log")
    cid = (
        await r.rt.CreateContainer(
            pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
        )
    ).container_id
    return pod, cid


async def test_version(running: Running) -> None:
    v = await running.rt.Version(pb.VersionRequest())
    assert (v.runtime_name, v.runtime_api_version) == ("cri-shim", "v1")
    assert v.runtime_version


async def test_status_and_runtime_config(running: Running) -> None:
    st = await running.rt.Status(pb.StatusRequest(verbose=True))
    conds = {c.type: c.status for c in st.status.conditions}
    assert conds == {"RuntimeReady": True, "NetworkReady": True}
    assert {h.name for h in st.runtime_handlers} == {"", "fake"}
    assert not st.features.supplemental_groups_policy  # the fake does not honour Strict
    assert "config" in st.info
    running.fake.runtime_ready = False
    st = await running.rt.Status(pb.StatusRequest())
    ready = next(c for c in st.status.conditions if c.type == "RuntimeReady")
    assert not ready.status and ready.reason
    rc = await running.rt.RuntimeConfig(pb.RuntimeConfigRequest())
    assert rc.linux.cgroup_driver == pb.CGROUPFS


async def test_update_runtime_config_keeps_pod_cidr(running: Running) -> None:
    req = pb.UpdateRuntimeConfigRequest()
    req.runtime_config.network_config.pod_cidr = "10.244.1.0/24"
    await running.rt.UpdateRuntimeConfig(req)
    st = await running.rt.Status(pb.StatusRequest(verbose=True))
    assert "10.244.1.0/24" in st.info["config"]
    # The fake allocates pod addresses itself: new pods take them from the kubelet's range.
    pod = await running.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sandbox_config(name="in-range")))
    status = await running.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod.pod_sandbox_id))
    assert status.status.network.ip.startswith("10.244.1.")
    assert ("set_pod_cidr", ("10.244.1.0/24",)) in [(c.method, c.args) for c in running.fake.calls]
    for bad in ("10.244.1.0/99", "10.244.1.0/24,fd00::/999"):
        req.runtime_config.network_config.pod_cidr = bad
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await running.rt.UpdateRuntimeConfig(req)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a CIDR" in (
            info.value.details() or ""
        )
    # A dual-stack node's CIDRs, comma-separated as the kubelet sends them.
    req.runtime_config.network_config.pod_cidr = "10.244.2.0/24,fd00:1::/64"
    await running.rt.UpdateRuntimeConfig(req)
    st = await running.rt.Status(pb.StatusRequest(verbose=True))
    assert "10.244.2.0/24,fd00:1::/64" in st.info["config"]


async def _subscribers_become(running: Running, n: int) -> int:
    """The event hub's subscriber count once it is ``n``, or as it is after about 5 s."""
    assert running.server.shim is not None
    hub = running.server.shim.events
    for _ in range(500):
        if hub.subscriber_count == n:
            break
        await asyncio.sleep(0.01)
    return hub.subscriber_count


async def test_a_cancelled_event_stream_ends_its_subscription(running: Running) -> None:
    call = running.rt.GetContainerEvents(pb.GetEventsRequest())
    assert await _subscribers_become(running, 1) == 1
    call.cancel()
    assert await _subscribers_become(running, 0) == 0


async def test_full_lifecycle_and_events(running: Running, short_tmp: str) -> None:
    r = running
    events = r.rt.GetContainerEvents(pb.GetEventsRequest())
    got: list[pb.ContainerEventResponse] = []

    async def collect() -> None:
        async for e in events:
            got.append(e)

    task = asyncio.create_task(collect())
    await asyncio.sleep(0.05)
    pod, cid = await pod_with_container(r, short_tmp, ["sh", "-c", "echo hi; sleep 60"])
    await r.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    st = (await r.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))).status
    assert st.state == pb.CONTAINER_RUNNING
    assert st.started_at >= st.created_at > 10**18  # nanoseconds since the epoch
    assert st.log_path == os.path.join(short_tmp, "logs", "c.log")
    assert st.image_ref == st.image_id and st.image_ref.startswith("sha256:")
    images = await r.im.ListImages(pb.ListImagesRequest())
    assert st.image_ref in {i.id for i in images.images}
    await r.rt.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=5))
    st = (await r.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))).status
    assert st.state == pb.CONTAINER_EXITED and st.finished_at >= st.started_at
    await r.rt.RemoveContainer(pb.RemoveContainerRequest(container_id=cid))
    await r.rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod))
    sst = (await r.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod))).status
    assert sst.state == pb.SANDBOX_NOTREADY
    await r.rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod))
    await asyncio.sleep(0.1)
    task.cancel()
    kinds = [e.container_event_type for e in got if e.container_id == cid]
    assert kinds == [
        pb.CONTAINER_CREATED_EVENT,
        pb.CONTAINER_STARTED_EVENT,
        pb.CONTAINER_STOPPED_EVENT,
        pb.CONTAINER_DELETED_EVENT,
    ]
    with open(os.path.join(short_tmp, "logs", "c.log")) as f:
        line = f.readline()
    assert line.endswith(" stdout F hi\n")


async def test_unknown_ids(running: Running) -> None:
    r = running
    missing = "f" * 64
    # Stop and Remove are idempotent by the CRI ...
    await r.rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=missing))
    await r.rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=missing))
    await r.rt.StopContainer(pb.StopContainerRequest(container_id=missing))
    await r.rt.RemoveContainer(pb.RemoveContainerRequest(container_id=missing))
    await r.im.RemoveImage(pb.RemoveImageRequest(image=pb.ImageSpec(image="never/pulled:1")))
    # ... while status of an unknown ID is NOT_FOUND.
    nf = grpc.StatusCode.NOT_FOUND
    assert await code_of(r.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=missing))) == nf
    assert await code_of(r.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=missing))) == nf
    assert await code_of(r.rt.StartContainer(pb.StartContainerRequest(container_id=missing))) == nf
    assert await code_of(r.rt.ContainerStats(pb.ContainerStatsRequest(container_id=missing))) == nf
    assert await code_of(r.rt.PodSandboxStats(pb.PodSandboxStatsRequest(pod_sandbox_id=missing))) == nf
    assert await code_of(r.rt.ExecSync(pb.ExecSyncRequest(container_id=missing, cmd=["true"]))) == nf
    assert await code_of(r.rt.ReopenContainerLog(pb.ReopenContainerLogRequest(container_id=missing))) == nf
    img = await r.im.ImageStatus(pb.ImageStatusRequest(image=pb.ImageSpec(image="never/pulled:1")))
    assert not img.HasField("image")


async def test_exec_sync(running: Running, short_tmp: str) -> None:
    r = running
    _, cid = await pod_with_container(r, short_tmp)
    await r.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    out = await r.rt.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["echo", "hello", "world"]))
    assert (out.stdout, out.exit_code) == (b"hello world\n", 0)
    out = await r.rt.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["sh", "-c", "exit 7"]))
    assert out.exit_code == 7
    out = await r.rt.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["nonesuch"]))
    assert out.exit_code == 127 and b"not found" in out.stderr
    code = await code_of(r.rt.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["sleep", "5"], timeout=1)))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_streaming_urls(running: Running, short_tmp: str) -> None:
    r = running
    pod, cid = await pod_with_container(r, short_tmp)
    await r.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    url = (await r.rt.Exec(pb.ExecRequest(container_id=cid, cmd=["sh"], stdout=True))).url
    assert url.startswith("http://127.0.0.1:") and "/exec/" in url
    url = (await r.rt.Attach(pb.AttachRequest(container_id=cid, stdout=True))).url
    assert "/attach/" in url
    url = (await r.rt.PortForward(pb.PortForwardRequest(pod_sandbox_id=pod, port=[80]))).url
    assert "/portforward/" in url
    bad = pb.ExecRequest(container_id=cid, cmd=["sh"])
    assert await code_of(r.rt.Exec(bad)) == grpc.StatusCode.INVALID_ARGUMENT


async def test_stats_and_updates(running: Running, short_tmp: str) -> None:
    r = running
    pod, cid = await pod_with_container(r, short_tmp)
    await r.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    st = (await r.rt.ContainerStats(pb.ContainerStatsRequest(container_id=cid))).stats
    assert st.attributes.id == cid and st.memory.working_set_bytes.value > 0
    lst = await r.rt.ListContainerStats(pb.ListContainerStatsRequest())
    assert [s.attributes.id for s in lst.stats] == [cid]
    ps = (await r.rt.PodSandboxStats(pb.PodSandboxStatsRequest(pod_sandbox_id=pod))).stats
    assert ps.attributes.id == pod and len(ps.linux.containers) == 1
    lps = await r.rt.ListPodSandboxStats(pb.ListPodSandboxStatsRequest())
    assert [s.attributes.id for s in lps.stats] == [pod]
    upd = pb.UpdateContainerResourcesRequest(container_id=cid)
    upd.linux.memory_limit_in_bytes = 64 << 20
    await r.rt.UpdateContainerResources(upd)
    st2 = (await r.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))).status
    assert st2.resources.linux.memory_limit_in_bytes == 64 << 20
    pod_upd = pb.UpdatePodSandboxResourcesRequest(pod_sandbox_id=pod)
    pod_upd.resources.memory_limit_in_bytes = 128 << 20
    await r.rt.UpdatePodSandboxResources(pod_upd)  # the fake records it (tests/e2e/test_pod_resources.py)
    await r.rt.ReopenContainerLog(pb.ReopenContainerLogRequest(container_id=cid))
    fs = await r.im.ImageFsInfo(pb.ImageFsInfoRequest())
    assert fs.image_filesystems[0].used_bytes.value > 0


async def test_capability_refusals(running: Running, short_tmp: str) -> None:
    r = running
    await pod_with_container(r, short_tmp)
    un = grpc.StatusCode.UNIMPLEMENTED
    assert await code_of(r.rt.ListMetricDescriptors(pb.ListMetricDescriptorsRequest())) == un
    # Metrics of sandboxes: no backend exports any, so the answer is empty, not an error.
    assert len((await r.rt.ListPodSandboxMetrics(pb.ListPodSandboxMetricsRequest())).pod_metrics) == 0


async def test_stream_twins_match_lists(running: Running, short_tmp: str) -> None:
    r = running
    for i in range(3):
        await pod_with_container(r, short_tmp + f"/{i}")
    listed = await r.rt.ListContainers(pb.ListContainersRequest())
    streamed = [
        c async for resp in r.rt.StreamContainers(pb.StreamContainersRequest()) for c in resp.containers
    ]
    assert [c.id for c in streamed] == [c.id for c in listed.containers]
    pods = [
        p
        async for resp in r.rt.StreamPodSandboxes(pb.StreamPodSandboxesRequest())
        for p in resp.pod_sandboxes
    ]
    assert len(pods) == 3
    imgs = [i async for resp in r.im.StreamImages(pb.StreamImagesRequest()) for i in resp.images]
    assert {i.id for i in imgs} == {i.id for i in (await r.im.ListImages(pb.ListImagesRequest())).images}
    stats = [
        s
        async for resp in r.rt.StreamContainerStats(pb.StreamContainerStatsRequest())
        for s in resp.container_stats
    ]
    assert len(stats) == 3
    sbstats = [
        s
        async for resp in r.rt.StreamPodSandboxStats(pb.StreamPodSandboxStatsRequest())
        for s in resp.pod_sandbox_stats
    ]
    assert len(sbstats) == 3
    metrics = [
        m
        async for resp in r.rt.StreamPodSandboxMetrics(pb.StreamPodSandboxMetricsRequest())
        for m in resp.pod_sandbox_metrics
    ]
    assert metrics == []


def test_every_rpc_is_tested_here() -> None:
    with open(__file__) as f:
        src = f.read()
    untested = sorted(n for n in RUNTIME_RPCS | IMAGE_RPCS if f".{n}(" not in src)
    assert untested == []


async def test_health_service(running: Running) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(running.channel)
    resp = await stub.Check(health_pb2.HealthCheckRequest(service="runtime.v1.RuntimeService"))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_list_filters(running: Running, short_tmp: str) -> None:
    r = running
    await r.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox")))
    pods = []
    for i in range(3):
        sc = sandbox_config(name=f"p{i}", labels={"app": "a" if i < 2 else "b"})
        pods.append((await r.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id)
    await r.rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pods[0]))

    async def ids(**f: object) -> list[str]:
        resp = await r.rt.ListPodSandbox(pb.ListPodSandboxRequest(filter=pb.PodSandboxFilter(**f)))
        return sorted(p.id for p in resp.items)

    assert await ids() == sorted(pods)
    assert await ids(id=pods[1][:12]) == [pods[1]]
    assert await ids(label_selector={"app": "a"}) == sorted(pods[:2])
    assert await ids(state=pb.PodSandboxStateValue(state=pb.SANDBOX_READY)) == sorted(pods[1:])
    assert await ids(
        state=pb.PodSandboxStateValue(state=pb.SANDBOX_NOTREADY), label_selector={"app": "a"}
    ) == [pods[0]]
    assert await ids(id="0" * 64) == []


async def test_image_fs_info_names_the_default_handlers_stores_first(short_tmp: str) -> None:
    """The kubelet reads entry 0 of each list: the default handler's, at a directory that exists."""
    backends = {name: FakeBackend(name, {"state_dir": os.path.join(short_tmp, name)}) for name in ("a", "b")}
    backends["memory"] = FakeBackend("memory", {})  # keeps nothing on disk: no entry
    cfg = server_config(short_tmp, default_handler="b")
    server = Server(cfg, backends=backends, id_factory=make_ids())
    await server.start()
    channel = grpc.aio.insecure_channel(f"unix://{short_tmp}/cri.sock")
    try:
        fs = await api_pb2_grpc.ImageServiceStub(channel).ImageFsInfo(pb.ImageFsInfoRequest())
    finally:
        await channel.close()
        await server.stop(0)
    want = [os.path.join(short_tmp, "b"), os.path.join(short_tmp, "a")]
    assert [f.fs_id.mountpoint for f in fs.image_filesystems] == want
    # Each fake's simulated writable layers are a store of their own, beside its images.
    assert [f.fs_id.mountpoint for f in fs.container_filesystems] == [
        os.path.join(w, "containers") for w in want
    ]
    assert all(os.path.isdir(f.fs_id.mountpoint) for f in (*fs.image_filesystems, *fs.container_filesystems))


async def test_a_container_created_from_an_image_id_shows_the_image_by_name(
    running: Running, short_tmp: str
) -> None:
    """The kubelet creates from the pulled image's ID and shows ContainerStatus.image.image as the pod's
    image: the name the pod spec gave (user_specified_image), else the image's tag, never the ID."""
    r = running
    image_id = (await r.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox")))).image_ref
    sc = sandbox_config(log_directory=os.path.join(short_tmp, "logs"))
    pod = (await r.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
    shown = []
    for i, spec in enumerate(
        [
            pb.ImageSpec(image=image_id, user_specified_image="docker.io/library/busybox:latest"),
            pb.ImageSpec(image=image_id),  # a kubelet before v1.30, crictl
            pb.ImageSpec(image=image_id.removeprefix("sha256:")),
        ]
    ):
        cc = container_config(name=f"c{i}", log_path=f"c{i}.log")
        cc.image.CopyFrom(spec)
        req = pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
        cid = (await r.rt.CreateContainer(req)).container_id
        st = (await r.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))).status
        assert st.image_ref == image_id
        shown.append(st.image.image)
        listed = (await r.rt.ListContainers(pb.ListContainersRequest())).containers
        assert {c.image.image for c in listed if c.id == cid} == {st.image.image}
    assert shown == ["docker.io/library/busybox:latest"] * 3


async def test_checkpoint_and_restore_a_pod(running: Running, short_tmp: str) -> None:
    """The fake checkpoints (tests/shim/test_checkpoint_service.py): the three RPCs over gRPC."""
    r = running
    pod, cid = await pod_with_container(r, short_tmp, ["sleep", "1000"])
    bad = pb.CheckpointContainerRequest(container_id=cid, location="relative.tar")
    assert await code_of(r.rt.CheckpointContainer(bad)) == grpc.StatusCode.INVALID_ARGUMENT
    not_running = pb.CheckpointContainerRequest(container_id=cid, location=os.path.join(short_tmp, "c.tar"))
    assert await code_of(r.rt.CheckpointContainer(not_running)) == grpc.StatusCode.FAILED_PRECONDITION
    await r.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    await r.rt.CheckpointContainer(not_running)
    assert os.path.getsize(os.path.join(short_tmp, "c.tar")) > 0
    out = os.path.join(short_tmp, "pod")
    os.mkdir(out)
    req = pb.CheckpointPodRequest(pod_sandbox_id=pod, output_path=out, container_ids=[cid])
    await r.rt.CheckpointPod(req, timeout=30)
    sc = sandbox_config(name="restored", log_directory=os.path.join(short_tmp, "logs2"))
    cc = container_config(command=["sleep", "1000"], log_path="c.log")
    restored = await r.rt.RestorePod(
        pb.RestorePodRequest(checkpoint_path=out, config=sc, container_configs=[cc]), timeout=30
    )
    (one,) = restored.restored_containers
    assert one.name == cc.metadata.name and one.container_id != cid
    status = await r.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=one.container_id))
    assert status.status.state == pb.CONTAINER_CREATED
    await r.rt.StartContainer(pb.StartContainerRequest(container_id=one.container_id))
