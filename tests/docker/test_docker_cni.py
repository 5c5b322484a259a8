"""The docker backend with pod_network = "cni": a real engine and Debian's CNI plugins.

Each test has a network of its own (tests/cni/realnet.py): a bridge ``crcni0-<rand>`` with a
gateway address for the host, a /24 of 10.251.0.0/16, host-local's store, the config
directory and the backend's state under tmp; all of it, the pods' containers and the
iptables rules portmap adds are removed after.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import docker
import pytest

from backends.cni import PluginError
from backends.contract import ContainerRecord, SandboxRecord, SandboxStatus
from backends.docker import DockerBackend, create
from cri_api import api_pb2 as pb
from tests.cni import fakeplugin
from tests.cni.breaker import HOWS, TIMEOUT, break_add, run_broken
from tests.cni.realnet import PLUGIN_DIR, Net, own_network, run, why_not
from tests.docker.dockerkit import (
    ENDPOINT,
    INSTANCE,
    PAUSE,
    Events,
    Harness,
    HttpGet,
    container_record,
    harnessed,
    sandbox_record,
)

pytestmark = [pytest.mark.docker, pytest.mark.skipif(bool(why_not()), reason=why_not())]


class CniNet(Net):
    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    def backend(self, **cni: Any) -> DockerBackend:
        table = {"conf_dir": str(self.conf_dir), "bin_dirs": [str(self.bin_dir), PLUGIN_DIR]} | cni
        return create(
            "docker",
            {
                "endpoint": ENDPOINT,
                "pause_image": PAUSE,
                "instance": INSTANCE,
                "state_dir": str(self.state_dir),
                "pod_network": "cni",
                "cni": table,
            },
        )

    def pins(self) -> list[str]:
        d = self.state_dir / "netns"
        return sorted(os.listdir(d)) if d.exists() else []

    def cached(self) -> list[str]:
        return sorted(
            str(p.relative_to(self.state_dir / "cni")) for p in (self.state_dir / "cni").rglob("*.json")
        )


@pytest.fixture
async def net(engine: docker.APIClient, tmp_path: Path) -> AsyncIterator[CniNet]:
    with own_network(tmp_path, "crcni", 251, CniNet, gateway=True) as n:
        yield n


@pytest.fixture
async def pods(engine: docker.APIClient, net: CniNet) -> AsyncIterator[Harness]:
    net.write_conflist()
    async with harnessed(net.backend(), engine) as h:
        yield h
    assert net.pins() == []


def pod(name: str, **config: Any) -> SandboxRecord:
    sb = sandbox_record(name, **config)
    sb.config.metadata.namespace = "cni-test"
    return sb


async def started(h: Harness, sb: SandboxRecord, command: list[str]) -> ContainerRecord:
    ct = await h.create(container_record(sb, command), sb)
    await h.events.start(h.backend.lifecycle, ct, sb)
    return ct


async def eth0(h: Harness, ct: ContainerRecord) -> str:
    out = await h.backend.exec.exec_sync(ct, ["ip", "-o", "-4", "addr", "show", "dev", "eth0"])
    assert out.exit_code == 0, out
    return out.stdout.decode().split()[3]


async def test_pods_get_addresses_of_the_network_and_reach_each_other(pods: Harness, net: CniNet) -> None:
    one = await pods.run_sandbox(pod("one"))
    two = await pods.run_sandbox(pod("two"))
    ip1, ip2 = one.status.ip, two.status.ip
    assert ip1 != ip2 and {ip1, ip2} <= {str(a) for a in net.subnet.hosts()}
    assert net.reserved() == {ip1: one.id, ip2: two.id}
    assert len(net.ports()) == 2
    assert net.pins() == sorted([one.id, two.id])
    info = pods.engine.inspect_container(one.backend_data["engine_id"])
    assert info["HostConfig"]["NetworkMode"] == "none"

    c1 = await started(pods, one, ["sleep", "3600"])
    c2 = await started(pods, two, ["sleep", "3600"])
    assert await eth0(pods, c1) == f"{ip1}/24"  # the app container is in the pod's namespace
    assert await eth0(pods, c2) == f"{ip2}/24"
    ping = await pods.backend.exec.exec_sync(c1, ["ping", "-c1", "-W5", ip2])
    assert ping.exit_code == 0, ping

    await pods.backend.lifecycle.stop_container(c1, 0)
    await pods.backend.lifecycle.stop_sandbox(one)
    assert net.reserved() == {ip2: two.id}
    assert len(net.ports()) == 1
    assert net.pins() == [two.id]
    await pods.backend.lifecycle.stop_sandbox(one)  # idempotent
    await pods.backend.lifecycle.remove_container(c1)
    await pods.backend.lifecycle.remove_sandbox(one)
    await pods.backend.lifecycle.stop_container(c2, 0)
    await pods.backend.lifecycle.stop_sandbox(two)
    await pods.backend.lifecycle.remove_container(c2)
    await pods.backend.lifecycle.remove_sandbox(two)
    assert net.reserved() == {}
    assert net.ports() == []
    assert net.cached() == []
    assert pods.events.not_ready == {}


async def test_the_engine_makes_no_network_and_the_pod_has_its_own_files(
    pods: Harness, net: CniNet, tmp_path: Path
) -> None:
    dns = pb.DNSConfig(servers=["10.96.0.10"], searches=["ns.svc.cluster.local"], options=["ndots:5"])
    sb = await pods.run_sandbox(pod("files", dns_config=dns))
    info = pods.engine.inspect_container(sb.backend_data["engine_id"])
    # No engine network at all: no network sandbox, no files of the engine's.
    assert info["Config"].get("NetworkDisabled") is True
    assert info["NetworkSettings"]["SandboxKey"] == "" and info["ResolvConfPath"] == ""
    files = net.state_dir / "pod-files" / sb.id
    assert sorted(os.listdir(files)) == ["hosts", "resolv.conf"]

    show = ["sh", "-c", "hostname; cat /etc/resolv.conf; cat /etc/hosts"]
    ct = await started(pods, sb, ["sleep", "3600"])
    out = await pods.backend.exec.exec_sync(ct, show)
    assert out.exit_code == 0, out
    text = out.stdout.decode()
    assert text.startswith("files\n")
    assert "search ns.svc.cluster.local\nnameserver 10.96.0.10\noptions ndots:5\n" in text
    assert "127.0.0.1\tlocalhost\n" in text
    assert await eth0(pods, ct) == f"{sb.status.ip}/24"

    # A hosts file of the container's own (the kubelet mounts one) wins over the pod's.
    own = tmp_path / "etc-hosts"
    own.write_text("10.1.2.3\tfiles\n")
    mounted = container_record(
        sb, ["sleep", "3600"], name="m", mounts=[pb.Mount(container_path="/etc/hosts", host_path=str(own))]
    )
    await pods.create(mounted, sb)
    await pods.events.start(pods.backend.lifecycle, mounted, sb)
    out = await pods.backend.exec.exec_sync(mounted, ["cat", "/etc/hosts", "/etc/resolv.conf"])
    assert out.exit_code == 0, out
    assert out.stdout.decode().startswith("10.1.2.3\tfiles\nsearch ns.svc.cluster.local\n")

    for c in (ct, mounted):
        await pods.backend.lifecycle.stop_container(c, 0)
    await pods.backend.lifecycle.stop_sandbox(sb)
    for c in (ct, mounted):
        await pods.backend.lifecycle.remove_container(c)
    await pods.backend.lifecycle.remove_sandbox(sb)
    assert not files.exists()


async def test_a_host_port_answers_on_the_host_and_port_forward_reaches_the_pod(
    pods: Harness, net: CniNet
) -> None:
    port = 30000 + secrets.randbelow(2000)
    sb = await pods.run_sandbox(
        pod("web", port_mappings=[pb.PortMapping(container_port=8080, host_port=port)])
    )
    # portmap publishes the port, not the engine.
    assert pods.engine.inspect_container(sb.backend_data["engine_id"])["HostConfig"]["PortBindings"] == {}
    ct = await started(pods, sb, ["sh", "-c", "echo pong > /tmp/index.html; httpd -f -p 8080 -h /tmp"])
    await pods.backend.exec.exec_sync(
        ct, ["sh", "-c", "until wget -q -O /dev/null http://127.0.0.1:8080/index.html; do sleep 0.1; done"]
    )

    def fetch() -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/index.html", timeout=10) as r:
            return bytes(r.read())

    assert await asyncio.to_thread(fetch) == b"pong\n"
    assert any(f"--dports {port}" in line for _, _, line in net.iptables())

    conn = HttpGet("/index.html")
    await asyncio.wait_for(pods.backend.exec.port_forward(sb, 8080, conn), 10)
    assert conn.got.endswith(b"pong\n"), bytes(conn.got)

    await pods.backend.lifecycle.stop_container(ct, 0)
    await pods.backend.lifecycle.stop_sandbox(sb)
    assert net.iptables() == set()


async def test_bandwidth_annotations_reach_the_bandwidth_plugin(
    engine: docker.APIClient, net: CniNet
) -> None:
    net.write_conflist({"type": "bandwidth", "capabilities": {"bandwidth": True}})
    async with harnessed(net.backend(), engine) as h:
        sb = pod("shaped")
        sb.config.annotations["kubernetes.io/ingress-bandwidth"] = "10M"
        sb.config.annotations["kubernetes.io/egress-bandwidth"] = "20M"
        await h.run_sandbox(sb)
        [veth] = net.ports()
        qdiscs = run("tc", "qdisc", "show", "dev", veth)
        # Traffic to the pod leaves the host through its veth, shaped there; traffic from it is
        # redirected from the veth's ingress to a device shaped at 20 Mbit.
        assert "tbf" in qdiscs and "rate 10Mbit" in qdiscs and "qdisc ingress" in qdiscs, qdiscs
        assert "rate 20Mbit" in run("tc", "qdisc", "show")
    assert "rate 20Mbit" not in run("tc", "qdisc", "show")


async def test_host_network_pods_are_not_on_cni(pods: Harness, net: CniNet) -> None:
    sb = pod("host")
    sb.config.linux.security_context.namespace_options.network = pb.NODE
    sb.config.ClearField("hostname")
    await pods.run_sandbox(sb)
    assert sb.status.ip == "" and "netns" not in sb.backend_data
    assert net.reserved() == {} and net.pins() == [] and net.cached() == []


async def test_network_ready_follows_the_config_without_a_restart(
    engine: docker.APIClient, net: CniNet
) -> None:
    backend = net.backend()
    await backend.lifecycle.start(Events())
    try:
        health = await backend.lifecycle.health()
        assert (health.runtime_ready, health.network_ready) == (True, False)
        assert health.reason == "NetworkPluginNotReady" and str(net.conf_dir) in health.message
        net.write_conflist()
        health = await backend.lifecycle.health()
        assert (health.runtime_ready, health.network_ready) == (True, True)
        (net.conf_dir / "10-test.conflist").write_text("{")
        assert "invalid JSON" in (await backend.lifecycle.health()).message
    finally:
        await backend.lifecycle.close()


async def test_the_pod_cidr_reaches_host_local_as_ip_ranges(engine: docker.APIClient, net: CniNet) -> None:
    conf = net.conflist(ipam={})  # no ranges of its own: host-local takes the runtime's
    conf["plugins"][1]["capabilities"] = {"ipRanges": True}
    fakeplugin.write_json(net.conf_dir / "10-test.conflist", conf)
    async with harnessed(net.backend(), engine) as h:
        h.backend.set_pod_cidr(str(net.subnet))
        sb = await h.run_sandbox(pod("ranged"))
        assert net.reserved() == {sb.status.ip: sb.id}
    assert net.reserved() == {}


@pytest.mark.parametrize("how", HOWS)
async def test_a_plugin_that_fails_or_hangs_leaves_nothing(
    engine: docker.APIClient, net: CniNet, how: str
) -> None:
    """Also when the client gives up (the call is cancelled) while a plugin runs."""
    pids = break_add(net, how)
    backend = net.backend(plugin_timeout=TIMEOUT)
    await backend.lifecycle.start(Events())
    sb = pod(
        "broken", port_mappings=[pb.PortMapping(container_port=80, host_port=30000 + secrets.randbelow(2000))]
    )
    try:
        await run_broken(backend.lifecycle.run_sandbox(sb), how, pids)
    finally:
        await backend.lifecycle.close()
    assert net.reserved() == {}
    assert net.ports() == []
    assert net.iptables() == set()
    assert net.pins() == [] and net.cached() == []
    assert engine.containers(all=True, filters={"label": f"io.cri-shim.id={sb.id}"}) == []
    assert "engine_id" not in sb.backend_data
    assert not (net.state_dir / "pod-files" / sb.id).exists() and "pod_files" not in sb.backend_data


async def test_stop_after_the_config_was_removed_frees_the_address(pods: Harness, net: CniNet) -> None:
    sb = await pods.run_sandbox(
        pod("orphan", port_mappings=[pb.PortMapping(container_port=80, host_port=31999)])
    )
    assert list(net.reserved()) == [sb.status.ip]
    (net.conf_dir / "10-test.conflist").unlink()
    assert not (await pods.backend.lifecycle.health()).network_ready
    await pods.backend.lifecycle.stop_sandbox(sb)
    assert net.reserved() == {} and net.ports() == [] and net.iptables() == set()
    await pods.backend.lifecycle.remove_sandbox(sb)


async def test_a_failing_del_fails_the_stop_but_never_the_remove(pods: Harness, net: CniNet) -> None:
    fakeplugin.install(net.bin_dir, "breaker")
    net.write_conflist({"type": "breaker", "fake": {"DEL": {"error": {"code": 11, "msg": "busy"}}}})
    sb = await pods.run_sandbox(pod("sticky"))
    with pytest.raises(PluginError, match=r"breaker DEL failed \(code 11\): busy"):
        await pods.backend.lifecycle.stop_sandbox(sb)
    eid = sb.backend_data["engine_id"]
    assert not pods.engine.inspect_container(eid)["State"]["Running"]  # the pod is stopped all the same
    assert pods.events.not_ready == {sb.id: "CNI DEL failed"}  # so a remove needs no stop first
    with pytest.raises(PluginError):
        await pods.backend.lifecycle.stop_sandbox(sb)  # a stop again DELs again
    await pods.backend.lifecycle.remove_sandbox(sb)  # logs the plugin's failure
    with pytest.raises(docker.errors.NotFound):
        pods.engine.inspect_container(eid)
    assert net.pins() == []
    # What the DEL could not release stays cached, for the next start's recovery.
    assert net.cached() == [f"docker/{net.network}/{sb.id}/eth0.json"]
    pods.sandboxes.remove(sb)


async def test_a_restart_releases_what_pods_with_no_record_hold(
    engine: docker.APIClient, net: CniNet
) -> None:
    net.write_conflist()
    async with harnessed(net.backend(), engine) as h:
        kept = await h.run_sandbox(pod("kept"))
        lost = pod("lost")  # the shim dies after its ADD, before its record is committed
        lost_ip = (await h.backend.lifecycle.run_sandbox(lost)).ip
        assert net.reserved() == {kept.status.ip: kept.id, lost_ip: lost.id}
        assert len(net.pins()) == 2

        await h.backend.lifecycle.close()  # the shim dies
        h.backend = net.backend()  # and starts again: nothing in memory
        await h.backend.lifecycle.start(h.events)
        seen, _ = await h.backend.lifecycle.recover([kept], [])
        assert seen[kept.id].exists and seen[kept.id].running
        assert seen[kept.id].status == SandboxStatus(ready=True, ip=kept.status.ip)
        assert net.reserved() == {kept.status.ip: kept.id}
        assert net.pins() == [kept.id] and len(net.ports()) == 1
        assert engine.containers(all=True, filters={"label": f"io.cri-shim.id={lost.id}"}) == []
        assert os.listdir(net.state_dir / "pod-files") == [kept.id]  # the lost pod's files swept
        await h.backend.lifecycle.stop_sandbox(kept)  # DEL from the cache a previous process wrote
        assert net.reserved() == {} and net.ports() == []
    assert net.pins() == [] and net.cached() == []
