"""A pod's VM runs below the pod's cgroup (LinuxPodSandboxConfig.cgroup_parent, as the kubelet
makes it, cgroupfs or systemd form), sized within its limits; a pod whose memory limit cannot
hold its VM is refused at RunPodSandbox; a warm VM moves there when a pod takes it (stub).

Each test makes its pod cgroup under a root of its own in every hierarchy, as the kubelet would
(with its memory limit and CPU quota), and removes it after."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.contract import errors
from backends.linux.cgroups import Cgroup, cgroupfs_path, hierarchies
from backends.runv import plumbing
from backends.runv.backend import RunvBackend
from backends.runv.hypervisor import MIB
from tests.criutil import until
from tests.runv.helpers import Events, MemorySink, container_record, needs_vm, sandbox_record

IMAGE = "test/busybox:1"


def test_a_systemd_slice_is_where_systemd_puts_it() -> None:
    assert cgroupfs_path("kubepods-burstable-pod1_2.slice") == (
        "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1_2.slice"
    )
    assert cgroupfs_path("kubepods.slice") == "kubepods.slice"
    assert cgroupfs_path("/kubepods/burstable/pod12") == "kubepods/burstable/pod12"
    assert cgroupfs_path("") == ""


def _write(rel: str, name: str, value: str, controller: str) -> None:
    mounts = hierarchies()
    base = mounts.v2 if not mounts.v1 else mounts.v1[controller]
    assert base is not None
    with open(os.path.join(base, rel, name), "w") as fh:
        fh.write(value)


def _read(rel: str, name: str, controller: str) -> int:
    mounts = hierarchies()
    base = mounts.v2 if not mounts.v1 else mounts.v1[controller]
    assert base is not None
    with open(os.path.join(base, rel, name)) as fh:
        text = fh.read().split()[0]
    return 1 << 62 if text == "max" else int(text)


class PodCgroup:
    """A kubelet-like pod cgroup under a test-private root, in every hierarchy."""

    def __init__(self, form: str) -> None:
        tag = uuid.uuid4().hex[:8]
        uid = uuid.uuid4().hex
        if form == "systemd":
            self.root = f"crishimpc{tag}.slice"
            self.parent = f"crishimpc{tag}-burstable-pod{uid}.slice"  # what the kubelet sends
        else:
            self.root = f"crishim-pc-{tag}"
            self.parent = f"/{self.root}/kubepods/burstable/pod{uid}"
        self.rel = cgroupfs_path(self.parent)
        assert self.rel.startswith(self.root + "/")
        Cgroup(self.rel).create()

    def limit(self, memory: int, cpu_quota: int = 0) -> None:
        v2 = bool(hierarchies().v2) and not hierarchies().v1
        _write(self.rel, "memory.max" if v2 else "memory.limit_in_bytes", str(memory), "memory")
        if cpu_quota:
            if v2:
                _write(self.rel, "cpu.max", f"{cpu_quota} 100000", "cpu")
            else:
                _write(self.rel, "cpu.cfs_quota_us", str(cpu_quota), "cpu")

    def memory_limit(self, rel: str) -> int:
        v2 = bool(hierarchies().v2) and not hierarchies().v1
        return _read(rel, "memory.max" if v2 else "memory.limit_in_bytes", "memory")

    def cpu_quota(self, rel: str) -> int:
        if bool(hierarchies().v2) and not hierarchies().v1:
            return _read(rel, "cpu.max", "cpu")
        return _read(rel, "cpu.cfs_quota_us", "cpu")

    def holds(self, pid: int) -> list[str]:
        """The lines of /proc/PID/cgroup that are not below this pod's cgroup (none: all are)."""
        with open(f"/proc/{pid}/cgroup") as fh:
            lines = fh.read().splitlines()
        return [line for line in lines if not line.split(":", 2)[2].startswith(f"/{self.rel}/")]

    def remove(self) -> list[int]:
        root = Cgroup(self.root)
        left = sorted(set(root.pids()))
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while root.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        root.remove()
        return left


@pytest.fixture(params=["cgroupfs", "systemd"])
def pod_cgroup(request: pytest.FixtureRequest) -> Iterator[PodCgroup]:
    pc = PodCgroup(request.param)
    try:
        yield pc
    finally:
        left = pc.remove()
        assert not any(os.path.isdir(d) for d in Cgroup(pc.root).all_dirs())
        assert not left, f"processes left in the pod's cgroup: {left}"


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
    return out


@needs_vm
async def test_the_vm_runs_below_the_pods_cgroup_within_its_limits(
    runv: tuple[RunvBackend, Events], pod_cgroup: PodCgroup
) -> None:
    backend, events = runv
    # As the kubelet sizes it: the containers' 256 MiB and 1.5 CPUs plus the pod's overhead.
    pod_cgroup.limit(256 * MIB + 64 * MIB, cpu_quota=175_000)
    sb = sandbox_record("in-pod", cpu_quota=150_000, cpu_period=100_000, memory_limit_in_bytes=256 * MIB)
    sb.config.linux.cgroup_parent = pod_cgroup.parent
    sb.config.linux.overhead.memory_limit_in_bytes = 64 * MIB
    await backend.lifecycle.run_sandbox(sb)
    vm = backend._shared.pods[sb.id].vm
    assert vm.cgroup == f"{pod_cgroup.rel}/{vm.id}"
    ct = container_record(sb, IMAGE, ["sleep", "3600"])
    await backend.lifecycle.create_container(ct, sb)
    await events.start(backend.lifecycle, ct, sb, MemorySink())
    pids = _descendants(vm.pid)
    assert len(pids) >= 3  # the VM process, the agent, the container's
    for pid in pids:
        assert pod_cgroup.holds(pid) == [], pid
    # The VM's cgroup: the pod's 320 MiB (its overhead covers the handler's 32), the CPU quota
    # of its 2 vCPUs cut to the pod's.
    assert vm.memory_bytes == 320 * MIB
    assert pod_cgroup.memory_limit(vm.cgroup) == 320 * MIB <= pod_cgroup.memory_limit(pod_cgroup.rel)
    assert pod_cgroup.cpu_quota(vm.cgroup) == 175_000
    # The pod's usage shows in the pod's cgroup, where the kubelet reads it.
    assert Cgroup(pod_cgroup.rel).usage()[1] > 0
    await backend.lifecycle.stop_container(ct, 1)
    await backend.lifecycle.stop_sandbox(sb)
    await backend.lifecycle.remove_sandbox(sb)
    assert not any(os.path.isdir(d) for d in Cgroup(vm.cgroup).all_dirs())


@needs_vm
async def test_a_pod_whose_limit_cannot_hold_its_vm_is_refused(
    runv: tuple[RunvBackend, Events], pod_cgroup: PodCgroup
) -> None:
    backend, _ = runv
    pod_cgroup.limit(256 * MIB)  # no overhead: the handler's 32 MiB do not fit
    sb = sandbox_record("too-small", memory_limit_in_bytes=256 * MIB)
    sb.config.linux.cgroup_parent = pod_cgroup.parent
    with pytest.raises(
        errors.FailedPreconditionError, match=r"memory limit of 256 MiB .* 288 MiB its VM needs"
    ):
        await backend.lifecycle.run_sandbox(sb)
    assert backend._shared.pods == {} and backend.hv.capacity()[0] == 0
    assert not Cgroup(pod_cgroup.rel).pids()


@pytest.fixture
async def warm(
    runv_config: dict[str, Any], busybox_rootfs: Path
) -> AsyncIterator[tuple[RunvBackend, Events]]:
    runv_config["pool"] = {"size": 1, "max_cpu": 0, "refill_interval": 0}
    backend = RunvBackend("runv", runv_config)
    events = Events()
    await backend.lifecycle.start(events)
    backend.image_store.import_dir(IMAGE, str(busybox_rootfs), {})
    await backend.lifecycle.recover([], [])  # the pool starts after recovery
    try:
        yield backend, events
    finally:
        await events.close()
        for pod in list(backend._shared.pods.values()):
            await backend.hv.destroy(pod.vm)
        await backend.lifecycle.close()


@needs_vm
async def test_a_warm_vm_moves_into_the_pods_cgroup(
    warm: tuple[RunvBackend, Events], pod_cgroup: PodCgroup
) -> None:
    backend, events = warm
    await until(lambda: len(backend.pool.ready) == 1, 30)
    (pooled,) = backend.pool.ready
    before = Cgroup(f"{backend.hv.cgroup_parent}/{pooled.vm.id}")  # type: ignore[attr-defined]
    assert before.pids()
    pod_cgroup.limit(512 * MIB)
    sb = sandbox_record("warm-in-pod")
    sb.config.linux.cgroup_parent = pod_cgroup.parent
    await backend.lifecycle.run_sandbox(sb)
    assert sb.backend_data.get("warm") is True
    vm = backend._shared.pods[sb.id].vm
    assert vm.id == pooled.vm.id and vm.cgroup == f"{pod_cgroup.rel}/{vm.id}"
    assert sb.backend_data["vm"]["cgroup"] == vm.cgroup  # a restarted shim finds it there
    assert not any(os.path.isdir(d) for d in before.all_dirs())
    # Its containers' cgroups follow the agent's, now below the pod's.
    ct = container_record(sb, IMAGE, ["sleep", "3600"])
    await backend.lifecycle.create_container(ct, sb)
    await events.start(backend.lifecycle, ct, sb, MemorySink())
    pids = _descendants(vm.pid)
    assert len(pids) >= 3
    for pid in pids:
        assert pod_cgroup.holds(pid) == [], pid
    assert pod_cgroup.memory_limit(vm.cgroup) <= 512 * MIB
    await backend.lifecycle.stop_container(ct, 1)
    await backend.lifecycle.stop_sandbox(sb)
    await backend.lifecycle.remove_sandbox(sb)
    await backend.lifecycle.close()  # the refilled warm VM goes before the pod's cgroup does


@needs_vm
async def test_update_pod_sandbox_resources_resizes_the_vm_within_the_pods_cgroup(
    runv: tuple[RunvBackend, Events], pod_cgroup: PodCgroup
) -> None:
    from cri_api import api_pb2 as pb

    backend, _ = runv
    pod_cgroup.limit(320 * MIB, cpu_quota=175_000)
    sb = sandbox_record(
        "resize-in-pod", cpu_quota=150_000, cpu_period=100_000, memory_limit_in_bytes=256 * MIB
    )
    sb.config.linux.cgroup_parent = pod_cgroup.parent
    sb.config.linux.overhead.memory_limit_in_bytes = 64 * MIB
    await backend.lifecycle.run_sandbox(sb)
    vm = backend._shared.pods[sb.id].vm
    # The kubelet grows the pod's cgroup first, then tells the runtime.
    pod_cgroup.limit(576 * MIB, cpu_quota=250_000)
    request = pb.UpdatePodSandboxResourcesRequest(
        pod_sandbox_id=sb.id,
        resources=pb.LinuxContainerResources(
            cpu_quota=250_000, cpu_period=100_000, memory_limit_in_bytes=512 * MIB
        ),
        overhead=pb.LinuxContainerResources(memory_limit_in_bytes=64 * MIB),
    )
    await backend.resources.update_sandbox_resources(sb, request)
    assert (vm.vcpus, vm.memory_bytes) == (3, 576 * MIB)
    assert pod_cgroup.memory_limit(vm.cgroup) == 576 * MIB
    assert pod_cgroup.cpu_quota(vm.cgroup) == 250_000  # 3 vCPUs, cut to the pod's 2.5
    await backend.lifecycle.stop_sandbox(sb)
    await backend.lifecycle.remove_sandbox(sb)


@needs_vm
async def test_a_restarted_shim_finds_vms_in_pod_cgroups(
    runv_config: dict[str, Any], busybox_rootfs: Path, pod_cgroup: PodCgroup
) -> None:
    """Recorded: taken over, its cgroup the pod's still; not recorded (a RunPodSandbox killed
    before its record): swept, its cgroup below the pod's too."""
    import dataclasses

    first = RunvBackend("runv", dict(runv_config))
    await first.lifecycle.start(Events())
    pod_cgroup.limit(1 << 30)
    kept, half = sandbox_record("kept"), sandbox_record("half")
    for sb in (kept, half):
        sb.config.linux.cgroup_parent = pod_cgroup.parent
        await first.lifecycle.run_sandbox(sb)
    kept.committed = True
    kept_vm, half_vm = (first._shared.pods[sb.id].vm for sb in (kept, half))
    await first.lifecycle.close()
    half = dataclasses.replace(half, backend_data={}, committed=False)

    second = RunvBackend("runv", dict(runv_config))
    await second.lifecycle.start(Events())
    try:
        seen, _ = await second.lifecycle.recover([kept, half], [])
        assert seen[kept.id].running and not seen[half.id].exists
        assert second._shared.pods[kept.id].vm.cgroup == kept_vm.cgroup
        assert pod_cgroup.holds(kept_vm.pid) == []
        assert not Cgroup(half_vm.cgroup).pids()
        assert not any(os.path.isdir(d) for d in Cgroup(half_vm.cgroup).all_dirs())
        await second.lifecycle.stop_sandbox(kept)
        assert not any(os.path.isdir(d) for d in Cgroup(kept_vm.cgroup).all_dirs())
    finally:
        for pod in list(second._shared.pods.values()):
            await second.hv.destroy(pod.vm)
        for sb in (kept, half):
            await plumbing.unplumb(second._shared, sb)
        await second.lifecycle.close()
