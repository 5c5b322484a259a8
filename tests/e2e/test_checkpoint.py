"""A container checkpointed by the clients that ask for it, and restored from their archive, on
the fake: `crictl checkpoint --export` against a shim, and the v1.35 kubelet's checkpoint API
(`POST /checkpoint/{namespace}/{pod}/{container}`, the ContainerCheckpoint gate, on by default
since v1.30), which writes under the kubelet's checkpoints directory. Each archive is then the
image of a CreateContainer in a new pod (as CRI-O and containerd 2.1 take it), whose counter goes
on from where the checkpoint caught it.

crictl: CRI_SHIM_CRICTL names it (default /opt/cri-tools/bin/crictl); skipped without it. The
kubelet: opt-in, as tests/e2e/test_kubelet.py, when CRI_SHIM_KUBELET names a v1.30+ kubelet
binary (it changes host kernel settings while it runs); skipped without it, root or the local
registry.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from backends.fake import PROGRAM_ANNOTATION, FakeBackend
from cri_api import api_pb2 as pb
from cri_api import api_pb2_grpc
from shim.server import Server
from tests import counter
from tests.conftest import Running, make_ids, server_config
from tests.criutil import container_config, sandbox_config, until

CRICTL = os.environ.get("CRI_SHIM_CRICTL") or "/opt/cri-tools/bin/crictl"


def _log_numbers(path: Path) -> list[int]:
    return counter.numbers(path.read_bytes()) if path.exists() else []


# ---------------------------------------------------------------------- crictl


@pytest.fixture
async def fake_shim(short_tmp: str) -> Any:
    fake = FakeBackend("fake", {"state_dir": os.path.join(short_tmp, "fake")})
    server = Server(server_config(short_tmp), backends={"fake": fake}, id_factory=make_ids())
    await server.start()
    channel = grpc.aio.insecure_channel(f"unix://{short_tmp}/cri.sock")
    try:
        yield Running(server, channel, fake)
    finally:
        await channel.close()
        await server.stop(0)


async def crictl(sock: str, *args: str) -> str:
    """crictl's output; the call fails the test when crictl does (the shim runs in this loop)."""
    endpoint = f"unix://{sock}"
    proc = await asyncio.create_subprocess_exec(
        CRICTL,
        "--runtime-endpoint",
        endpoint,
        "--image-endpoint",
        endpoint,
        "--timeout",
        "20s",
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, f"crictl {' '.join(args)}: {err.decode(errors='replace')}"
    return out.decode().strip()


def as_json(path: Path, message: Any) -> str:
    path.write_text(json_format.MessageToJson(message, preserving_proto_field_name=True))
    return str(path)


async def test_crictl_checkpoint_export_then_create_from_the_archive(
    fake_shim: Running, short_tmp: str
) -> None:
    if not os.access(CRICTL, os.X_OK):
        pytest.skip(f"no crictl at {CRICTL} (set CRI_SHIM_CRICTL)")
    r, root = fake_shim, Path(short_tmp)
    sock = str(root / "cri.sock")
    await r.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox")))
    sc = sandbox_config(name="counting", log_directory=str(root / "logs"))
    pod = (await r.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
    cc = container_config(
        name="counter", log_path="counter.log", annotations={PROGRAM_ANNOTATION: counter.program()}
    )
    req = pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
    cid = (await r.rt.CreateContainer(req)).container_id
    await r.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    await until(lambda: len(_log_numbers(root / "logs" / "counter.log")) >= 5)

    archive = root / "export" / "counter.tar"
    archive.parent.mkdir()
    await crictl(sock, "checkpoint", f"--export={archive}", cid[:12])
    expected = counter.next_after(counter.elapsed_in(str(archive)))
    assert expected > 5

    # The CRI-O way: a new pod, the archive as the image of a container config with no command.
    sc2 = sandbox_config(name="restored", log_directory=str(root / "logs2"))
    pod2 = await crictl(sock, "runp", as_json(root / "pod2.json", sc2))
    cc2 = container_config(name="restored", image=str(archive), log_path="restored.log")
    cid2 = await crictl(
        sock, "create", "--no-pull", pod2, as_json(root / "c2.json", cc2), str(root / "pod2.json")
    )
    state = json.loads(await crictl(sock, "inspect", "-o", "json", cid2))["status"]["state"]
    assert state == "CONTAINER_CREATED"
    await crictl(sock, "start", cid2)
    log = root / "logs2" / "restored.log"
    await until(lambda: len(_log_numbers(log)) >= 2)
    assert _log_numbers(log)[:2] == [expected, expected + 1]


# ---------------------------------------------------------------------- the kubelet

COUNTER_IMAGE = "127.0.0.1:5000/counter:1"  # the fake pulls it (no registry is asked)


def _kubelet_problem() -> str | None:
    from tests.e2e import kubelet as kh

    if not os.environ.get("CRI_SHIM_KUBELET"):
        return "set CRI_SHIM_KUBELET to a v1.30+ kubelet binary to run the kubelet checkpoint test"
    problem = kh.environment_problem("fake")
    if problem:
        return problem
    minor = kh.host.kubelet_minor(kh.kubelet_binary())
    if minor < 30:
        return (
            f"the kubelet is v1.{minor}: its checkpoint API (ContainerCheckpoint) is on by default from v1.30"
        )
    return None


async def restore_elsewhere(archive: str, root: Path) -> list[int]:
    """The first numbers a container created from ``archive`` writes, on a fake shim of its own
    (whose programs table has the counter: the kubelet's config dump holds no program)."""
    root.mkdir()
    options = {"state_dir": str(root / "fake"), "programs": {COUNTER_IMAGE: counter.program()}}
    fake = FakeBackend("fake", options)
    server = Server(server_config(str(root)), backends={"fake": fake}, id_factory=make_ids())
    await server.start()
    channel = grpc.aio.insecure_channel(f"unix://{root}/cri.sock")
    try:
        rt, im = api_pb2_grpc.RuntimeServiceStub(channel), api_pb2_grpc.ImageServiceStub(channel)
        await im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=COUNTER_IMAGE)))  # the base image
        sc = sandbox_config(name="restored", log_directory=str(root / "logs"))
        pod = (await rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
        cc = container_config(name="counter", image=archive, log_path="counter.log")
        req = pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
        cid = (await rt.CreateContainer(req)).container_id
        await rt.StartContainer(pb.StartContainerRequest(container_id=cid))
        log = root / "logs" / "counter.log"
        await until(lambda: len(_log_numbers(log)) >= 2)
        return _log_numbers(log)
    finally:
        await channel.close()
        await server.stop(0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kubelet_checkpoint_api_then_a_container_restored_from_its_archive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    problem = _kubelet_problem()
    if problem:
        pytest.skip(problem)
    from tests.e2e import kubelet as kh
    from tests.e2e.kubelet import config, runner

    def with_counter(h: runner.Harness) -> str:
        # The fake runs the counter for the image the pod names (its programs table).
        path = Path(config.shim_config(h))
        text = path.read_text()
        if "[handlers.fake]" not in text:
            text += '[handlers.fake]\ntype = "fake"\n'
        text += f"[handlers.fake.programs]\n{json.dumps(COUNTER_IMAGE)} = {json.dumps(counter.program())}\n"
        path.write_text(text)
        return str(path)

    monkeypatch.setattr(runner, "shim_config", with_counter)
    h = kh.Harness("fake")
    h.pods = {
        "counter": {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "counter", "namespace": kh.NAMESPACE},
            "spec": {
                "terminationGracePeriodSeconds": 2,
                "containers": [
                    {"name": "counter", "image": COUNTER_IMAGE, "imagePullPolicy": "IfNotPresent"}
                ],
            },
        }
    }
    with h:
        h.wait_running("counter", "counter", timeout=60)
        h.wait_log("counter", "counter", "\n5\n", timeout=60)
        pod = h.full("counter")
        body = h.api_ok("POST", f"/checkpoint/{kh.NAMESPACE}/{pod}/counter?timeout=30", timeout=60)
        (archive,) = json.loads(body)["items"]
        checkpoints = h.dir / "kubelet" / "checkpoints"
        assert Path(archive).parent == checkpoints, archive
        assert Path(archive).name.startswith(f"checkpoint-{pod}_{kh.NAMESPACE}-counter-"), archive
        expected = counter.next_after(counter.elapsed_in(archive))
        assert expected > 5
        # Restored on another node (a shim of its own: the standalone kubelet removes pods it did
        # not make), as a migration does: the archive as the image of a container in a new pod.
        restored = asyncio.run(restore_elsewhere(archive, h.dir / "elsewhere"))
        assert restored[:2] == [expected, expected + 1], (expected, restored)
        shutil.rmtree(checkpoints, ignore_errors=True)
