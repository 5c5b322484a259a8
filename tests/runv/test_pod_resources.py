"""UpdatePodSandboxResources on runv's stub driver: the pod's new size on its VM's cgroup, reserved
against the node's capacity and kept in the record; memory below what the pod uses is refused
and nothing changes."""

from __future__ import annotations

import os

import pytest

from backends.contract import errors
from backends.linux.cgroups import Cgroup, hierarchies
from backends.runv.backend import RunvBackend
from backends.runv.hypervisor import MIB
from cri_api import api_pb2 as pb
from tests.runv.helpers import Events, MemorySink, container_record, needs_vm, sandbox_record

pytestmark = needs_vm

IMAGE = "test/busybox:1"


def _read(d: str, name: str) -> str:
    with open(os.path.join(d, name)) as fh:
        return fh.read().strip()


def _figures(cg: Cgroup) -> tuple[int, int, int, str]:
    """(quota µs a 100 ms period, memory limit, CPU shares, cpuset) of a VM's cgroup, v1 or v2."""
    if cg.v2:
        (d,) = cg.dirs()
        quota = _read(d, "cpu.max").split()[0]
        weight = int(_read(d, "cpu.weight"))
        cpus = _read(d, "cpuset.cpus") if os.path.exists(os.path.join(d, "cpuset.cpus")) else ""
        return int(quota), int(_read(d, "memory.max")), 2 + ((weight - 1) * 262142) // 9999, cpus
    v1 = hierarchies().v1
    cpu, mem, cpuset = (os.path.join(v1[c], cg.rel) for c in ("cpu", "memory", "cpuset"))
    return (
        int(_read(cpu, "cpu.cfs_quota_us")),
        int(_read(mem, "memory.limit_in_bytes")),
        int(_read(cpu, "cpu.shares")),
        _read(cpuset, "cpuset.cpus") if os.path.isdir(cpuset) else "",
    )


def _request(sandbox_id: str, **res: object) -> pb.UpdatePodSandboxResourcesRequest:
    return pb.UpdatePodSandboxResourcesRequest(
        pod_sandbox_id=sandbox_id,
        resources=pb.LinuxContainerResources(**res),  # type: ignore[arg-type]
        overhead=pb.LinuxContainerResources(),
    )


async def test_the_pods_new_resources_size_its_vm(runv: tuple[RunvBackend, Events]) -> None:
    backend, events = runv
    sb = sandbox_record("resize", cpu_quota=100_000, cpu_period=100_000, memory_limit_in_bytes=256 * MIB)
    await backend.lifecycle.run_sandbox(sb)
    vm = backend._shared.pods[sb.id].vm
    cg = Cgroup(f"{backend.hv.cgroup_parent}/{vm.id}")  # type: ignore[attr-defined]
    assert _figures(cg)[:2] == (100_000, 288 * MIB)  # 1 vCPU, 256 MiB + the handler's 32
    # A container in the pod, so that the cpuset reaches the cgroups below the VM's too.
    ct = container_record(sb, IMAGE, ["sh", "-c", "head -c 64m /dev/zero > /dev/shm/fill; sleep 3600"])
    await backend.lifecycle.create_container(ct, sb)
    await events.start(backend.lifecycle, ct, sb, MemorySink())
    await backend.exec.exec_sync(
        ct, ["sh", "-c", "until [ $(wc -c < /dev/shm/fill) = 67108864 ]; do sleep 0.05; done"]
    )

    req = _request(
        sb.id,
        cpu_quota=200_000,
        cpu_period=100_000,
        memory_limit_in_bytes=384 * MIB,
        cpu_shares=1024,
        cpuset_cpus="0",
    )
    await backend.resources.update_sandbox_resources(sb, req)
    assert _figures(cg) == (200_000, 416 * MIB, 1024, "0")
    assert (vm.vcpus, vm.memory_bytes) == (2, 416 * MIB)
    assert (sb.backend_data["vm"]["vcpus"], sb.backend_data["vm"]["memory_bytes"]) == (2, 416 * MIB)
    assert backend.hv.capacity()[0] == 2  # reserved: the node's capacity counts the new size
    # The container's processes are in the cpuset: they run on CPU 0 only.
    allowed = await backend.exec.exec_sync(ct, ["sh", "-c", "grep Cpus_allowed_list /proc/self/status"])
    assert allowed.stdout.split()[-1] == b"0", allowed.stdout

    # Memory below what the pod uses (64 MiB in its /dev/shm): refused, nothing changed.
    with pytest.raises(errors.FailedPreconditionError, match=r"below the .* MiB the pod uses"):
        await backend.resources.update_sandbox_resources(sb, _request(sb.id, memory_limit_in_bytes=16 * MIB))
    assert _figures(cg) == (200_000, 416 * MIB, 1024, "0") and vm.memory_bytes == 416 * MIB
    # More than the node has: refused by the capacity check, nothing changed.
    with pytest.raises(errors.ResourceExhaustedError):
        await backend.resources.update_sandbox_resources(
            sb, _request(sb.id, cpu_quota=900_000, cpu_period=100_000)
        )
    assert _figures(cg)[0] == 200_000 and vm.vcpus == 2 and backend.hv.capacity()[0] == 2
    await backend.lifecycle.stop_sandbox(sb)
    await backend.lifecycle.remove_sandbox(sb)
