"""Warm VMs: the pool itself (no VMs), and the runv backend handing them out (real stub VMs)."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from backends.contract.errors import InvalidArgumentError
from backends.runv.backend import RunvBackend
from backends.runv.hypervisor import MIB
from backends.runv.pool import CpuMeter, Pool, PoolConfig
from shim.cri import errors
from tests.criutil import until
from tests.runv.helpers import Events, MemorySink, container_record, needs_vm, sandbox_record

IMAGE = "test/busybox:1"


# ---------------------------------------------------------------- the pool alone


class Maker:
    """Items are numbers; boots take ``delay`` s and fail while ``fail`` is set."""

    def __init__(self, delay: float = 0.01) -> None:
        self.delay = delay
        self.fail = False
        self.busy = False
        self.counter = itertools.count(1)
        self.discarded: list[int] = []
        self.dead: set[int] = set()
        self.boots = 0

    async def boot(self) -> int:
        self.boots += 1
        await asyncio.sleep(self.delay)
        if self.fail:
            raise RuntimeError("no VM today")
        return next(self.counter)

    async def discard(self, item: int) -> None:
        self.discarded.append(item)

    def pool(self, size: int) -> Pool[int]:
        return Pool(size, self.boot, self.discard, lambda i: i not in self.dead, lambda: self.busy, 0.0)


async def test_the_pool_fills_hands_out_at_once_and_refills() -> None:
    maker = Maker()
    pool = maker.pool(3)
    assert pool.take() is None  # empty: never waits, and starts the refill
    await until(lambda: len(pool.ready) == 3)
    assert [pool.take(), pool.take()] == [1, 2]
    await until(lambda: len(pool.ready) == 3)
    assert list(pool.ready) == [3, 4, 5]
    await asyncio.sleep(0.05)
    assert maker.boots == 5  # never more than the size
    await pool.close()
    assert maker.discarded == [3, 4, 5]


async def test_a_dead_ready_item_is_discarded_not_handed_out() -> None:
    maker = Maker()
    pool = maker.pool(2)
    pool.start()
    await until(lambda: len(pool.ready) == 2)
    maker.dead.add(1)
    assert pool.take() == 2
    await until(lambda: maker.discarded == [1])
    await pool.close()


async def test_refill_waits_while_the_node_is_busy() -> None:
    maker = Maker()
    maker.busy = True
    pool = maker.pool(2)
    pool.start()
    await asyncio.sleep(0.2)
    assert maker.boots == 0 and not pool.ready
    maker.busy = False
    await until(lambda: len(pool.ready) == 2)
    await pool.close()


async def test_boot_failures_back_off_and_the_pool_recovers(monkeypatch: pytest.MonkeyPatch) -> None:
    import backends.contract.pool as pool_module

    monkeypatch.setattr(pool_module, "RETRY_MAX", 0.05)
    maker = Maker()
    maker.fail = True
    pool = maker.pool(1)
    pool.start()
    await until(lambda: maker.boots >= 3)
    assert pool.take() is None
    maker.fail = False
    await until(lambda: len(pool.ready) == 1)
    assert pool.boot_failures == 0
    await pool.close()


async def test_give_back_one_and_a_size_of_zero() -> None:
    maker = Maker()
    pool = maker.pool(2)
    pool.start()
    await until(lambda: len(pool.ready) == 2)
    assert await pool.give_back_one()
    assert maker.discarded == [2]
    await pool.close()
    assert not await pool.give_back_one()
    idle = maker.pool(0)
    assert idle.take() is None
    await asyncio.sleep(0.05)
    # Given back for a cold boot's room: not booted again until the next take; a
    # pool of size 0 boots nothing.
    assert maker.boots == 2


def test_the_cpu_meter_sees_a_busy_cpu() -> None:
    meter = CpuMeter()
    assert meter.busy() == 0.0  # nothing to compare with yet
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass  # one CPU fully busy
    share = meter.busy()
    assert 0.9 / (os.cpu_count() or 1) <= share <= 1.0


def test_pool_config_defaults_and_keys() -> None:
    assert PoolConfig.from_table(None).size == 0
    assert PoolConfig.from_table(None).max_cpu == 0.8
    assert PoolConfig.from_table({"size": 4, "max_cpu": 0}).size == 4
    with pytest.raises(InvalidArgumentError, match=r"\[handlers.runv.pool\] unknown key 'sise'"):
        PoolConfig.from_table({"sise": 4})


# ---------------------------------------------------------------- warm VMs in the backend


@pytest.fixture
async def warm(
    runv_config: dict[str, Any], busybox_rootfs: Path
) -> AsyncIterator[tuple[RunvBackend, Events]]:
    runv_config["pool"] = {"size": 2, "max_cpu": 0, "refill_interval": 0}
    backend = RunvBackend("runv", runv_config)
    events = Events()
    await backend.lifecycle.start(events)
    backend.image_store.import_dir(IMAGE, str(busybox_rootfs), {"Env": ["IMAGE_ENV=1"]})
    await backend.lifecycle.recover([], [])  # the pool starts after recovery
    try:
        yield backend, events
    finally:
        await events.close()
        for pod in list(backend._shared.pods.values()):
            await backend.hv.destroy(pod.vm)
        await backend.lifecycle.close()


async def identity(backend: RunvBackend, events: Events, sb: Any) -> dict[str, str]:
    """What a container of the pod sees: hostname, DNS, its address and a sysctl."""
    ct = container_record(sb, IMAGE, ["sleep", "60"], name="probe")
    await backend.lifecycle.create_container(ct, sb)
    await events.start(backend.lifecycle, ct, sb, MemorySink())
    script = "hostname; cat /proc/sys/net/ipv4/ip_unprivileged_port_start; cat /etc/resolv.conf"
    res = await backend.exec.exec_sync(ct, ["sh", "-c", script])
    assert res.exit_code == 0, res
    hostname, port_start, *dns = res.stdout.decode().splitlines()
    await backend.lifecycle.stop_container(ct, 1)
    await backend.lifecycle.remove_container(ct)
    return {"hostname": hostname, "dns": " ".join(dns), "sysctl": port_start}


@needs_vm
async def test_a_warm_vm_is_handed_out_and_becomes_the_pod(warm: tuple[RunvBackend, Events]) -> None:
    backend, events = warm
    await until(lambda: len(backend.pool.ready) == 2, 30)
    pooled = {pod.vm.id for pod in backend.pool.ready}
    assert backend._shared.pods == {}  # no pod owns a warm VM
    used_vcpus = backend.hv.capacity()[0]
    assert used_vcpus == 2  # they count against the node's capacity

    sb = sandbox_record("warm-pod")
    sb.config.linux.sysctls["net.ipv4.ip_unprivileged_port_start"] = "80"
    t0 = time.perf_counter()
    net = await backend.lifecycle.run_sandbox(sb)
    warm_ms = (time.perf_counter() - t0) * 1000
    assert sb.backend_data.get("warm") is True
    assert sb.backend_data["vm"]["id"] in pooled
    assert net.ip and net.ip == sb.backend_data["net"]["ip"]

    cold = sandbox_record("cold-pod", memory_limit_in_bytes=64 * MIB)  # smaller than the pool's shape: cold
    cold.config.linux.sysctls["net.ipv4.ip_unprivileged_port_start"] = "80"
    await backend.lifecycle.run_sandbox(cold)
    assert "warm" not in cold.backend_data

    # Indistinguishable to the pod: its own hostname, DNS, address and sysctls.
    seen_warm = await identity(backend, events, sb)
    seen_cold = await identity(backend, events, cold)
    assert seen_warm == {"hostname": "warm-pod", "dns": seen_cold["dns"], "sysctl": "80"}
    assert seen_cold["hostname"] == "cold-pod" and "nameserver 10.0.0.10" in seen_cold["dns"]
    print(f"RunPodSandbox warm: {warm_ms:.1f} ms")

    # The pool refills; a bigger pod takes a warm VM and has it hot-plugged to its size.
    await until(lambda: len(backend.pool.ready) == 2, 30)
    big = sandbox_record("big-pod", cpu_quota=200_000, cpu_period=100_000, memory_limit_in_bytes=256 * MIB)
    await backend.lifecycle.run_sandbox(big)
    assert big.backend_data.get("warm") is True
    vm = backend._shared.pods[big.id].vm
    assert vm.vcpus == 2 and vm.memory_bytes == 256 * MIB + backend.overhead_memory
    assert big.backend_data["vm"]["vcpus"] == 2

    for s in (sb, cold, big):
        await backend.lifecycle.stop_sandbox(s)
        await backend.lifecycle.remove_sandbox(s)


@needs_vm
async def test_a_cold_boot_on_a_full_node_takes_the_room_of_warm_vms(
    warm: tuple[RunvBackend, Events],
) -> None:
    backend, _ = warm
    await until(lambda: len(backend.pool.ready) == 2, 30)
    # 4 vCPUs on this node, 2 held by warm VMs: a 3-vCPU pod needs one of them back.
    sb = sandbox_record("needs-room", cpu_quota=300_000, cpu_period=100_000, memory_limit_in_bytes=64 * MIB)
    await backend.lifecycle.run_sandbox(sb)
    assert "warm" not in sb.backend_data
    assert len(backend.pool.ready) <= 1
    await backend.lifecycle.stop_sandbox(sb)
    await backend.lifecycle.remove_sandbox(sb)
    # Nothing can make room for what the node cannot hold at all.
    with pytest.raises(errors.ResourceExhaustedError):
        await backend.lifecycle.run_sandbox(sandbox_record("too-big", cpu_quota=900_000, cpu_period=100_000))


@needs_vm
async def test_warm_vms_of_a_killed_shim_are_reclaimed(
    runv_config: dict[str, Any], busybox_rootfs: Path
) -> None:
    runv_config["pool"] = {"size": 2, "max_cpu": 0, "refill_interval": 0}
    first = RunvBackend("runv", runv_config)
    await first.lifecycle.start(Events())
    await first.lifecycle.recover([], [])
    await until(lambda: len(first.pool.ready) == 2, 30)
    orphans = [pod.vm for pod in first.pool.ready]
    # A SIGKILL: the process is gone, its VMs are not; nothing of `first` runs again.
    if first.pool._task is not None:
        first.pool._task.cancel()
    for pod in first.pool.ready:
        assert pod.agent is not None
        await pod.agent.close()
    first.pool.ready.clear()

    runv_config["pool"] = {"size": 0}
    second = RunvBackend("runv", runv_config)
    await second.lifecycle.start(Events())
    await second.lifecycle.recover([], [])
    try:
        for vm in orphans:
            assert not second.hv.alive(vm)
            assert second.net.veth_names(vm.id)[0] not in second.net.bridge_ports()
        assert second.hv.capacity()[0] == 0
        assert second.net.in_use() == {}  # the warm VMs' IPs are free again
    finally:
        await second.lifecycle.close()


# ---------------------------------------------------------------- through the CRI


@needs_vm
async def test_warm_and_cold_pods_look_the_same_to_every_cri_call(
    runv_config: dict[str, Any], busybox_rootfs: Path, short_tmp: str
) -> None:
    """Two pods of one shape, one on a warm VM and one booted cold: status, IP, hostname, DNS,
    published port, sysctls, stats and lists show no difference but names and addresses."""
    import dataclasses
    import json

    import grpc

    from cri_api import api_pb2 as pb
    from cri_api import api_pb2_grpc
    from shim.server import Server
    from tests.conftest import make_ids, server_config
    from tests.runv.test_network import SERVER, _fetch, _free_port

    runv_config["pool"] = {"size": 1, "max_cpu": 0, "refill_interval": 0}
    backend = RunvBackend("runv", runv_config)
    backend.image_store.import_dir(IMAGE, str(busybox_rootfs), {})
    cfg = dataclasses.replace(server_config(short_tmp, default_handler="runv"), handlers={})
    server = Server(cfg, backends={"runv": backend}, id_factory=make_ids("warmcri"))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{short_tmp}/cri.sock") as ch:
            rt = api_pb2_grpc.RuntimeServiceStub(ch)
            await until(lambda: len(backend.pool.ready) == 1, 30)
            seen: dict[str, dict[str, Any]] = {}
            for name in ("warm", "cold"):
                port = _free_port()
                sc = pb.PodSandboxConfig(
                    metadata=pb.PodSandboxMetadata(name=name, uid=f"{name}-uid", namespace="default"),
                    hostname=f"{name}-host",
                    log_directory=os.path.join(short_tmp, "logs", name),
                    dns_config=pb.DNSConfig(
                        servers=["10.0.0.10"], searches=["svc.local"], options=["ndots:5"]
                    ),
                    port_mappings=[pb.PortMapping(container_port=8080, host_port=port)],
                )
                sc.linux.sysctls["net.ipv4.ip_unprivileged_port_start"] = "80"
                pod = (await rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
                if name == "warm":
                    # The next pod boots cold: no refill, and nothing the refill made meanwhile.
                    backend.pool.size = 0
                    await until(lambda: not backend.pool.booting, 30)
                    while await backend.pool.give_back_one():
                        pass
                cc = pb.ContainerConfig(
                    metadata=pb.ContainerMetadata(name="app"),
                    image=pb.ImageSpec(image=IMAGE),
                    command=["sh", "-c", SERVER],
                    log_path="app.log",
                )
                req = pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
                cid = (await rt.CreateContainer(req)).container_id
                await rt.StartContainer(pb.StartContainerRequest(container_id=cid))
                st = await rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod, verbose=True))
                probe = "hostname; cat /proc/sys/net/ipv4/ip_unprivileged_port_start; cat /etc/resolv.conf"
                ex = await rt.ExecSync(
                    pb.ExecSyncRequest(container_id=cid, cmd=["sh", "-c", probe], timeout=10)
                )
                stats = (await rt.PodSandboxStats(pb.PodSandboxStatsRequest(pod_sandbox_id=pod))).stats
                seen[name] = {
                    "warm": json.loads(st.info["info"])["backend_data"].get("warm", False),
                    "state": st.status.state,
                    "ip": st.status.network.ip,
                    "namespaces": st.status.linux.namespaces.options,
                    "exec": ex.stdout.decode().replace(name, "NAME"),
                    "exit": ex.exit_code,
                    "port": await _fetch("127.0.0.1", port),
                    "pod_ip": await _fetch(st.status.network.ip, 8080),
                    "stats": (
                        stats.linux.cpu.HasField("usage_core_nano_seconds"),
                        stats.linux.memory.HasField("working_set_bytes"),
                    ),
                }
            warm, cold = seen["warm"], seen["cold"]
            assert (warm["warm"], cold["warm"]) == (True, False)
            assert warm["ip"] != cold["ip"] and warm["ip"] and cold["ip"]
            for key in ("state", "namespaces", "exec", "exit", "port", "pod_ip", "stats"):
                assert warm[key] == cold[key], (key, warm[key], cold[key])
            assert warm["exec"].startswith("NAME-host\n80\n") and "nameserver 10.0.0.10" in warm["exec"]
            assert warm["port"] == b"pong\n" and warm["stats"] == (True, True)
            pods = (await rt.ListPodSandbox(pb.ListPodSandboxRequest())).items
            assert sorted(p.metadata.name for p in pods) == ["cold", "warm"]  # no pool VM shows
            for p in pods:
                await rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=p.id))
                await rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=p.id))
    finally:
        await server.stop(0)
