"""`cri-shim serve` with ``[handlers.docker] pod_network = "cni"``, driven through gRPC on its socket.

The network is the test's own (tests/cni/realnet.py: bridge ``crcnis0-<rand>``, a /24 of
10.251.0.0/16, host-local's store under the test's directory); the shim runs as a child process
with its own state, engine instance label and no NRI socket, and is SIGKILLed by its PID.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import docker
import grpc
import pytest

from backends.docker import labels as lbl
from cri_api import api_pb2 as pb
from cri_api import api_pb2_grpc
from tests.cni import fakeplugin
from tests.cni.realnet import PLUGIN_DIR, Net, own_network, why_not
from tests.criutil import container_config, sandbox_config
from tests.docker.dockerkit import BUSYBOX, ENDPOINT, PAUSE
from tests.shimproc import ShimProcess

pytestmark = [pytest.mark.docker, pytest.mark.skipif(bool(why_not()), reason=why_not())]


class ShimNet(ShimProcess, Net):
    """The network, and a shim on it: its config, its process, its engine containers."""

    def __init__(self, root: Path, tag: str, octet: int, gateway: bool) -> None:
        super().__init__(root, tag, octet, gateway)
        self.sock = f"{root}/cri.sock"
        self.instance = f"cnishim-{self.rand}"

    def configure(self, template: bool = False) -> None:
        cni = f'conf_dir = "{self.conf_dir}"\nbin_dirs = ["{self.bin_dir}", "{PLUGIN_DIR}"]\nplugin_timeout = 20\n'
        if template:
            # host-local's ranges are the node's pod CIDR, rendered when the kubelet sends it.
            text = json.dumps(self.conflist(ipam={"ranges": "RANGES"})).replace(
                '"RANGES"', "{{.HostLocalRanges}}"
            )
            (self.root / "net.tmpl").write_text(text)
            cni += f'conf_template = "{self.root}/net.tmpl"\n'
        (self.root / "cri-shim.toml").write_text(
            f'[server]\nlisten = "unix://{self.sock}"\nstate_dir = "{self.root}/state"\n'
            'default_handler = "docker"\n'
            f'[images]\npause_image = "{PAUSE}"\n'
            f'[handlers.docker]\ntype = "docker"\nendpoint = "{ENDPOINT}"\ninstance = "{self.instance}"\n'
            'pod_network = "cni"\n'
            "[nri]\nenable = false\n"
            f"[cni]\n{cni}"
        )

    def engine_pods(self, engine: docker.APIClient) -> list[str]:
        """The pod of each engine container of this shim."""
        rows = engine.containers(all=True, filters={"label": f"{lbl.INSTANCE}={self.instance}"})
        labels = [r.get("Labels") or {} for r in rows]
        return sorted(str(x.get(lbl.SANDBOX_ID) or x.get(lbl.ID)) for x in labels)

    def pins(self) -> list[str]:
        d = self.root / "state" / "backends" / "docker" / "netns"
        return sorted(os.listdir(d)) if d.exists() else []


@pytest.fixture
def shim_net(engine: docker.APIClient, short_tmp: str) -> Iterator[ShimNet]:
    with own_network(Path(short_tmp), "crcnis", 251, ShimNet, gateway=True) as net:
        try:
            yield net
        finally:
            # Whatever a failed test left: through the shim first, then from the engine.
            if net.proc is not None:
                net.stop()
            for row in engine.containers(all=True, filters={"label": f"{lbl.INSTANCE}={net.instance}"}):
                engine.remove_container(row["Id"], force=True)
            for pin in net.pins():
                subprocess.run(
                    ["umount", "-l", str(net.root / "state/backends/docker/netns" / pin)], check=False
                )


@pytest.fixture
async def template_shim(shim_net: ShimNet) -> AsyncIterator[ShimNet]:
    shim_net.configure(template=True)
    shim_net.start()
    yield shim_net


async def network_ready(rt: api_pb2_grpc.RuntimeServiceStub) -> pb.RuntimeCondition:
    st = await rt.Status(pb.StatusRequest())
    return next(c for c in st.status.conditions if c.type == "NetworkReady")


async def run_pod(
    rt: api_pb2_grpc.RuntimeServiceStub, name: str, timeout: float | None = None
) -> tuple[str, str, str]:
    """(pod ID, pod IP, the ID of a running busybox in it)."""
    sc = sandbox_config(name=name, namespace="cni-e2e")
    pod = (await rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc), timeout=timeout)).pod_sandbox_id
    ip = (await rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod))).status.network.ip
    cc = container_config(name="app", image=BUSYBOX, command=["sleep", "3600"])
    req = pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
    cid = (await rt.CreateContainer(req)).container_id
    await rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    return pod, ip, cid


async def exec_sync(rt: api_pb2_grpc.RuntimeServiceStub, cid: str, *cmd: str) -> str:
    r = await rt.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=list(cmd), timeout=20))
    assert r.exit_code == 0, (cmd, r)
    return r.stdout.decode()


async def remove_pod(rt: api_pb2_grpc.RuntimeServiceStub, pod: str) -> None:
    await rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod))
    await rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod))


async def test_pods_on_the_nodes_network_through_grpc(
    engine: docker.APIClient, template_shim: ShimNet
) -> None:
    net = template_shim
    async with net.channel() as ch:
        rt, im = api_pb2_grpc.RuntimeServiceStub(ch), api_pb2_grpc.ImageServiceStub(ch)
        ready = await network_ready(rt)
        assert not ready.status and ready.reason == "NetworkPluginNotReady"
        assert str(net.conf_dir) in ready.message and "waits for the pod CIDR" in ready.message
        req = pb.UpdateRuntimeConfigRequest()
        req.runtime_config.network_config.pod_cidr = str(net.subnet)
        await rt.UpdateRuntimeConfig(req)
        assert (await network_ready(rt)).status  # the template rendered into conf_dir, no restart
        assert (net.conf_dir / "10-cri-shim-net.conflist").exists()

        await im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=BUSYBOX)))
        pod1, ip1, c1 = await run_pod(rt, "one")
        pod2, ip2, _ = await run_pod(rt, "two")
        assert {ip1, ip2} <= {str(a) for a in net.subnet.hosts()} and ip1 != ip2
        assert f"inet {ip1}/24" in await exec_sync(rt, c1, "ip", "-o", "-4", "addr", "show", "dev", "eth0")
        await exec_sync(rt, c1, "ping", "-c1", "-W5", ip2)
        assert net.reserved() == {ip1: pod1, ip2: pod2}
        assert net.pins() == sorted([pod1, pod2])
        for pod in (pod1, pod2):
            await remove_pod(rt, pod)

        # A config that sorts first, with a plugin that refuses after bridge and host-local ran.
        fakeplugin.install(net.bin_dir, "breaker")
        broken = net.conflist({"type": "breaker", "fake": {"ADD": {"error": {"code": 7, "msg": "refused"}}}})
        fakeplugin.write_json(net.conf_dir / "00-broken.conflist", broken)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sandbox_config(name="refused")))
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "CNI plugin breaker ADD failed (code 7): refused" in (info.value.details() or "")
        assert not (await rt.ListPodSandbox(pb.ListPodSandboxRequest())).items
    assert net.reserved() == {} and net.ports() == [] and net.pins() == []
    assert net.engine_pods(engine) == []
    net.stop()


async def test_sigkill_between_the_add_and_the_record_leaves_nothing_held(
    engine: docker.APIClient, shim_net: ShimNet
) -> None:
    net = shim_net
    net.configure()
    net.write_conflist()
    net.start()
    pids = net.root / "hung"
    async with net.channel() as ch:
        rt, im = api_pb2_grpc.RuntimeServiceStub(ch), api_pb2_grpc.ImageServiceStub(ch)
        await im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=BUSYBOX)))
        kept, kept_ip, _ = await run_pod(rt, "kept")
        # From now on an ADD hangs after host-local reserved an address and bridge made the veth.
        fakeplugin.install(net.bin_dir, "hang")
        net.write_conflist({"type": "hang", "fake": {"ADD": {"hang": str(pids)}}})
        stuck = asyncio.ensure_future(run_pod(rt, "stuck", timeout=60))
        deadline = time.monotonic() + 30
        while not (pids.exists() and pids.read_text()):
            assert time.monotonic() < deadline and not stuck.done()
            await asyncio.sleep(0.05)
        assert len(net.reserved()) == 2 and len(net.ports()) == 2 and len(net.pins()) == 2
        assert net.proc is not None
        net.stop(signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError):
            await stuck
    for pid in pids.read_text().split():  # the plugin runs in a session of its own: it outlived the shim
        os.kill(int(pid), signal.SIGKILL)

    net.start()
    async with net.channel() as ch:
        rt = api_pb2_grpc.RuntimeServiceStub(ch)
        pods = (await rt.ListPodSandbox(pb.ListPodSandboxRequest())).items
        assert [(p.id, p.state) for p in pods] == [(kept, pb.SANDBOX_READY)]
        status = await rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=kept))
        assert status.status.network.ip == kept_ip
        assert net.reserved() == {kept_ip: kept}
        assert len(net.ports()) == 1 and net.pins() == [kept]
        assert net.engine_pods(engine) == [kept, kept]  # its pause and its app; nothing of the other
        await remove_pod(rt, kept)
    assert net.reserved() == {} and net.ports() == [] and net.pins() == []
    net.stop()
