"""Warm VMs: booted for no pod yet, their agents answering and their network wired, handed
out by RunPodSandbox (the pool itself and its settings: :mod:`backends.runv.pool`).

On the node's CNI network a warm VM is booted with a network namespace of its own and nothing
in it: the ADD needs the pod (its sandbox ID is the CNI container ID, its name, namespace, UID,
host ports and bandwidth are the plugins' arguments, the IPAM records the address under it), so
it runs when a pod takes the VM (cninet.py). The boot is what the pool hides (seconds with
qemu); the ADD of Debian's bridge + host-local + portmap adds about 0.15 s.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from backends.contract import errors
from backends.runv.hypervisor import VMSpec
from backends.runv.pool import CpuMeter, Pool, PoolConfig

from . import plumbing
from .context import Shared
from .state import Pod

T = TypeVar("T")


class WarmVMs:
    """The pool of warm VMs of one backend, of one shape (vCPUs, memory bytes)."""

    def __init__(self, shared: Shared, config: PoolConfig, shape: tuple[int, int]) -> None:
        self._shared = shared
        self.config = config
        self.shape = shape
        self.starting = 0  # RunPodSandbox calls in progress: the refill waits while there are any
        self._cpu = CpuMeter()
        self.pool: Pool[Pod] = Pool(
            config.size,
            self._boot,
            self._discard,
            self._usable,
            self._refill_should_wait,
            config.refill_interval,
            name="runv",
        )

    def take(self, vcpus: int, memory: int) -> Pod | None:
        """A warm VM for a pod of this size, or None: a pod smaller than the pool's shape boots cold."""
        if vcpus < self.shape[0] or memory < self.shape[1]:
            return None
        return self.pool.take()

    async def with_room(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``fn(*args)``; on a node full because of warm VMs, they give their room back first."""
        while True:
            try:
                return await fn(*args)
            except errors.ResourceExhaustedError:
                if not await self.pool.give_back_one():
                    raise

    async def _boot(self) -> Pod:
        """A VM for no pod yet: booted, its agent answering, its network wired."""
        shared = self._shared
        vcpus, memory = self.shape
        cni = shared.cni is not None and shared.cni.adds
        vm = await shared.hv.create(VMSpec("w" + secrets.token_hex(8)[:15], vcpus, memory, own_netns=cni))
        pod = Pod("", vm)
        try:
            await shared.connect(pod)
            if not cni:
                holder = "warm-" + vm.id  # in no record: released by recovery after a SIGKILL
                pod.warm_net = {"ip": shared.net.allocate(holder), "holder": holder}
                await plumbing.wire(shared, pod, pod.warm_net["ip"])
        except BaseException:
            await self._discard(pod)
            raise
        return pod

    async def _discard(self, pod: Pod) -> None:
        if pod.agent is not None:
            await pod.agent.close()
        await self._shared.hv.destroy(pod.vm)
        await plumbing.unwire_warm(self._shared, pod)

    def _usable(self, pod: Pod) -> bool:
        return pod.agent is not None and not pod.agent.closed and self._shared.hv.alive(pod.vm)

    def _refill_should_wait(self) -> bool:
        return self.starting > 0 or self._cpu.over(self.config.max_cpu)
