"""`cri-shim serve` with ``[handlers.runv] pod_network = "cni"`` (stub driver), driven through gRPC.

The network is the test's own (tests/cni/realnet.py: bridge ``crrvs0-<rand>``, a /24 of
10.252.0.0/16, host-local's store under the test's directory); the backend's root, run dir and
cgroups are the test's (conftest.py); the shim runs as a child process and is SIGKILLed by its PID.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from cri_api import api_pb2 as pb
from cri_api import api_pb2_grpc
from tests.cni.breaker import break_add, kill_hung, wait_hung
from tests.cni.realnet import PLUGIN_DIR, Net, own_network, why_not
from tests.criutil import sandbox_config
from tests.runv.helpers import needs_vm
from tests.shimproc import ShimProcess

pytestmark = [needs_vm, pytest.mark.skipif(bool(why_not()), reason=why_not())]


def _toml(table: dict[str, Any], header: str) -> str:
    """The handler's table and its subtables (strings and numbers: all runv_config has)."""
    lines = [f"[{header}]"] + [f"{k} = {json.dumps(v)}" for k, v in table.items() if not isinstance(v, dict)]
    subs = [_toml(v, f"{header}.{k}") for k, v in table.items() if isinstance(v, dict)]
    return "\n".join(lines) + "\n" + "".join(subs)


class ShimNet(ShimProcess, Net):
    """The network, and a shim on it whose runv handler is the test's."""

    def __init__(self, root: Path, tag: str, octet: int, gateway: bool) -> None:
        super().__init__(root, tag, octet, gateway)
        self.sock = f"{root}/cri.sock"
        self.runv: dict[str, Any] = {}

    def configure(self, runv: dict[str, Any]) -> None:
        self.runv = runv
        handler = {"type": "runv", "pod_network": "cni", **runv}
        (self.root / "cri-shim.toml").write_text(
            f'[server]\nlisten = "unix://{self.sock}"\nstate_dir = "{self.root}/state"\n'
            'default_handler = "runv"\n'
            "[nri]\nenable = false\n"
            f'[cni]\nconf_dir = "{self.conf_dir}"\nbin_dirs = ["{self.bin_dir}", "{PLUGIN_DIR}"]\n'
            "plugin_timeout = 20\n" + _toml(handler, "handlers.runv")
        )

    def pins(self) -> list[str]:
        d = Path(self.runv["root"]) / "netns"
        return sorted(os.listdir(d)) if d.exists() else []

    def vms(self) -> list[str]:
        return sorted(os.listdir(self.runv["run_dir"])) if os.path.isdir(self.runv["run_dir"]) else []


@pytest.fixture
def shim_net(runv_config: dict[str, Any], short_tmp: str) -> Iterator[ShimNet]:
    with own_network(Path(short_tmp), "crrvs", 252, ShimNet, gateway=True) as net:
        net.configure(runv_config)
        try:
            yield net
        finally:
            net.stop()  # what a failed test left: its VMs go with the runv_config fixture
            for pin in net.pins():
                subprocess.run(["umount", "-l", f"{runv_config['root']}/netns/{pin}"], check=False)


async def run_pod(
    rt: api_pb2_grpc.RuntimeServiceStub, name: str, timeout: float | None = None
) -> tuple[str, str]:
    """(pod ID, pod IP)."""
    sc = sandbox_config(name=name, namespace="cni-e2e")
    req = pb.RunPodSandboxRequest(config=sc, runtime_handler="runv")
    pod = (await rt.RunPodSandbox(req, timeout=timeout)).pod_sandbox_id
    ip = (await rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod))).status.network.ip
    return pod, ip


async def listed(rt: api_pb2_grpc.RuntimeServiceStub) -> list[tuple[str, int, str]]:
    """(ID, state, IP) of each pod the shim lists."""
    out = []
    for p in (await rt.ListPodSandbox(pb.ListPodSandboxRequest())).items:
        status = (await rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=p.id))).status
        out.append((p.id, p.state, status.network.ip))
    return out


async def remove_pod(rt: api_pb2_grpc.RuntimeServiceStub, pod: str) -> None:
    await rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod))
    await rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod))


async def test_readiness_a_pod_and_a_refused_add_through_grpc(shim_net: ShimNet) -> None:
    net = shim_net
    net.start()
    async with net.channel() as ch:
        rt = api_pb2_grpc.RuntimeServiceStub(ch)
        status = (await rt.Status(pb.StatusRequest())).status
        ready = next(c for c in status.conditions if c.type == "NetworkReady")
        assert not ready.status and ready.reason == "NetworkPluginNotReady"
        assert str(net.conf_dir) in ready.message
        net.write_conflist()
        status = (await rt.Status(pb.StatusRequest())).status
        assert next(c for c in status.conditions if c.type == "NetworkReady").status  # no restart

        pod, ip = await run_pod(rt, "one")
        assert ip in {str(a) for a in net.subnet.hosts()} and net.reserved() == {ip: pod}
        await remove_pod(rt, pod)

        break_add(net, "fails")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await run_pod(rt, "refused")
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "CNI plugin breaker ADD failed (code 7): refused" in (info.value.details() or "")
        assert await listed(rt) == []
    assert net.reserved() == {} and net.ports() == [] and net.pins() == [] and net.vms() == []
    net.stop()


async def test_sigkill_between_the_add_and_the_record_leaves_nothing_held(shim_net: ShimNet) -> None:
    net = shim_net
    net.write_conflist()
    net.start()
    async with net.channel() as ch:
        rt = api_pb2_grpc.RuntimeServiceStub(ch)
        kept, kept_ip = await run_pod(rt, "kept")
        # From now on an ADD hangs after host-local reserved an address and bridge made the veth.
        pids = break_add(net, "hangs")
        stuck = asyncio.ensure_future(run_pod(rt, "stuck", timeout=60))
        await wait_hung(pids, stuck)
        assert len(net.reserved()) == 2 and len(net.ports()) == 2 and len(net.pins()) == 2
        assert len(net.vms()) == 2
        net.stop(signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError):
            await stuck
    kill_hung(pids)

    net.start()
    async with net.channel() as ch:
        rt = api_pb2_grpc.RuntimeServiceStub(ch)
        assert await listed(rt) == [(kept, pb.SANDBOX_READY, kept_ip)]
        assert net.reserved() == {kept_ip: kept}
        assert len(net.ports()) == 1 and net.pins() == [kept] and net.vms() == [kept[:16]]
        await remove_pod(rt, kept)
    assert net.reserved() == {} and net.ports() == [] and net.pins() == [] and net.vms() == []
    net.stop()
