"""The hypervisor driver interface of the runv backend.

A driver boots VMs whose guest runs the agent (``backends.runv.agent``) and
gives the host a byte channel to it (virtio-serial style). Everything else
(containers, exec, stats) goes through that channel, so drivers stay small:
the stub (default) and a QEMU driver plug in behind the same protocol.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from typing import Any, Protocol, runtime_checkable

from backends.contract.errors import UnavailableError

MIB = 1024 * 1024


class Fault(enum.Enum):
    """Faults a driver can inject, for tests and chaos runs."""

    BOOT_FAILURE = "boot_failure"  # the next boot fails
    AGENT_HANG = "agent_hang"  # the agent stops answering (VM alive)
    CRASH = "crash"  # the VM dies now


class BootError(UnavailableError):
    """The VM did not come up or is gone (its console says why): the kubelet may retry."""


@dataclasses.dataclass(frozen=True, slots=True)
class VMSpec:
    id: str
    vcpus: int
    memory_bytes: int
    hostname: str = ""
    host_network: bool = False  # share the host's network (stub only; a real VM cannot)
    # The VM process in a network namespace of its own, where the CNI plugins make the pod's
    # interface: the stub's always is (unless host_network); QEMU's then holds its tap too.
    own_netns: bool = False
    # The pod's cgroup (LinuxPodSandboxConfig.cgroup_parent, the kubelet's, cgroupfs or systemd
    # form): the VM's cgroup is made below it; "": below the driver's own cgroup_parent.
    cgroup_parent: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class PodLimits:
    """A pod's resources as its VM takes them (UpdatePodSandboxResources): the VM's size, as
    RunPodSandbox sizes it, and what else the VM's host cgroup is given ("", 0: unchanged)."""

    vcpus: int
    memory_bytes: int
    cpu_shares: int = 0
    cpuset_cpus: str = ""
    cpuset_mems: str = ""


@dataclasses.dataclass(slots=True)
class VM:
    """A running VM as the host knows it; ``to_dict`` survives a shim restart."""

    id: str
    driver: str
    pid: int  # host PID of the VM process (the hypervisor)
    vcpus: int
    memory_bytes: int
    state_dir: str  # host directory holding the VM's console, channel and state
    channel: str  # address of the agent channel (a unix socket path for the stub)
    started_at: int = 0  # ns; with pid it identifies the process across PID reuse
    host_network: bool = False
    own_netns: bool = False  # its process's network namespace is the pod's (VMSpec.own_netns)
    cgroup: str = ""  # its cgroup, below the hierarchies' roots ("": the driver's parent/<id>)
    uid: int = 0  # the user its hypervisor runs as (0: root; a confined QEMU's own)
    shares: dict[str, str] = dataclasses.field(default_factory=dict)  # tag -> host path
    devices: dict[str, str] = dataclasses.field(default_factory=dict)  # host path -> guest path

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VM:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})


@runtime_checkable
class Hypervisor(Protocol):
    name: str

    @property
    def extra_memory(self) -> int:
        """What a VM holds of the host beyond its ``memory_bytes`` (a QEMU: its guest's kernel
        and agent, and QEMU itself): a pod's overhead pays for it first."""

    async def create(self, spec: VMSpec) -> VM:
        """Create and boot a VM; return once its agent channel accepts connections.

        Raises ResourceExhaustedError when the node has no room, BootError when
        the guest fails to come up; either way nothing is left behind.
        """

    async def stop(self, vm: VM, timeout: float) -> None:
        """Wait up to ``timeout`` s for a guest that was asked to power off, then destroy it."""

    async def destroy(self, vm: VM) -> None:
        """Kill the VM and release everything it held. Idempotent."""

    def alive(self, vm: VM) -> bool: ...

    async def wait(self, vm: VM) -> None:
        """Return when the VM process has exited (for whatever reason)."""

    async def adopt(self, vm: VM) -> bool:
        """Take over a VM booted by an earlier shim process; False if it is gone."""

    def leftovers(self, known: set[str]) -> list[VM]:
        """VMs of this driver on the node whose ID is not in ``known``."""

    async def close(self) -> None:
        """Stop the driver's own helper processes; VMs keep running."""

    def tidy(self) -> None:
        """Remove the node-level directories and cgroups the driver made, if no VM uses them."""

    # ---- hot-plug
    async def set_vcpus(self, vm: VM, vcpus: int) -> None: ...

    async def set_memory(self, vm: VM, memory_bytes: int) -> None: ...

    async def place(self, vm: VM, cgroup_parent: str) -> None:
        """Move a running VM (a warm one a pod takes) into a cgroup below ``cgroup_parent`` (the
        pod's, as VMSpec.cgroup_parent); FailedPreconditionError if the VM needs more memory than
        that cgroup allows, and then it stays where it was."""

    async def set_pod_limits(self, vm: VM, limits: PodLimits) -> None:
        """The pod's new resources, on the VM and its host cgroup; FailedPreconditionError for
        what the VM cannot take (memory below what it uses, a size a running VM cannot have),
        and then nothing changed."""

    # ---- shared directories and devices
    async def attach_share(
        self, vm: VM, tag: str, host_path: str, readonly: bool, bidirectional: bool = False
    ) -> str:
        """Expose a host directory to the guest (virtio-fs/9p style); return its guest path.
        ``bidirectional``: mounts made under it in the guest show on the host too (a
        BIDIRECTIONAL CRI mount); a driver that cannot (a real VM) raises UnimplementedError."""

    async def detach_share(self, vm: VM, tag: str) -> None: ...

    async def attach_device(self, vm: VM, host_path: str) -> str:
        """Pass a host device through; return its guest path."""

    async def detach_device(self, vm: VM, host_path: str) -> None: ...

    # ---- network
    async def attach_interface(self, vm: VM, host_ifname: str) -> str:
        """Hot-plug a host network interface into the guest; return its name there.

        The stub moves a veth peer into the VM's network namespace; a QEMU
        driver would add a tap-backed virtio-net NIC.
        """

    async def join_interface(self, vm: VM, netns: str, ifname: str) -> str:
        """Join the guest to ``ifname``, made by the CNI plugins in the network namespace of
        a VM booted with ``own_netns`` (pinned at ``netns``). Return the guest's interface to
        configure as the plugins configured ``ifname``, or "" when the guest is on ``ifname``
        itself (the stub: that namespace is the guest's)."""

    # ---- console and agent channel
    def console(self, vm: VM) -> str:
        """The VM's console output so far (boot messages, agent crashes)."""

    async def connect(self, vm: VM) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Open the byte channel to the guest agent."""

    # ---- observability and faults
    def usage(self, vm: VM) -> tuple[int, int]:
        """(cpu ns, memory bytes) the VM used, as the host measures it."""

    def capacity(self) -> tuple[int, int, int, int]:
        """(vCPUs used, vCPUs total, memory used, memory total) on this node."""

    def inject(self, fault: Fault, vm: VM | None = None) -> None: ...
