"""Hollow nodes: N isolated fake nodes in one process, each on its own socket."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator

import grpc
import pytest

from backends.fake import FakeBackend
from cri_api import api_pb2 as pb
from cri_api import api_pb2_grpc
from shim.config import Config, HandlerConfig, parse
from shim.hollow import Hollow, HollowError, node_config, plan, pod_cidrs
from tests.criutil import container_config, sandbox_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NODES = 3


class Node:
    def __init__(self, channel: grpc.aio.Channel, fake: FakeBackend, pod_cidr: str) -> None:
        self.channel = channel
        self.rt = api_pb2_grpc.RuntimeServiceStub(channel)
        self.im = api_pb2_grpc.ImageServiceStub(channel)
        self.fake = fake
        self.net = ipaddress.ip_network(pod_cidr)


@dataclasses.dataclass
class Hollowed:
    hollow: Hollow
    nodes: list[Node]


@pytest.fixture
async def hollowed(short_tmp: str) -> AsyncIterator[Hollowed]:
    specs = plan(NODES, f"{short_tmp}/n-{{i}}.sock", f"{short_tmp}/state", "10.{i}.0.0/16")
    hollow = Hollow(Config(), specs)
    await hollow.start()
    nodes = []
    for spec, server in zip(specs, hollow.servers, strict=True):
        assert server.shim is not None
        fake = server.shim.registry.get("fake")
        assert isinstance(fake, FakeBackend)
        nodes.append(Node(grpc.aio.insecure_channel(f"unix://{spec.socket}"), fake, spec.pod_cidr))
    try:
        yield Hollowed(hollow, nodes)
    finally:
        for n in nodes:
            await n.channel.close()
        await hollow.stop(0)


async def run_pod(rt: api_pb2_grpc.RuntimeServiceStub, name: str, uid: str) -> str:
    sc = sandbox_config(name=name, uid=uid)
    return (await rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id


async def test_each_node_answers_version_and_status(hollowed: Hollowed) -> None:
    for node in hollowed.nodes:
        v = await node.rt.Version(pb.VersionRequest())
        assert (v.runtime_name, v.runtime_api_version) == ("cri-shim", "v1")
        st = await node.rt.Status(pb.StatusRequest())
        assert {c.type: c.status for c in st.status.conditions} == {
            "RuntimeReady": True,
            "NetworkReady": True,
        }
    # A runtime made not ready on one node is not ready on that node only.
    hollowed.nodes[1].fake.runtime_ready = False
    ready = []
    for node in hollowed.nodes:
        st = await node.rt.Status(pb.StatusRequest())
        ready.append(next(c.status for c in st.status.conditions if c.type == "RuntimeReady"))
    assert ready == [True, False, True]


async def test_nodes_see_only_their_own_objects(hollowed: Hollowed) -> None:
    n0, n1, n2 = hollowed.nodes
    await n0.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox")))
    assert (await n0.im.ImageStatus(pb.ImageStatusRequest(image=pb.ImageSpec(image="busybox")))).image.id
    for other in (n1, n2):
        st = await other.im.ImageStatus(pb.ImageStatusRequest(image=pb.ImageSpec(image="busybox")))
        assert not st.image.id
        listed = await other.im.ListImages(pb.ListImagesRequest())
        assert not any("busybox" in t for img in listed.images for t in img.repo_tags)

    pod0 = await run_pod(n0.rt, "web", "uid-web")
    sc = sandbox_config(name="web", uid="uid-web")
    cc = container_config()
    cid = (
        await n0.rt.CreateContainer(
            pb.CreateContainerRequest(pod_sandbox_id=pod0, config=cc, sandbox_config=sc)
        )
    ).container_id
    await n0.rt.StartContainer(pb.StartContainerRequest(container_id=cid))

    for other in (n1, n2):
        assert not (await other.rt.ListPodSandbox(pb.ListPodSandboxRequest())).items
        assert not (await other.rt.ListContainers(pb.ListContainersRequest())).containers
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await other.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod0))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await other.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        # The image is not there: a container of it cannot be created.
        pod = await run_pod(other.rt, "web", "uid-web")  # the same name and UID: no ALREADY_EXISTS
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await other.rt.CreateContainer(
                pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
            )
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

    # Each node lists its own pod only, its IP from its own range.
    ips = []
    for node in hollowed.nodes:
        items = (await node.rt.ListPodSandbox(pb.ListPodSandboxRequest())).items
        assert len(items) == 1 and items[0].metadata.name == "web"
        st = await node.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=items[0].id))
        ips.append(st.status.network.ip)
        assert ipaddress.ip_address(st.status.network.ip) in node.net
    assert len(set(ips)) == NODES
    counts = [len((await n.rt.ListContainers(pb.ListContainersRequest())).containers) for n in hollowed.nodes]
    assert counts == [1, 0, 0]
    # Each backend recorded its own calls only.
    assert [len(n.fake.calls_to("run_sandbox")) for n in hollowed.nodes] == [1, 1, 1]
    assert [len(n.fake.calls_to("start_container")) for n in hollowed.nodes] == [1, 0, 0]
    assert [len(n.fake.pulls) for n in hollowed.nodes] == [1, 0, 0]


async def test_stop_removes_every_socket_and_a_restart_recovers_each_node(short_tmp: str) -> None:
    specs = plan(NODES, f"{short_tmp}/n-{{i}}.sock", f"{short_tmp}/state", "10.0.0.0/8")
    hollow = Hollow(Config(), specs)
    await hollow.start()
    assert all(os.path.exists(s.socket) for s in specs)
    assert all(os.path.isdir(s.state_dir) for s in specs)
    async with grpc.aio.insecure_channel(f"unix://{specs[1].socket}") as ch:
        pod = await run_pod(api_pb2_grpc.RuntimeServiceStub(ch), "kept", "uid-kept")
    await hollow.stop(0)
    assert not any(os.path.exists(s.socket) for s in specs)

    again = Hollow(Config(), specs)
    await again.start()
    try:
        for i, spec in enumerate(specs):
            async with grpc.aio.insecure_channel(f"unix://{spec.socket}") as ch:
                rt = api_pb2_grpc.RuntimeServiceStub(ch)
                items = (await rt.ListPodSandbox(pb.ListPodSandboxRequest())).items
                assert [p.id for p in items] == ([pod] if i == 1 else [])
    finally:
        await again.stop(0)


async def test_a_node_that_cannot_start_stops_the_others(short_tmp: str) -> None:
    specs = plan(NODES, f"{short_tmp}/n-{{i}}.sock", f"{short_tmp}/state", "10.0.0.0/8")
    busy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    os.makedirs(short_tmp, exist_ok=True)
    busy.bind(specs[1].socket)
    busy.listen()
    try:
        hollow = Hollow(Config(), specs)
        with pytest.raises(HollowError, match=r"node 1 .*another server is listening"):
            await hollow.start()
        assert not os.path.exists(specs[0].socket)  # node 0 was started, then stopped
        assert os.path.exists(specs[1].socket)  # the other server's socket is left alone
        assert not os.path.exists(specs[2].socket)  # never started
    finally:
        busy.close()


def test_pod_ranges() -> None:
    assert pod_cidrs("10.{i}.0.0/16", 3) == ["10.0.0.0/16", "10.1.0.0/16", "10.2.0.0/16"]
    assert pod_cidrs("10.0.0.0/8", 3) == ["10.0.0.0/10", "10.64.0.0/10", "10.128.0.0/10"]
    assert pod_cidrs("10.0.0.0/8", 100)[99] == "10.198.0.0/15"
    assert pod_cidrs("fd00::/48", 2) == ["fd00::/49", "fd00:0:0:8000::/49"]
    with pytest.raises(HollowError, match="node 256"):
        pod_cidrs("10.{i}.0.0/16", 300)
    with pytest.raises(HollowError, match="overlaps"):
        pod_cidrs("10.0.0.0/1{i}", 2)
    with pytest.raises(HollowError, match="too small"):
        pod_cidrs("10.0.0.0/24", 100)


def test_node_config(short_tmp: str) -> None:
    base = parse(
        {
            "streaming": {"port": 20000},
            "handlers": {
                "fake": {"type": "fake", "state_dir": "/shared", "pull_seconds": 0},
                "fake2": {"type": "fake", "max_calls": 5},
            },
        }
    )
    spec = plan(3, f"{short_tmp}/n-{{i}}.sock", f"{short_tmp}/state", "10.{i}.0.0/16")[2]
    cfg = node_config(base, spec)
    assert cfg.server.listen == f"unix://{short_tmp}/n-2.sock"
    assert cfg.server.state_dir == f"{short_tmp}/state/node-2"
    assert cfg.streaming.port == 20002
    assert cfg.handlers["fake"].options == {"pull_seconds": 0, "pod_cidr": "10.2.0.0/17", "max_calls": 1000}
    assert cfg.handlers["fake2"].options == {"max_calls": 5, "pod_cidr": "10.2.128.0/17"}
    assert not cfg.nri.enable  # one shared NRI socket would be node 0's alone
    per_node = dataclasses.replace(
        base, nri=dataclasses.replace(base.nri, socket_path=f"{short_tmp}/nri-{{i}}.sock")
    )
    assert node_config(per_node, spec).nri.enable
    assert node_config(per_node, spec).nri.socket_path == f"{short_tmp}/nri-2.sock"
    docker = dataclasses.replace(base, handlers={"docker": HandlerConfig("docker", "docker", {})})
    with pytest.raises(HollowError, match="fake handlers only"):
        Hollow(docker, [spec])
    with pytest.raises(HollowError, match="must contain"):
        plan(2, f"{short_tmp}/n.sock", short_tmp, "10.0.0.0/8")


async def wait_serving(path: str, proc: subprocess.Popen[bytes]) -> None:
    async with grpc.aio.insecure_channel(f"unix://{path}") as ch:
        rt = api_pb2_grpc.RuntimeServiceStub(ch)
        for _ in range(100):
            assert proc.poll() is None, "cri-shim hollow exited early"
            try:
                await rt.Version(pb.VersionRequest(), timeout=0.5)
                return
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.05)
    raise AssertionError(f"{path} never answered")


async def test_cli_serves_until_sigterm(short_tmp: str) -> None:
    cmd = [sys.executable, "-m", "shim.cli", "hollow", "--nodes", "2", "--log-level", "warning"]
    cmd += ["--socket-template", f"{short_tmp}/n-{{i}}.sock", "--state-root", f"{short_tmp}/state"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE)
    try:
        for i in range(2):
            await wait_serving(f"{short_tmp}/n-{i}.sock", proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()
    assert not any(name.endswith(".sock") for name in os.listdir(short_tmp))

    bad = subprocess.run(
        [*cmd[:4], "--nodes", "2", "--socket-template", f"{short_tmp}/n.sock"],
        cwd=ROOT,
        capture_output=True,
        timeout=30,
    )
    assert bad.returncode == 2
    assert b"must contain {i}" in bad.stderr

    busy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    busy.bind(f"{short_tmp}/n-1.sock")
    busy.listen()
    try:
        failed = subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=30)
    finally:
        busy.close()
    assert failed.returncode == 1
    assert b"node 1 (" in failed.stderr and b"another server is listening" in failed.stderr
    assert not os.path.exists(f"{short_tmp}/n-0.sock")
