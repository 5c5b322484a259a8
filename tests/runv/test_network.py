"""Pod networking of runv: pod IP on the bridge, reachability, host ports, host network, cleanup."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from backends.runv.backend import RunvBackend
from backends.runv.network import BridgeNetwork, host_ports
from cri_api import api_pb2 as pb
from shim.cri import errors
from tests.runv.helpers import Events, MemorySink, container_record, needs_vm, sandbox_record

IMAGE = "test/busybox:1"
# Answers "pong" to every connection on port 8080, from inside the VM.
SERVER = "while true; do echo pong | nc -l -p 8080; done"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _fetch(host: str, port: int, timeout: float = 10.0) -> bytes:
    """Connect until the listener answers; return what it sent."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 2)
            data = await asyncio.wait_for(reader.read(100), 2)
            writer.close()
            await writer.wait_closed()
            if data:
                return data
        except (OSError, TimeoutError):
            pass
        if loop.time() > deadline:
            raise AssertionError(f"nothing answered on {host}:{port}")
        await asyncio.sleep(0.1)


async def _leftovers(backend: RunvBackend, host_if: str) -> dict[str, Any]:
    return {
        "veth": os.path.exists(f"/sys/class/net/{host_if}"),
        "bridge_ports": backend.net.bridge_ports(),
        "rules": await backend.net.rules(),
        "ips": backend.net.in_use(),
    }


CLEAN = {"veth": False, "bridge_ports": [], "rules": [], "ips": {}}


# ---------------------------------------------------------------------- no VM needed


def test_host_ports_selects_published_ipv4_ports() -> None:
    got = host_ports(
        [
            pb.PortMapping(container_port=80),  # container port only
            pb.PortMapping(container_port=80, host_port=8080),
            pb.PortMapping(protocol=pb.UDP, container_port=53, host_port=5353, host_ip="127.0.0.1"),
            pb.PortMapping(container_port=80, host_port=8081, host_ip="0.0.0.0"),
            pb.PortMapping(container_port=80, host_port=8082, host_ip="::1"),  # IPv6: unsupported
        ]
    )
    assert [(p.protocol, p.host_ip, p.host_port, p.container_port) for p in got] == [
        ("tcp", "", 8080, 80),
        ("udp", "127.0.0.1", 5353, 53),
        ("tcp", "", 8081, 80),
    ]
    with pytest.raises(errors.InvalidArgumentError):
        host_ports([pb.PortMapping(container_port=0, host_port=80)])
    with pytest.raises(errors.InvalidArgumentError):
        host_ports([pb.PortMapping(container_port=80, host_port=80, host_ip="nope")])


def test_ipam_allocates_persists_and_releases(tmp_path: Path) -> None:
    cfg = {"subnet": "10.94.0.0/29", "ipam_dir": str(tmp_path), "owner": "a"}
    net = BridgeNetwork(cfg)
    ips = [net.allocate(f"sb{i}") for i in range(5)]
    # .0 network, .1 gateway, .7 broadcast: .2-.6 are the pod IPs.
    assert ips == [f"10.94.0.{i}" for i in range(2, 7)]
    with pytest.raises(errors.ResourceExhaustedError):
        net.allocate("sb5")
    # Another backend sharing the bridge (its own owner) sees them taken, and cannot free them.
    other = BridgeNetwork(dict(cfg, owner="b"))
    with pytest.raises(errors.ResourceExhaustedError):
        other.allocate("x")
    other.release("10.94.0.2", "sb0")
    assert net.in_use()["10.94.0.2"] == "sb0"
    net.release("10.94.0.2", "not-the-holder")
    assert "10.94.0.2" in net.in_use()
    net.release("10.94.0.2", "sb0")
    assert net.allocate("sb6") == "10.94.0.2"
    # A restarted backend (same owner) finds its allocations and drops unknown ones.
    again = BridgeNetwork(cfg)
    assert again.in_use() == {f"10.94.0.{i}": f"sb{i - 2 if i > 2 else 6}" for i in range(2, 7)}
    again.release_unknown({"sb6", "sb1"})
    assert again.in_use() == {"10.94.0.2": "sb6", "10.94.0.3": "sb1"}
    assert other.in_use() == {}


def test_veth_names_fit_ifnamsiz() -> None:
    host, peer = BridgeNetwork.veth_names("0123456789abcdef")
    assert (host, peer) == ("rv0123456789abc", "rp0123456789abc")
    assert len(host) <= 15 and len(peer) <= 15


# ---------------------------------------------------------------------- real VMs


@needs_vm
async def test_pod_ip_reachable_host_port_and_cleanup(runv: tuple[RunvBackend, Events]) -> None:
    backend, events = runv
    hport = _free_port()
    sb = sandbox_record("net")
    sb.config.port_mappings.add(container_port=8080, host_port=hport)
    net = await backend.lifecycle.run_sandbox(sb)
    ip = net.ip
    assert ipaddress.ip_address(ip) in backend.net.subnet and ip != backend.net.gateway
    data = sb.backend_data["net"]
    assert data["ip"] == ip and data["ports"][0]["host_port"] == hport
    host_if = data["host_if"]
    assert backend.net.bridge_ports() == [host_if]
    assert backend.net.in_use() == {ip: sb.id}
    assert len(await backend.net.rules()) == 1

    ct = container_record(sb, IMAGE, ["sh", "-c", SERVER])
    await backend.lifecycle.create_container(ct, sb)
    await events.start(backend.lifecycle, ct, sb, MemorySink())
    # Inside: eth0 with the pod IP and a default route via the gateway.
    res = await backend.exec.exec_sync(ct, ["sh", "-c", "ip addr show eth0; ip route"])
    if res.exit_code == 0:  # busybox has the ip applet only when built with it
        assert f"inet {ip}/{backend.net.prefix}" in res.stdout.decode()
        assert f"default via {backend.net.gateway}" in res.stdout.decode()
    ifaces = await backend.exec.exec_sync(ct, ["cat", "/proc/net/dev"])
    assert b"eth0:" in ifaces.stdout

    assert await _fetch(ip, 8080) == b"pong\n"  # the pod IP, from the host
    assert await _fetch("127.0.0.1", hport) == b"pong\n"  # the host port on loopback

    # A second pod gets another IP and cannot take the same host port.
    sb2 = sandbox_record("net2")
    sb2.config.port_mappings.add(container_port=8080, host_port=hport)
    with pytest.raises(errors.InvalidArgumentError):
        await backend.lifecycle.run_sandbox(sb2)
    assert backend.net.bridge_ports() == [host_if]  # the failed pod left nothing
    assert backend.net.in_use() == {ip: sb.id}
    sb3 = sandbox_record("net3")
    net3 = await backend.lifecycle.run_sandbox(sb3)
    assert net3.ip not in ("", ip)

    await backend.lifecycle.stop_sandbox(sb)
    assert await _leftovers(backend, host_if) == dict(
        CLEAN, ips={net3.ip: sb3.id}, bridge_ports=[sb3.backend_data["net"]["host_if"]]
    )
    with pytest.raises(OSError):
        await asyncio.wait_for(asyncio.open_connection("127.0.0.1", hport), 2)
    await backend.lifecycle.stop_sandbox(sb)  # idempotent
    await backend.lifecycle.remove_sandbox(sb)
    await backend.lifecycle.remove_sandbox(sb3)
    assert await _leftovers(backend, sb3.backend_data.get("net", {}).get("host_if", "x")) == CLEAN


@needs_vm
async def test_host_network_pod(runv: tuple[RunvBackend, Events]) -> None:
    backend, _events = runv
    sb = sandbox_record("hostnet")
    sb.config.linux.security_context.namespace_options.network = pb.NODE
    sb.config.port_mappings.add(container_port=8080, host_port=_free_port())  # nothing to map
    net = await backend.lifecycle.run_sandbox(sb)
    assert net.ip == ""
    assert "net" not in sb.backend_data
    vm_pid = backend._shared.pods[sb.id].vm.pid
    assert os.readlink(f"/proc/{vm_pid}/ns/net") == os.readlink("/proc/self/ns/net")
    assert backend.net.bridge_ports() == [] and await backend.net.rules() == []
    await backend.lifecycle.remove_sandbox(sb)

    bad = sandbox_record("hostnet-sysctl")
    bad.config.linux.security_context.namespace_options.network = pb.NODE
    bad.config.linux.sysctls["net.ipv4.ip_forward"] = "1"
    with pytest.raises(errors.InvalidArgumentError):
        await backend.lifecycle.run_sandbox(bad)


@needs_vm
async def test_network_survives_restart(runv_config: dict[str, Any], busybox_rootfs: Path) -> None:
    first = RunvBackend("runv", dict(runv_config))
    ev1 = Events()
    await first.lifecycle.start(ev1)
    first.image_store.import_dir(IMAGE, str(busybox_rootfs))
    hport = _free_port()
    sb = sandbox_record("netrestart")
    sb.config.port_mappings.add(container_port=8080, host_port=hport)
    ip = (await first.lifecycle.run_sandbox(sb)).ip
    sb.committed = True
    ct = container_record(sb, IMAGE, ["sh", "-c", SERVER])
    await first.lifecycle.create_container(ct, sb)
    await ev1.start(first.lifecycle, ct, sb, MemorySink())
    ct.committed = True
    # A pod of an earlier shim whose record is gone: its rule and IP are collected at recovery.
    ghost = sandbox_record("ghost")
    await first.net.add_host_ports(
        ghost.id, "10.255.255.254", host_ports([pb.PortMapping(container_port=1, host_port=_free_port())])
    )
    first.net.reserve(ghost.id, "10.255.255.254")
    await ev1.close()
    await first.lifecycle.close()
    assert await _fetch("127.0.0.1", hport) == b"pong\n"  # no shim: the kernel still forwards

    second = RunvBackend("runv", dict(runv_config))
    await second.lifecycle.start(Events())
    try:
        sb_obs, _ = await second.lifecycle.recover([sb], [ct])
        assert sb_obs[sb.id].running
        assert second.net.in_use() == {ip: sb.id}
        assert len(await second.net.rules()) == 1
        assert await _fetch(ip, 8080) == b"pong\n"
        # The recovered IP is not handed out again.
        other = sandbox_record("other")
        assert (await second.lifecycle.run_sandbox(other)).ip != ip
        await second.lifecycle.remove_sandbox(other)
        await second.lifecycle.stop_sandbox(sb)
        assert await _leftovers(second, sb.backend_data.get("net", {}).get("host_if", "x")) == CLEAN
    finally:
        for pod in list(second._shared.pods.values()):
            await second.hv.destroy(pod.vm)
        await second.lifecycle.close()
