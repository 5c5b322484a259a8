"""The runv backend (stub driver) with pod_network = "cni": real VMs and Debian's CNI plugins.

Each test has a network of its own (tests/cni/realnet.py): a bridge ``crrv0-<rand>`` with a
gateway address for the host, a /24 of 10.252.0.0/16, host-local's store and the config
directory under tmp; the backend's root, run dir and cgroups are the test's (conftest.py).
All of it, and the iptables rules portmap adds, is removed after; a pinned namespace left
behind fails the test (a mount under the backend's root).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from backends.cni import PluginError
from backends.contract import ContainerRecord, SandboxRecord, errors
from backends.runv import cninet
from backends.runv.agent import messages as m
from backends.runv.backend import RunvBackend
from backends.runv.drivers.qemu import QemuHypervisor
from cri_api import api_pb2 as pb
from tests.cni import fakeplugin
from tests.cni.breaker import HOWS, TIMEOUT, break_add, run_broken
from tests.cni.realnet import PLUGIN_DIR, Net, own_network, run, why_not
from tests.criutil import until
from tests.runv.helpers import Events, MemorySink, container_record, needs_vm, sandbox_record
from tests.runv.test_network import SERVER, _fetch
from tests.runv.test_qemu import _qemu_config, _taps, needs_qemu

pytestmark = [needs_vm, pytest.mark.skipif(bool(why_not()), reason=why_not())]

IMAGE = "test/busybox:1"


class CniNet(Net):
    """The network, and runv backends on it (``config``: the test's runv_config)."""

    config: dict[str, Any]
    rootfs: Path

    def backend(self, **settings: Any) -> RunvBackend:
        cni = {"conf_dir": str(self.conf_dir), "bin_dirs": [str(self.bin_dir), PLUGIN_DIR]}
        cfg = dict(self.config, pod_network="cni", cni=cni | settings.pop("cni", {}), **settings)
        backend = RunvBackend("runv", cfg)
        backend.image_store.import_dir(IMAGE, str(self.rootfs))
        return backend

    @property
    def backend_root(self) -> Path:
        return Path(self.config["root"])

    def pins(self) -> list[str]:
        pin_dir = self.backend_root / "netns"
        return sorted(os.listdir(pin_dir)) if pin_dir.exists() else []

    def cached(self) -> list[str]:
        cache = self.backend_root / "cni"
        return sorted(str(p.relative_to(cache)) for p in cache.rglob("*.json"))

    def vms(self) -> list[str]:
        run_dir = self.config["run_dir"]
        return sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []


@pytest.fixture
async def net(runv_config: dict[str, Any], busybox_rootfs: Path, tmp_path: Path) -> AsyncIterator[CniNet]:
    with own_network(tmp_path / "cni", "crrv", 252, CniNet, gateway=True) as n:
        n.config, n.rootfs = runv_config, busybox_rootfs
        try:
            yield n
        finally:
            for pin in n.pins():  # what a failed test left (the runv_config fixture then fails)
                subprocess.run(["umount", "-l", str(n.backend_root / "netns" / pin)], check=False)


@contextlib.asynccontextmanager
async def running(backend: RunvBackend) -> AsyncIterator[Events]:
    """The backend started; after, its pods' VMs destroyed (a failed test) and it closed."""
    events = Events()
    await backend.lifecycle.start(events)
    try:
        yield events
    finally:
        await events.close()
        for pod in list(backend._shared.pods.values()):
            await backend.hv.destroy(pod.vm)
        await backend.lifecycle.close()


def pod(name: str, **config: Any) -> SandboxRecord:
    sb = sandbox_record(name)
    sb.config.metadata.namespace = "cni-test"
    for key, value in config.items():
        getattr(sb.config, key).extend(value)
    return sb


async def started(backend: RunvBackend, events: Events, sb: SandboxRecord, script: str) -> ContainerRecord:
    ct = container_record(sb, IMAGE, ["sh", "-c", script])
    await backend.lifecycle.create_container(ct, sb)
    await events.start(backend.lifecycle, ct, sb, MemorySink())
    return ct


async def inside(backend: RunvBackend, ct: ContainerRecord, *cmd: str) -> str:
    res = await backend.exec.exec_sync(ct, list(cmd))
    assert res.exit_code == 0, res
    return res.stdout.decode()


async def test_pods_get_addresses_of_the_network_and_reach_each_other(net: CniNet) -> None:
    net.write_conflist()
    backend = net.backend()
    async with running(backend) as events:
        one, two = pod("one"), pod("two")
        ip1, ip2 = (
            (await backend.lifecycle.run_sandbox(one)).ip,
            (await backend.lifecycle.run_sandbox(two)).ip,
        )
        assert ip1 != ip2 and {ip1, ip2} <= {str(a) for a in net.subnet.hosts()}
        assert net.reserved() == {ip1: one.id, ip2: two.id}
        assert len(net.ports()) == 2 and backend.net.bridge_ports() == []  # not on runv's bridge
        assert net.pins() == sorted([one.id, two.id])
        assert net.cached() == sorted(f"runv/{net.network}/{sb.id}/eth0.json" for sb in (one, two))
        # The VM's own namespace is the one CNI wired.
        vm_pid = backend._shared.pods[one.id].vm.pid
        assert os.stat(f"/proc/{vm_pid}/ns/net").st_ino == os.stat(net.backend_root / "netns" / one.id).st_ino

        c1 = await started(backend, events, one, "sleep 3600")
        c2 = await started(backend, events, two, SERVER)
        addr = await inside(backend, c1, "busybox", "ip", "-o", "-4", "addr", "show", "dev", "eth0")
        assert f"inet {ip1}/24" in addr
        assert await inside(backend, c1, "sh", "-c", f"until nc {ip2} 8080; do sleep 0.1; done") == "pong\n"
        assert await _fetch(ip2, 8080) == b"pong\n"  # from the host, through the bridge's gateway

        await backend.lifecycle.stop_sandbox(one)
        assert net.reserved() == {ip2: two.id} and len(net.ports()) == 1 and net.pins() == [two.id]
        await backend.lifecycle.stop_sandbox(one)  # idempotent
        await backend.lifecycle.remove_sandbox(one)
        await backend.lifecycle.remove_container(c1)
        await backend.lifecycle.stop_sandbox(two)
        await backend.lifecycle.remove_sandbox(two)
        await backend.lifecycle.remove_container(c2)
        assert net.reserved() == {} and net.ports() == [] and net.pins() == [] and net.cached() == []
        assert events.not_ready == {}
    assert net.vms() == []


async def test_the_guest_nic_is_given_what_the_namespace_has(net: CniNet) -> None:
    """What qemu's guest is told: eth0's MAC, MTU, global addresses (IPv4 first) and the routes
    not the kernel's own, whichever family."""
    ns = net.netns()
    name = os.path.basename(ns)
    for argv in (
        "link add eth0 mtu 1410 address 0a:58:0a:fc:09:07 type veth peer name peer0",  # no dummy module
        "link set peer0 up",
        "addr add fd00:9::7/64 dev eth0 nodad",
        "addr add 10.252.9.7/24 dev eth0",
        "link set eth0 up",
        "route add default via 10.252.9.1",
        "route add 198.51.100.0/24 via 10.252.9.1",
        "route add 203.0.113.0/24 dev eth0",
        "-6 route add fd01::/64 via fd00:9::1",
    ):
        run("ip", "-n", name, *argv.split())
    req = await cninet.guest_network("ip", ns, "eth0", "eth0")
    assert (req.interface, req.name, req.mtu, req.mac) == ("eth0", "eth0", 1410, "0a:58:0a:fc:09:07")
    assert (req.address, req.more_addresses, req.gateway) == ("10.252.9.7/24", ["fd00:9::7/64"], "")
    assert sorted(req.routes, key=str) == sorted(
        [
            m.Route("default", "10.252.9.1"),
            m.Route("198.51.100.0/24", "10.252.9.1"),
            m.Route("203.0.113.0/24"),
            m.Route("fd01::/64", "fd00:9::1"),
        ],
        key=str,
    )
    with pytest.raises(errors.InternalError, match='Device "eth1" does not exist'):
        await cninet.guest_network("ip", ns, "eth1", "eth0")
    run("ip", "-n", name, "addr", "flush", "dev", "eth0", "scope", "global")
    with pytest.raises(errors.InternalError, match=r"gave eth0 in .* no address"):
        await cninet.guest_network("ip", ns, "eth0", "eth0")


async def test_a_host_port_answers_on_the_host_through_portmap(net: CniNet) -> None:
    net.write_conflist()
    backend = net.backend()
    port = 30000 + secrets.randbelow(2000)
    async with running(backend) as events:
        sb = pod("web", port_mappings=[pb.PortMapping(container_port=8080, host_port=port)])
        await backend.lifecycle.run_sandbox(sb)
        assert await backend.net.rules() == []  # runv's own DNAT is not used
        assert any(f"--dports {port}" in line for _, _, line in net.iptables())
        ct = await started(backend, events, sb, SERVER)
        assert await _fetch("127.0.0.1", port) == b"pong\n"
        await backend.lifecycle.stop_container(ct, 0)
        await backend.lifecycle.stop_sandbox(sb)
        assert net.iptables() == set()
        await backend.lifecycle.remove_sandbox(sb)
        await backend.lifecycle.remove_container(ct)


async def test_host_network_pods_are_not_on_cni(net: CniNet) -> None:
    net.write_conflist()
    backend = net.backend()
    async with running(backend):
        sb = pod("host")
        sb.config.linux.security_context.namespace_options.network = pb.NODE
        assert (await backend.lifecycle.run_sandbox(sb)).ip == ""
        assert "netns" not in sb.backend_data
        assert net.reserved() == {} and net.pins() == [] and net.cached() == []
        await backend.lifecycle.remove_sandbox(sb)


async def test_network_ready_follows_the_config_and_the_pod_cidr_reaches_host_local(net: CniNet) -> None:
    backend = net.backend()
    async with running(backend):
        health = await backend.lifecycle.health()
        assert (health.runtime_ready, health.network_ready) == (True, False)
        assert health.reason == "NetworkPluginNotReady" and str(net.conf_dir) in health.message
        conf = net.conflist(ipam={})  # no ranges of its own: host-local takes the runtime's
        conf["plugins"][1]["capabilities"] = {"ipRanges": True}
        fakeplugin.write_json(net.conf_dir / "10-test.conflist", conf)
        assert (await backend.lifecycle.health()).network_ready
        backend.set_pod_cidr(str(net.subnet))
        sb = pod("ranged")
        ip = (await backend.lifecycle.run_sandbox(sb)).ip
        assert ipaddress.ip_address(ip) in net.subnet and net.reserved() == {ip: sb.id}
        await backend.lifecycle.remove_sandbox(sb)
        assert net.reserved() == {}


@pytest.mark.parametrize("how", HOWS)
async def test_a_plugin_that_fails_or_hangs_leaves_nothing(net: CniNet, how: str) -> None:
    """Also when the client gives up (the call is cancelled) while a plugin runs."""
    pids = break_add(net, how)
    backend = net.backend(cni={"plugin_timeout": TIMEOUT})
    port = 30000 + secrets.randbelow(2000)
    sb = pod("broken", port_mappings=[pb.PortMapping(container_port=80, host_port=port)])
    async with running(backend):
        await run_broken(backend.lifecycle.run_sandbox(sb), how, pids)
        assert backend._shared.pods == {} and backend.hv.capacity()[0] == 0
    assert net.reserved() == {} and net.ports() == [] and net.iptables() == set()
    assert net.pins() == [] and net.cached() == [] and net.vms() == []


async def test_stop_after_the_config_was_removed_frees_the_address(net: CniNet) -> None:
    net.write_conflist()
    backend = net.backend()
    async with running(backend):
        sb = pod("orphan", port_mappings=[pb.PortMapping(container_port=80, host_port=31998)])
        ip = (await backend.lifecycle.run_sandbox(sb)).ip
        assert list(net.reserved()) == [ip]
        (net.conf_dir / "10-test.conflist").unlink()
        assert not (await backend.lifecycle.health()).network_ready
        await backend.lifecycle.stop_sandbox(sb)
        assert net.reserved() == {} and net.ports() == [] and net.iptables() == set()
        await backend.lifecycle.remove_sandbox(sb)


async def test_a_failing_del_fails_the_stop_but_never_the_remove(net: CniNet) -> None:
    fakeplugin.install(net.bin_dir, "breaker")
    net.write_conflist({"type": "breaker", "fake": {"DEL": {"error": {"code": 11, "msg": "busy"}}}})
    backend = net.backend()
    async with running(backend) as events:
        sb = pod("sticky")
        await backend.lifecycle.run_sandbox(sb)
        vm = backend._shared.pods[sb.id].vm
        with pytest.raises(PluginError, match=r"breaker DEL failed \(code 11\): busy"):
            await backend.lifecycle.stop_sandbox(sb)
        assert not backend.hv.alive(vm)  # the pod is stopped all the same
        assert events.not_ready == {sb.id: "CNI DEL failed"}
        with pytest.raises(PluginError):
            await backend.lifecycle.stop_sandbox(sb)  # a stop again DELs again
        await backend.lifecycle.remove_sandbox(sb)  # logs the plugin's failure
        assert net.pins() == []
        # What the DEL could not release stays cached, for the next start's recovery.
        assert net.cached() == [f"runv/{net.network}/{sb.id}/eth0.json"]
    # A start with the plugin gone (a DEL skips what is not installed) releases it.
    (net.bin_dir / "breaker").unlink()
    again = net.backend()
    async with running(again):
        await again.lifecycle.recover([], [])
        assert net.cached() == [] and net.reserved() == {} and net.ports() == []


async def test_a_restart_releases_what_pods_with_no_record_hold(net: CniNet) -> None:
    net.write_conflist()
    first = net.backend()
    await first.lifecycle.start(Events())
    kept, lost = pod("kept"), pod("lost")  # the shim dies after lost's ADD, before its record
    try:
        kept_ip = (await first.lifecycle.run_sandbox(kept)).ip
        kept.committed = True
        lost_ip = (await first.lifecycle.run_sandbox(lost)).ip
        assert net.reserved() == {kept_ip: kept.id, lost_ip: lost.id} and len(net.pins()) == 2
    finally:
        await first.lifecycle.close()  # the shim goes: its VMs stay
    second = net.backend()
    async with running(second):
        seen, _ = await second.lifecycle.recover([kept], [])
        assert seen[kept.id].exists and seen[kept.id].running
        assert net.reserved() == {kept_ip: kept.id} and len(net.ports()) == 1
        assert net.pins() == [kept.id] and net.vms() == [kept.id[:16]]
        await second.lifecycle.stop_sandbox(kept)  # DEL from the cache a previous process wrote
        await second.lifecycle.remove_sandbox(kept)
    assert net.reserved() == {} and net.ports() == [] and net.pins() == [] and net.cached() == []
    assert net.vms() == []


async def test_a_warm_vm_is_added_when_a_pod_takes_it(net: CniNet) -> None:
    net.write_conflist()
    backend = net.backend(pool={"size": 1, "max_cpu": 0})
    async with running(backend) as events:
        await backend.lifecycle.recover([], [])  # starts the pool
        await until(lambda: backend.pool.figures().ready == 1, 30)
        # Warm, it holds nothing of the network: the ADD needs the pod.
        assert net.reserved() == {} and net.ports() == [] and net.pins() == []
        sb = pod("warm")
        ip = (await backend.lifecycle.run_sandbox(sb)).ip
        assert sb.backend_data.get("warm") is True
        assert net.reserved() == {ip: sb.id} and net.pins() == [sb.id]
        ct = await started(backend, events, sb, "sleep 3600")
        addr = await inside(backend, ct, "busybox", "ip", "-o", "-4", "addr", "show", "dev", "eth0")
        assert f"inet {ip}/24" in addr
        await backend.lifecycle.stop_sandbox(sb)
        await backend.lifecycle.remove_sandbox(sb)
        await backend.lifecycle.remove_container(ct)
        assert net.reserved() == {} and net.pins() == []


@pytest.mark.slow
@pytest.mark.qemu
@needs_qemu
@pytest.mark.timeout(600)
async def test_a_qemu_vm_gets_what_cni_gave_its_interface(net: CniNet) -> None:
    """The tap redirected to CNI's eth0 in QEMU's namespace; the guest's NIC with its MAC, MTU,
    address and routes; reached from the host at its IP and at a host port."""
    conf = net.conflist()
    conf["plugins"][1]["mtu"] = 1400
    conf["plugins"][1]["ipam"]["routes"] = [{"dst": "198.51.100.0/24"}]  # via the gateway
    fakeplugin.write_json(net.conf_dir / "10-test.conflist", conf)
    net.config = _qemu_config(net.config)
    backend = net.backend()
    port = 30000 + secrets.randbelow(2000)
    async with running(backend) as events:
        sb = pod("vm", port_mappings=[pb.PortMapping(container_port=8080, host_port=port)])
        ip = (await backend.lifecycle.run_sandbox(sb)).ip
        assert net.reserved() == {ip: sb.id} and len(net.ports()) == 1 and net.pins() == [sb.id]
        vm = backend._shared.pods[sb.id].vm
        assert QemuHypervisor.tap_name(vm.id) not in _taps()  # it is in QEMU's namespace
        pin = str(net.backend_root / "netns" / sb.id)
        assert os.stat(f"/proc/{vm.pid}/ns/net").st_ino == os.stat(pin).st_ino
        [eth0] = json.loads(run("nsenter", f"--net={pin}", "ip", "-j", "link", "show", "eth0"))
        assert eth0["mtu"] == 1400

        ct = await started(backend, events, sb, SERVER)
        link = await inside(backend, ct, "busybox", "ip", "-o", "link", "show", "dev", "eth0")
        assert "mtu 1400" in link and f"link/ether {eth0['address']}" in link
        addr = await inside(backend, ct, "busybox", "ip", "-o", "-4", "addr", "show", "dev", "eth0")
        assert f"inet {ip}/24" in addr
        gateway = str(net.subnet.network_address + 1)
        routes = await inside(backend, ct, "busybox", "ip", "-4", "route")
        assert f"198.51.100.0/24 via {gateway} dev eth0" in routes, routes
        assert await _fetch(ip, 8080, timeout=60) == b"pong\n"
        assert await _fetch("127.0.0.1", port, timeout=60) == b"pong\n"

        await backend.lifecycle.stop_sandbox(sb)
        assert not backend.hv.alive(vm)
        assert net.reserved() == {} and net.ports() == [] and net.pins() == [] and net.iptables() == set()
        await backend.lifecycle.remove_sandbox(sb)
        await backend.lifecycle.remove_container(ct)
    assert net.vms() == [] and net.cached() == []
