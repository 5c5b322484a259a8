"""Warm pause containers (backends/docker/warm.py) on the real engine.

A host-network pod takes a pause container made before it and is, to what
runs in it, the same as a cold one; other pods start cold; the pool follows
the shape pods come in; pool items are reclaimed after a crash and removed
at a clean stop.
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import docker
import pytest

from backends.contract.errors import InvalidArgumentError
from backends.docker import DockerBackend, create
from backends.docker import labels as lbl
from backends.docker.warm import WARM_ID, PoolSettings
from cri_api import api_pb2 as pb
from shim.cri.container_io import CriLogWriter
from tests.criutil import until
from tests.docker.dockerkit import (
    BUSYBOX,
    ENDPOINT,
    INSTANCE,
    PAUSE,
    Events,
    Harness,
    container_record,
    sandbox_record,
)

DNS = pb.DNSConfig(servers=["10.96.0.10"], searches=["ns.svc.cluster.local"], options=["ndots:5"])


def host_network_pod(name: str, **linux: Any) -> Any:
    ns = pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER, ipc=pb.POD)
    default = pb.SecurityProfile(profile_type=pb.SecurityProfile.RuntimeDefault)
    sc = pb.LinuxSandboxSecurityContext(namespace_options=ns, seccomp=default)  # as a kubelet asks
    return sandbox_record(name, dns_config=DNS, linux=pb.LinuxPodSandboxConfig(security_context=sc, **linux))


async def pooled_backend(events: Events, size: int) -> DockerBackend:
    backend = create(
        "docker",
        {
            "endpoint": ENDPOINT,
            "pause_image": PAUSE,
            "instance": INSTANCE,
            "pool": {"size": size, "refill_interval": 0.0, "max_cpu": 0},
        },
    )
    await backend.lifecycle.start(events)
    return backend


@pytest.fixture
async def pooled(engine: docker.APIClient) -> AsyncIterator[Harness]:
    events = Events()
    h = Harness(await pooled_backend(events, 2), events, engine)
    try:
        yield h
    finally:
        await h.cleanup()
        await h.events.close()
        await h.backend.lifecycle.close()


def ready(h: Harness, n: int) -> Callable[[], bool]:
    return lambda: h.backend.warm is not None and len(h.backend.warm.pool.ready) == n


def warm_rows(engine: docker.APIClient) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = engine.containers(
        all=True, filters={"label": [f"{lbl.KIND}={lbl.WARM}", f"{lbl.INSTANCE}={INSTANCE}"]}
    )
    return rows


async def output_of(h: Harness, sb: Any, tmp_path: Path, name: str, script: str) -> str:
    log = tmp_path / f"{name}.log"
    ct = await h.create(container_record(sb, ["sh", "-c", script], name=name), sb)
    await h.events.start(h.backend.lifecycle, ct, sb, CriLogWriter(str(log)))
    await h.events.exit_of(ct.id)
    return "".join(line.split(" ", 3)[3] + "\n" for line in log.read_text().splitlines())


async def test_a_host_network_pod_takes_a_warm_pause_container_and_looks_cold(
    pooled: Harness, engine: docker.APIClient, tmp_path: Path
) -> None:
    h = pooled
    await until(ready(h, 2), 30)
    script = "hostname; cat /etc/resolv.conf; readlink /proc/self/ns/net; readlink /proc/self/ns/ipc"
    warm_sb = await h.run_sandbox(host_network_pod("warm"))
    assert warm_sb.backend_data.get(WARM_ID, "").startswith("warm-")
    eid = warm_sb.backend_data["engine_id"]
    info = engine.inspect_container(eid)
    assert info["Name"] == "/" + lbl.sandbox_name(warm_sb.id, warm_sb.config)
    assert info["State"]["Running"] and warm_sb.backend_data["pid"] == info["State"]["Pid"]
    assert h.backend.warm is not None and h.backend.warm.pool.handed_out == 1
    await until(ready(h, 2), 30)  # refilled

    # A cold one of the same pod shape, from a backend without a pool.
    events = Events()
    cold_backend = await pooled_backend(events, 0)
    cold = Harness(cold_backend, events, engine)
    try:
        cold_sb = await cold.run_sandbox(host_network_pod("cold"))
        assert WARM_ID not in cold_sb.backend_data
        warm_out = await output_of(h, warm_sb, tmp_path, "w", script)
        cold_out = await output_of(cold, cold_sb, tmp_path, "c", script)
    finally:
        await cold.cleanup()
        await events.close()
        await cold_backend.lifecycle.close()
    w_lines, c_lines = warm_out.splitlines(), cold_out.splitlines()
    assert w_lines[0] == c_lines[0] == socket.gethostname()
    assert "nameserver 10.96.0.10" in warm_out and "options ndots:5" in warm_out
    assert w_lines[1:-2] == c_lines[1:-2]  # resolv.conf
    assert w_lines[-2] == c_lines[-2] == os.readlink("/proc/self/ns/net")  # the host's network
    pause_pid = warm_sb.backend_data["pid"]
    assert w_lines[-1] == os.readlink(f"/proc/{pause_pid}/ns/ipc")  # the pod's IPC namespace

    # Its pause container's exit is the pod's, found through the warm label.
    engine.kill(eid, "SIGKILL")
    await h.events.wait_for(lambda: warm_sb.id in h.events.not_ready)


async def test_other_pods_start_cold_and_the_pool_follows_the_shape(
    pooled: Harness, engine: docker.APIClient
) -> None:
    h = pooled
    await until(ready(h, 2), 30)
    assert h.backend.warm is not None
    own_net = await h.run_sandbox(sandbox_record("own-net"))
    assert WARM_ID not in own_net.backend_data and len(h.backend.warm.pool.ready) == 2

    def shm_pod(name: str) -> Any:
        return host_network_pod(name, sysctls={"kernel.shm_rmid_forced": "1"})

    first = await h.run_sandbox(shm_pod("shm-1"))
    assert WARM_ID not in first.backend_data  # another shape: cold, and the pool changes shape
    warm = h.backend.warm
    await until(lambda: len(warm.pool.ready) == 2 and not warm.pool.booting, 30)
    await until(lambda: len(warm_rows(engine)) == 2, 30)  # the old shape's items are gone
    second = await h.run_sandbox(shm_pod("shm-2"))
    assert second.backend_data.get(WARM_ID)
    sysctls = engine.inspect_container(second.backend_data["engine_id"])["HostConfig"]["Sysctls"]
    assert sysctls == {"kernel.shm_rmid_forced": "1"}


async def test_pool_items_are_reclaimed_after_a_crash_and_removed_at_stop(engine: docker.APIClient) -> None:
    events, events2 = Events(), Events()
    crashed = await pooled_backend(events, 2)
    after = await pooled_backend(events2, 0)
    h = Harness(crashed, events, engine)
    try:
        await until(ready(h, 2), 30)
        sb = await h.run_sandbox(host_network_pod("kept"))
        await until(ready(h, 2), 30)
        assert len(warm_rows(engine)) == 3  # two in the pool, one now the pod's
        # The shim dies (its pool is never closed); the next one recovers from the records.
        sandboxes, _ = await after.lifecycle.recover([sb], [])
        assert sandboxes[sb.id].exists and sandboxes[sb.id].running
        rows = warm_rows(engine)
        assert [r["Id"] for r in rows] == [sb.backend_data["engine_id"]]  # the pool items are gone
        # The recovered backend follows the pod through the warm label.
        engine.kill(sb.backend_data["engine_id"], "SIGKILL")
        await events2.wait_for(lambda: sb.id in events2.not_ready)
        h.backend = after
        await h.cleanup()
        assert warm_rows(engine) == []
    finally:
        await events.close()
        await events2.close()
        await crashed.lifecycle.close()
        await after.lifecycle.close()
    # A clean stop removes what the pool holds.
    events3 = Events()
    backend = await pooled_backend(events3, 2)
    h3 = Harness(backend, events3, engine)
    await until(ready(h3, 2), 30)
    await backend.lifecycle.close()
    await events3.close()
    assert warm_rows(engine) == []


async def test_recovery_keeps_the_items_its_own_pool_made_and_removes_a_dead_shims(
    engine: docker.APIClient,
) -> None:
    """The server starts the backend (its pool begins filling) before it recovers: the items the
    live pool made are its own, the dead shim's are leftovers."""
    events, events2 = Events(), Events()
    crashed = await pooled_backend(events, 1)
    after = await pooled_backend(events2, 1)
    try:
        await until(ready(Harness(crashed, events, engine), 1), 30)
        await until(ready(Harness(after, events2, engine), 1), 30)
        assert crashed.warm is not None and after.warm is not None
        mine = after.warm.pool.ready[0].engine_id
        theirs = crashed.warm.pool.ready[0].engine_id
        await after.lifecycle.recover([], [])
        ids = {r["Id"] for r in warm_rows(engine)}
        assert mine in ids and theirs not in ids
        # The kept item serves a pod.
        h = Harness(after, events2, engine)
        sb = await h.run_sandbox(host_network_pod("afterwards"))
        assert sb.backend_data["engine_id"] == mine
        await h.cleanup()
    finally:
        await events.close()
        await events2.close()
        await crashed.lifecycle.close()
        await after.lifecycle.close()
    assert warm_rows(engine) == []


@pytest.mark.parametrize(
    ("table", "why"),
    [
        ({"size": -1}, r"\[handlers.docker.pool\] size: expected a non-negative integer"),
        ({"size": "2"}, r"\[handlers.docker.pool\] size: expected"),
        ({"size": 1, "max_cpu": 2}, r"\[handlers.docker.pool\] max_cpu: expected 0..1"),
        ({"size": 1, "refill_interval": -1}, r"\[handlers.docker.pool\] refill_interval: expected"),
        ({"vcpus": 2}, r"\[handlers.docker.pool\] unknown key 'vcpus'"),
        ("big", r"\[handlers.docker.pool\]: expected a table"),
    ],
)
def test_pool_settings_are_checked(table: Any, why: str) -> None:
    with pytest.raises(InvalidArgumentError, match=why):
        PoolSettings.from_table("docker", table)


async def test_warm_and_cold_host_network_pods_look_the_same_to_every_cri_call(
    engine: docker.APIClient, short_tmp: str
) -> None:
    """Through a running shim: one host-network pod on a warm pause container, one cold, the same
    to status, lists, exec (hostname, DNS, network namespace) and stats; no pool item listed."""
    import dataclasses
    import json

    import grpc

    from cri_api import api_pb2_grpc
    from shim.server import Server
    from tests.conftest import make_ids, server_config

    events = Events()
    backend = await pooled_backend(events, 1)
    await events.close()
    cfg = dataclasses.replace(server_config(short_tmp, default_handler="docker"), handlers={})
    server = Server(cfg, backends={"docker": backend}, id_factory=make_ids("dockerwarm"))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{short_tmp}/cri.sock") as ch:
            rt = api_pb2_grpc.RuntimeServiceStub(ch)  # type: ignore[no-untyped-call]
            assert backend.warm is not None
            warm_pool = backend.warm.pool
            await until(lambda: len(warm_pool.ready) == 1, 30)
            seen: dict[str, dict[str, Any]] = {}
            for name in ("warm", "cold"):
                sc = host_network_pod(name).config
                sc.log_directory = os.path.join(short_tmp, "logs", name)
                pod = (await rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
                if name == "warm":
                    # The next pod starts cold: no refill, and nothing the refill made meanwhile.
                    warm_pool.size = 0
                    await until(lambda: not warm_pool.booting, 30)
                    while await warm_pool.give_back_one():
                        pass
                cc = pb.ContainerConfig(
                    metadata=pb.ContainerMetadata(name="app"),
                    image=pb.ImageSpec(image=BUSYBOX),
                    command=["sleep", "3600"],
                    log_path="app.log",
                )
                req = pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
                cid = (await rt.CreateContainer(req)).container_id
                await rt.StartContainer(pb.StartContainerRequest(container_id=cid))
                st = await rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod, verbose=True))
                probe = "hostname; cat /etc/resolv.conf; readlink /proc/self/ns/net"
                ex = await rt.ExecSync(
                    pb.ExecSyncRequest(container_id=cid, cmd=["sh", "-c", probe], timeout=10)
                )
                stats = (await rt.PodSandboxStats(pb.PodSandboxStatsRequest(pod_sandbox_id=pod))).stats
                listed = await rt.ListContainers(
                    pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=pod))
                )
                seen[name] = {
                    "warm": bool(json.loads(st.info["info"])["backend_data"].get(WARM_ID)),
                    "state": st.status.state,
                    "ip": st.status.network.ip,
                    "namespaces": st.status.linux.namespaces.options,
                    "exec": ex.stdout.decode(),
                    "exit": ex.exit_code,
                    "containers": [(c.metadata.name, c.state) for c in listed.containers],
                    "stats": (
                        stats.linux.cpu.HasField("usage_core_nano_seconds"),
                        stats.linux.memory.HasField("working_set_bytes"),
                    ),
                }
            warm, cold = seen["warm"], seen["cold"]
            assert (warm["warm"], cold["warm"]) == (True, False)
            for key in ("state", "ip", "namespaces", "exec", "exit", "containers", "stats"):
                assert warm[key] == cold[key], (key, warm[key], cold[key])
            assert (
                warm["exec"].startswith(socket.gethostname() + "\n")
                and "nameserver 10.96.0.10" in warm["exec"]
            )
            assert warm["stats"] == (True, True) and warm["state"] == pb.SANDBOX_READY
            pods = (await rt.ListPodSandbox(pb.ListPodSandboxRequest())).items
            assert sorted(p.metadata.name for p in pods) == ["cold", "warm"]  # no pool item shows
            for p in pods:
                await rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=p.id))
                await rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=p.id))
    finally:
        await server.stop(0)
    assert warm_rows(engine) == []
