"""The clients that checkpoint a container, on runv's qemu driver with CRIU in the guest (issue 43):
`crictl checkpoint --export` against a shim, and the v1.35 kubelet's checkpoint API (`POST
/checkpoint/{namespace}/{pod}/{container}`), each archive then the image of a CreateContainer in a
new pod (as CRI-O and containerd 2.1 take it) on another shim (a new VM), whose counter goes on.

Needs QEMU and the --criu guest image (as tests/runv/test_qemu_checkpoint.py); crictl
(CRI_SHIM_CRICTL, default /opt/cri-tools/bin/crictl); the kubelet test is opt-in as
tests/e2e/test_checkpoint.py's (CRI_SHIM_KUBELET, root, the local registry).
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

from backends.runv.backend import RunvBackend
from cri_api import api_pb2 as pb
from cri_api import api_pb2_grpc
from shim.server import Server
from tests.conftest import make_ids, server_config
from tests.criutil import container_config, sandbox_config, until
from tests.e2e.test_checkpoint import CRICTL, as_json, crictl
from tests.runv.test_qemu_checkpoint import COUNTER, counted, criu_runv
from tests.runv.test_qemu_criu_probe import CRIU_GUEST_DIR, _counts_on, needs_criu_guest

IMAGE = "test/busybox:1"
REGISTRY_BUSYBOX = "127.0.0.1:5000/busybox:1.36"

# Not marked `qemu` (which CI may not skip): each test also needs a client CI does not install.
pytestmark = [pytest.mark.slow, needs_criu_guest, pytest.mark.timeout(900)]


class Shim:
    """A shim whose default handler is a qemu runv with CRIU, on a socket under ``root``."""

    def __init__(self, root: Path, runv: RunvBackend) -> None:
        self.root, self.runv = root, runv
        self.sock = str(root / "cri.sock")
        cfg = server_config(str(root), default_handler="runv")
        self.server = Server(cfg, backends={"runv": runv}, id_factory=make_ids())

    async def __aenter__(self) -> Shim:
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"unix://{self.sock}")
        self.rt = api_pb2_grpc.RuntimeServiceStub(self.channel)
        self.im = api_pb2_grpc.ImageServiceStub(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for p in (await self.rt.ListPodSandbox(pb.ListPodSandboxRequest())).items:
            await self.rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=p.id))
            await self.rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=p.id))
        await self.channel.close()
        await self.server.stop(0)

    async def restored_counter(self, archive: str, name: str) -> tuple[str, Path]:
        """A new pod whose container's image is ``archive``, started: its ID and log."""
        logs = self.root / ("logs-" + name)
        sc = sandbox_config(name=name, uid="uid-" + name, log_directory=str(logs))
        pod = (await self.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
        cc = container_config(name="counter", image=archive, log_path="counter.log")
        req = pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
        cid = (await self.rt.CreateContainer(req)).container_id
        status = await self.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))
        assert status.status.state == pb.CONTAINER_CREATED
        await self.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
        return cid, logs / "counter.log"


async def test_crictl_checkpoint_export_then_create_from_the_archive(
    runv_config: dict[str, Any], busybox_rootfs: Path, short_tmp: str
) -> None:
    if not os.access(CRICTL, os.X_OK):
        pytest.skip(f"no crictl at {CRICTL} (set CRI_SHIM_CRICTL)")
    root = Path(short_tmp)
    runv = criu_runv(runv_config)
    runv.image_store.import_dir(IMAGE, str(busybox_rootfs))
    async with Shim(root, runv) as shim:
        sc = sandbox_config(name="counting", uid="uid-counting", log_directory=str(root / "logs"))
        pod = await crictl(shim.sock, "runp", as_json(root / "pod.json", sc))
        cc = container_config(name="counter", image=IMAGE, command=COUNTER, log_path="counter.log")
        cid = await crictl(
            shim.sock, "create", "--no-pull", pod, as_json(root / "c.json", cc), str(root / "pod.json")
        )
        await crictl(shim.sock, "start", cid)
        log = root / "logs" / "counter.log"
        await until(lambda: len(counted(str(log))) >= 3, 120)
        archive = root / "export" / "counter.tar"
        archive.parent.mkdir()
        await crictl(shim.sock, "checkpoint", f"--export={archive}", cid[:12])
        assert archive.is_file()
        await crictl(shim.sock, "stopp", pod)
        before = counted(str(log))
        _rid, restored_log = await shim.restored_counter(str(archive), "restored")
        await until(lambda: len(counted(str(restored_log))) >= 3, 120)
        after = counted(str(restored_log))
        print("counted before", before[-3:], "after", after[:3])
        assert _counts_on(before, after), (before, after)


def _kubelet_problem() -> str | None:
    from tests.e2e import kubelet as kh

    if not os.environ.get("CRI_SHIM_KUBELET"):
        return "set CRI_SHIM_KUBELET to a v1.30+ kubelet binary to run the kubelet checkpoint test"
    return kh.environment_problem("runv")


@pytest.mark.timeout(1200)
def test_kubelet_checkpoint_api_then_a_container_restored_from_its_archive(
    runv_config: dict[str, Any], short_tmp: str
) -> None:
    problem = _kubelet_problem()
    if problem:
        pytest.skip(problem)
    from tests.e2e import kubelet as kh

    h = kh.Harness("runv", driver="qemu", guest_dir=CRIU_GUEST_DIR)
    h.pods = {
        "counter": {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "counter", "namespace": kh.NAMESPACE},
            "spec": {
                "terminationGracePeriodSeconds": 2,
                "containers": [
                    {
                        "name": "counter",
                        "image": REGISTRY_BUSYBOX,
                        "imagePullPolicy": "IfNotPresent",
                        "command": COUNTER,
                    }
                ],
            },
        }
    }
    with h:
        h.wait_running("counter", "counter", timeout=300)
        h.wait_log("counter", "counter", "\n5\n", timeout=120)
        pod = h.full("counter")
        body = h.api_ok("POST", f"/checkpoint/{kh.NAMESPACE}/{pod}/counter?timeout=120", timeout=180)
        (archive,) = json.loads(body)["items"]
        checkpoints = h.dir / "kubelet" / "checkpoints"
        assert Path(archive).parent == checkpoints, archive
        assert Path(archive).name.startswith(f"checkpoint-{pod}_{kh.NAMESPACE}-counter-"), archive
        kept = Path(short_tmp) / "archive.tar"
        shutil.copy(archive, kept)
        shutil.rmtree(checkpoints, ignore_errors=True)

    # Restored on another node (a shim and a VM of its own), as a migration does.
    async def elsewhere() -> list[int]:
        root = Path(short_tmp) / "elsewhere"
        root.mkdir()
        async with Shim(root, criu_runv(runv_config)) as shim:
            await shim.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=REGISTRY_BUSYBOX)))
            _cid, log = await shim.restored_counter(str(kept), "restored")
            await until(lambda: len(counted(str(log))) >= 3, 120)
            return counted(str(log))

    after = asyncio.run(elsewhere())
    print("restored counts", after[:5])
    # It had written 5 before its checkpoint: a restored counter goes on past it, one by one.
    assert after[0] > 5 and after == list(range(after[0], after[0] + len(after))), after
