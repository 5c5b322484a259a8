"""Restarts: a graceful one, and SIGKILL of the real `cri-shim serve` process."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
from typing import Any

import grpc

from backends.fake import FakeBackend
from backends.fake.lifecycle import Running
from backends.fake.program import Program
from cri_api import api_pb2 as pb
from cri_api import api_pb2_grpc
from shim.server import Server
from tests.conftest import make_ids, server_config
from tests.criutil import container_config, sandbox_config


async def populate(
    rt: api_pb2_grpc.RuntimeServiceStub, im: api_pb2_grpc.ImageServiceStub, n: int
) -> dict[str, int]:
    await im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox:1.36")))
    await im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="example.com/app:2")))
    states: dict[str, int] = {}
    for i in range(n):
        sc = sandbox_config(name=f"pod{i}", labels={"i": str(i)})
        pod = (await rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
        states[pod] = pb.SANDBOX_READY
        for j, cmd in enumerate((["sleep", "3600"], ["sh", "-c", "exit 2"], ["sleep", "3600"])):
            cc = container_config(name=f"c{j}", image="busybox:1.36", command=cmd)
            req = pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
            cid = (await rt.CreateContainer(req)).container_id
            if j < 2:
                await rt.StartContainer(pb.StartContainerRequest(container_id=cid))
            states[cid] = [pb.CONTAINER_RUNNING, pb.CONTAINER_EXITED, pb.CONTAINER_CREATED][j]
        if i == 0:
            await rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod))
            states[pod] = pb.SANDBOX_NOTREADY
            for c in (
                await rt.ListContainers(
                    pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=pod))
                )
            ).containers:
                states[c.id] = pb.CONTAINER_EXITED
    await asyncio.sleep(0.2)  # let `exit 2` finish
    return states


async def snapshot(
    rt: api_pb2_grpc.RuntimeServiceStub, im: api_pb2_grpc.ImageServiceStub
) -> tuple[dict[str, int], set[str], dict[str, tuple[int, int, int]]]:
    states: dict[str, int] = {}
    times: dict[str, tuple[int, int, int]] = {}
    for p in (await rt.ListPodSandbox(pb.ListPodSandboxRequest())).items:
        states[p.id] = p.state
    for c in (await rt.ListContainers(pb.ListContainersRequest())).containers:
        states[c.id] = c.state
        st = (await rt.ContainerStatus(pb.ContainerStatusRequest(container_id=c.id))).status
        times[c.id] = (st.created_at, st.started_at, st.exit_code)
    images = {t for i in (await im.ListImages(pb.ListImagesRequest())).images for t in i.repo_tags}
    return states, images, times


async def test_graceful_restart_preserves_everything(short_tmp: str) -> None:
    cfg = server_config(short_tmp)
    fake_dir = os.path.join(short_tmp, "fake")
    server = Server(
        cfg, backends={"fake": FakeBackend("fake", {"state_dir": fake_dir})}, id_factory=make_ids("g")
    )
    await server.start()
    async with grpc.aio.insecure_channel(f"unix://{short_tmp}/cri.sock") as ch:
        rt, im = api_pb2_grpc.RuntimeServiceStub(ch), api_pb2_grpc.ImageServiceStub(ch)
        expected = await populate(rt, im, 4)
        before = await snapshot(rt, im)
    await server.stop(0)
    assert before[0] == expected

    server = Server(
        cfg, backends={"fake": FakeBackend("fake", {"state_dir": fake_dir})}, id_factory=make_ids("g2")
    )
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{short_tmp}/cri.sock") as ch:
            rt, im = api_pb2_grpc.RuntimeServiceStub(ch), api_pb2_grpc.ImageServiceStub(ch)
            after = await snapshot(rt, im)
            assert after == before
            # Names survive too: the same pod cannot be created twice.
            sc = sandbox_config(name="pod1")
            sc.metadata.uid = "x"
            await rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))
    finally:
        await server.stop(0)


def start_process(root: str) -> subprocess.Popen[bytes]:
    """`cri-shim serve` in a child process, returned once it answers Version."""
    sock = f"{root}/cri.sock"
    with open(f"{root}/server.log", "ab") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shim.cli",
                "serve",
                "--listen",
                f"unix://{sock}",
                "--state-dir",
                f"{root}/state",
                "--log-level",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            with open(f"{root}/server.log") as f:
                raise AssertionError(f"server did not start: {f.read()}")
        if os.path.exists(sock):
            with grpc.insecure_channel(f"unix://{sock}") as ch:
                try:
                    api_pb2_grpc.RuntimeServiceStub(ch).Version(pb.VersionRequest(), timeout=1)
                    return proc
                except grpc.RpcError:
                    pass
        time.sleep(0.05)


async def test_sigkill_and_restart_lose_nothing(short_tmp: str) -> None:
    proc = start_process(short_tmp)
    try:
        async with grpc.aio.insecure_channel(f"unix://{short_tmp}/cri.sock") as ch:
            rt, im = api_pb2_grpc.RuntimeServiceStub(ch), api_pb2_grpc.ImageServiceStub(ch)
            expected = await populate(rt, im, 5)
            before = await snapshot(rt, im)
        assert before[0] == expected
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert os.path.exists(f"{short_tmp}/cri.sock")  # left behind, stale
        proc = start_process(short_tmp)  # replaces the stale socket
        async with grpc.aio.insecure_channel(f"unix://{short_tmp}/cri.sock") as ch:
            rt, im = api_pb2_grpc.RuntimeServiceStub(ch), api_pb2_grpc.ImageServiceStub(ch)
            after = await snapshot(rt, im)
        assert after == before
        assert {"docker.io/library/busybox:1.36", "example.com/app:2"} <= after[1]
    finally:
        proc.kill()
        proc.wait(10)


async def test_live_socket_is_refused(short_tmp: str) -> None:
    proc = start_process(short_tmp)
    try:
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "shim.cli",
                "serve",
                "--listen",
                f"unix://{short_tmp}/cri.sock",
                "--state-dir",
                f"{short_tmp}/state2",
            ],
            capture_output=True,
            timeout=30,
        )
        assert second.returncode == 1
        assert b"another server is listening" in second.stderr
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    assert not os.path.exists(f"{short_tmp}/cri.sock")  # a graceful stop removes its socket


async def test_half_created_records_are_cleaned_at_start(short_tmp: str) -> None:
    """A crash between persisting a record and committing it leaves an uncommitted record:
    the next start removes what the backend may have made and forgets the record."""
    from backends.contract import ContainerRecord, SandboxRecord, SandboxStatus
    from shim.cri.store import StateDir, Store

    cfg = server_config(short_tmp)
    store = Store(StateDir(cfg.server.state_dir))
    done = SandboxRecord(
        id="a" * 64,
        handler="",
        backend="fake",
        config=sandbox_config(name="done"),
        created_at=1,
        status=SandboxStatus(ready=True, ip="10.88.0.9"),
        committed=True,
    )
    half = SandboxRecord(
        id="b" * 64, handler="", backend="fake", config=sandbox_config(name="half"), created_at=2
    )
    half_ctr = ContainerRecord(
        id="c" * 64,
        sandbox_id=done.id,
        backend="fake",
        config=container_config(name="half"),
        created_at=3,
        log_path="",
    )
    for r in (done, half):
        store.add(r)
    store.add(half_ctr)

    fake = FakeBackend("fake", {"state_dir": os.path.join(short_tmp, "fake")})
    server = Server(cfg, backends={"fake": fake}, id_factory=make_ids("h"))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{short_tmp}/cri.sock") as ch:
            rt = api_pb2_grpc.RuntimeServiceStub(ch)
            pods = (await rt.ListPodSandbox(pb.ListPodSandboxRequest())).items
            assert [p.id for p in pods] == [done.id]
            assert len((await rt.ListContainers(pb.ListContainersRequest())).containers) == 0
            # The half-created pod's name is free again.
            await rt.RunPodSandbox(pb.RunPodSandboxRequest(config=half.config))
        assert [c.args[0] for c in fake.calls_to("remove_sandbox")] == [half.id]
        assert [c.args[0] for c in fake.calls_to("remove_container")] == [half_ctr.id]
        assert sorted(os.listdir(os.path.join(cfg.server.state_dir, "containers"))) == []
    finally:
        await server.stop(0)


class StartedBehindTheShimsBack(FakeBackend):
    """A runtime that ran a start the previous shim died before recording."""

    def __init__(self, name: str, options: dict[str, Any]) -> None:
        super().__init__(name, options)
        life = self.runtime.lifecycle
        recover = life.recover

        async def started_behind_its_back(sandboxes, containers):  # type: ignore[no-untyped-def]
            seen_sb, seen_ct = await recover(sandboxes, containers)
            for c in containers:
                if c.status.state == pb.CONTAINER_CREATED:
                    seen_ct[c.id] = dataclasses.replace(seen_ct[c.id], running=True, started_at=12345)
                    life.running[c.id] = Running(Program(), 0.0)  # so it is followed as running
            return seen_sb, seen_ct

        life.recover = started_behind_its_back  # type: ignore[method-assign]


async def test_a_start_the_runtime_made_but_the_shim_did_not_record_is_recovered(short_tmp: str) -> None:
    fake_dir = os.path.join(short_tmp, "fake")
    server = Server(
        server_config(short_tmp),
        backends={"fake": FakeBackend("fake", {"state_dir": fake_dir})},
        id_factory=make_ids("s"),
    )
    await server.start()
    async with grpc.aio.insecure_channel(f"unix://{short_tmp}/cri.sock") as ch:
        rt, im = api_pb2_grpc.RuntimeServiceStub(ch), api_pb2_grpc.ImageServiceStub(ch)
        await im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox")))
        sc = sandbox_config()
        pods = []
        for i in range(3):
            pods.append(
                (
                    await rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sandbox_config(name=f"p{i}")))
                ).pod_sandbox_id
            )
        ips = [
            (await rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=p))).status.network.ip
            for p in pods
        ]
        cid = (
            await rt.CreateContainer(
                pb.CreateContainerRequest(
                    pod_sandbox_id=pods[0], config=container_config(), sandbox_config=sc
                )
            )
        ).container_id
    await server.stop(0)
    again = Server(
        server_config(short_tmp),
        backends={"fake": StartedBehindTheShimsBack("fake", {"state_dir": fake_dir})},
        id_factory=make_ids("s2"),
    )
    await again.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{short_tmp}/cri.sock") as ch:
            rt = api_pb2_grpc.RuntimeServiceStub(ch)
            st = (await rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))).status
            assert (st.state, st.started_at) == (pb.CONTAINER_RUNNING, 12345)
            # New pods never get an address a recovered pod holds.
            new = (
                await rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sandbox_config(name="new")))
            ).pod_sandbox_id
            ip = (await rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=new))).status.network.ip
            assert ip and ip not in ips
    finally:
        await again.stop(0)


async def test_torn_and_foreign_records_are_quarantined_and_the_rest_served(short_tmp: str) -> None:
    """A torn, empty, foreign-version or misnamed record file, or one naming a pod twice: the shim
    starts, keeps each aside under quarantine/ with a log line, and serves everything else."""
    cfg = server_config(short_tmp)
    fake_dir = os.path.join(short_tmp, "fake")
    server = Server(
        cfg, backends={"fake": FakeBackend("fake", {"state_dir": fake_dir})}, id_factory=make_ids("t")
    )
    await server.start()
    async with grpc.aio.insecure_channel(f"unix://{short_tmp}/cri.sock") as ch:
        rt, im = api_pb2_grpc.RuntimeServiceStub(ch), api_pb2_grpc.ImageServiceStub(ch)
        await populate(rt, im, 3)
        before = await snapshot(rt, im)
    await server.stop(0)
    state = cfg.server.state_dir
    pods = sorted(os.listdir(os.path.join(state, "sandboxes")))
    containers = sorted(os.listdir(os.path.join(state, "containers")))
    victims = {
        os.path.join(state, "sandboxes", pods[0]): lambda text: text[: len(text) // 2],  # torn mid-write
        os.path.join(state, "containers", containers[0]): lambda text: "",  # zero length
        os.path.join(state, "containers", containers[1]): lambda text: text.replace('"v": 1', '"v": 99'),
        os.path.join(state, "containers", containers[2]): lambda text: "[1, 2]",  # not a record
    }
    for path, tear in victims.items():
        with open(path) as f:
            text = f.read()
        with open(path, "w") as f:
            f.write(tear(text))
    # A file whose record is another one's (copied by hand): its ID is not its name.
    stray = os.path.join(state, "containers", "f" * 64 + ".json")
    with open(os.path.join(state, "containers", containers[3])) as f, open(stray, "w") as out:
        out.write(f.read())
    server = Server(
        cfg, backends={"fake": FakeBackend("fake", {"state_dir": fake_dir})}, id_factory=make_ids("t2")
    )
    await server.start()
    try:
        kept = sorted(os.listdir(os.path.join(state, "quarantine")))
        assert len(kept) == 5, kept
        torn_ids = {os.path.basename(p)[:-5] for p in victims}
        async with grpc.aio.insecure_channel(f"unix://{short_tmp}/cri.sock") as ch:
            rt, im = api_pb2_grpc.RuntimeServiceStub(ch), api_pb2_grpc.ImageServiceStub(ch)
            states, _images, _times = await snapshot(rt, im)
            assert set(states) == set(before[0]) - torn_ids
            assert all(states[k] == before[0][k] for k in states if not k.startswith(pods[0][:-5]))
            assert "f" * 64 not in states
            # The shim serves: new pods work.
            await rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sandbox_config(name="after")))
    finally:
        await server.stop(0)
