"""The cri-shim image on the host's Docker Engine, driven from the host like crictl would.

Needs the image (deploy/build-image.sh; name in $CRI_SHIM_IMAGE, default
cri-shim:<version>) and the test environment of scripts/testenv/up (engine
and the registry on 127.0.0.1:5000). Skipped when either is missing, except
that in CI a missing engine fails (as in tests/docker).

The container gets what deploy/README.md lists: the socket directory, the
state directory and the pod log directory at the same paths as on the host,
the Docker socket, cgroups read-only, the host's network and PID namespace.
SYS_ADMIN + SYS_PTRACE stand in for --privileged, which this VM refuses.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import docker
import grpc
import pytest

from cri_api import api_pb2 as pb
from cri_api import api_pb2_grpc
from shim import __version__

pytestmark = pytest.mark.image

IMAGE = os.environ.get("CRI_SHIM_IMAGE", f"cri-shim:{__version__}")
ENGINE = os.environ.get("CRI_SHIM_DOCKER_ENDPOINT", "unix:///var/run/docker.sock")
BUSYBOX = "127.0.0.1:5000/busybox:1.36"
PAUSE = "127.0.0.1:5000/pause:3.10"


@pytest.fixture(scope="module")
def engine() -> Iterator[docker.DockerClient]:
    try:
        client = docker.DockerClient(base_url=ENGINE, version="1.41", timeout=60)
        client.ping()
    except Exception as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"no Docker engine at {ENGINE}: {exc}")
        pytest.skip(f"no Docker engine at {ENGINE} ({exc}); run scripts/testenv/up")
    try:
        client.images.get(IMAGE)
    except docker.errors.ImageNotFound:
        client.close()
        pytest.skip(f"image {IMAGE} not built; run deploy/build-image.sh")
    yield client
    client.close()


class Node:
    def __init__(self, root: str) -> None:
        self.root = root
        self.run = os.path.join(root, "run")
        self.state = os.path.join(root, "state")
        self.logs = os.path.join(root, "pods")
        self.sock = os.path.join(self.run, "cri-shim.sock")
        for d in (self.run, self.state, self.logs):
            os.makedirs(d)
        self.instance = f"imgtest-{os.getpid()}"
        self.config = os.path.join(root, "config.toml")
        Path(self.config).write_text(
            f"""
[server]
listen = "unix://{self.sock}"
state_dir = "{self.state}"
default_handler = "docker"
metrics_listen = "127.0.0.1:0"

[handlers.docker]
type = "docker"
instance = "{self.instance}"

[images]
pause_image = "{PAUSE}"
"""
        )


@pytest.fixture
async def shim(engine: docker.DockerClient) -> AsyncIterator[tuple[Node, Any]]:
    node = Node(tempfile.mkdtemp(prefix="crimg", dir="/tmp"))
    same = {p: {"bind": p, "mode": "rw"} for p in (node.run, node.state, node.logs)}
    container = engine.containers.run(
        IMAGE,
        ["serve", "--config", "/etc/cri-shim/config.toml"],
        detach=True,
        name=f"cri-shim-{node.instance}",
        network_mode="host",
        pid_mode="host",
        cgroupns="host",
        cap_add=["SYS_ADMIN", "SYS_PTRACE"],
        environment={"CRI_SHIM_HEALTH_TARGET": f"unix://{node.sock}"},
        volumes={
            **same,
            "/var/run/docker.sock": {"bind": "/var/run/docker.sock", "mode": "rw"},
            "/sys/fs/cgroup": {"bind": "/sys/fs/cgroup", "mode": "ro"},
            node.config: {"bind": "/etc/cri-shim/config.toml", "mode": "ro"},
        },
        # The image's HEALTHCHECK command, checked more often than in production.
        healthcheck={"interval": 1_000_000_000, "timeout": 10_000_000_000, "retries": 3},
    )
    try:
        yield node, container
    finally:
        # Whatever the test left: this run's pod containers (by instance label), then the shim.
        for c in engine.containers.list(all=True, filters={"label": f"io.cri-shim.instance={node.instance}"}):
            c.remove(force=True)
        container.remove(force=True)
        shutil.rmtree(node.root, ignore_errors=True)


def wait_for(predicate: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


async def test_pod_through_the_containerised_shim(shim: tuple[Node, Any]) -> None:
    node, container = shim

    def serving() -> bool:
        container.reload()
        assert container.status == "running", container.logs().decode()[-2000:]
        return os.path.exists(node.sock)

    await asyncio.to_thread(wait_for, serving, 60, "the CRI socket")
    mode = os.stat(node.sock).st_mode & 0o777
    assert mode == 0o660

    def healthy() -> bool:
        container.reload()
        status = container.attrs["State"].get("Health", {}).get("Status")
        assert container.status == "running", container.logs().decode()[-2000:]
        return bool(status == "healthy")

    await asyncio.to_thread(wait_for, healthy, 60, "HEALTHCHECK to report healthy")

    async with grpc.aio.insecure_channel(f"unix://{node.sock}") as channel:
        rt = api_pb2_grpc.RuntimeServiceStub(channel)
        im = api_pb2_grpc.ImageServiceStub(channel)
        version = await rt.Version(pb.VersionRequest(), timeout=30)
        assert version.runtime_api_version == "v1"
        status = await rt.Status(pb.StatusRequest(), timeout=30)
        ready = {c.type: c.status for c in status.status.conditions}
        assert ready.get("RuntimeReady") is True, status
        await im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=BUSYBOX)), timeout=120)

        log_dir = os.path.join(node.logs, "test_web_uid1")
        sb_cfg = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name="web", uid="uid1", namespace="test"),
            log_directory=log_dir,
        )
        run = await rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sb_cfg), timeout=120)
        created = await rt.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=run.pod_sandbox_id,
                config=pb.ContainerConfig(
                    metadata=pb.ContainerMetadata(name="hello"),
                    image=pb.ImageSpec(image=BUSYBOX),
                    command=["sh", "-c", "echo hello from the containerised shim"],
                    log_path="hello/0.log",
                ),
                sandbox_config=sb_cfg,
            ),
            timeout=60,
        )
        await rt.StartContainer(pb.StartContainerRequest(container_id=created.container_id), timeout=60)

        async def exited() -> pb.ContainerStatus:
            while True:
                st = await rt.ContainerStatus(
                    pb.ContainerStatusRequest(container_id=created.container_id), timeout=30
                )
                if st.status.state == pb.CONTAINER_EXITED:
                    found: pb.ContainerStatus = st.status
                    return found
                await asyncio.sleep(0.2)

        final = await asyncio.wait_for(exited(), 60)
        assert final.exit_code == 0
        log_file = Path(log_dir, "hello", "0.log")
        # The log is written by the shim in the container, onto the host's directory.
        await asyncio.to_thread(
            wait_for, lambda: "hello from the containerised shim" in log_file.read_text(), 20, "the log"
        )
        assert " stdout F hello from the containerised shim" in log_file.read_text()

        await rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=run.pod_sandbox_id), timeout=60)
        await rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=run.pod_sandbox_id), timeout=60)
        pods = await rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30)
        assert run.pod_sandbox_id not in [p.id for p in pods.items]

    # --metrics-listen inside the image: the port was chosen at random; the log names it.
    found = re.search(r"url=(http://127\.0\.0\.1:(\d+)/metrics)", container.logs().decode())
    assert found, container.logs().decode()[-2000:]
    reader, writer = await asyncio.open_connection("127.0.0.1", int(found.group(2)))
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    text = (await reader.read()).decode()
    writer.close()
    assert 'cri_shim_grpc_requests_total{code="OK",method="RunPodSandbox"} 1.0' in text
    assert 'cri_shim_image_pulls_total{handler="docker",result="success"} 1.0' in text
