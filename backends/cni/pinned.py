"""Pods on CNI whose network namespace is a process's, pinned to a file: docker's pause process,
runv's VM process.

Once the process runs, its network namespace is pinned (``<state_dir>/netns/<sandbox id>``,
:mod:`backends.linux.netns`) and ADDed to the network of the node's CNI config
(:mod:`backends.cni.pods`); the pod's addresses are the result's. The pin's path is what the
CNI cache keeps, so a DEL made after the process is gone (or after a restart) still reaches that
namespace and no other: a ``/proc/PID`` path would name whatever process gets the PID next.

- a failed ADD (or a failure after it): the caller calls :meth:`CniPods.release`;
- StopPodSandbox: :meth:`CniPods.detach` (DEL from the cache, then unpin; a plugin's error is
  raised, the pin kept, so that a stop again DELs again);
- RemovePodSandbox: :meth:`CniPods.release` (a plugin's failure is logged, never raised);
- recovery: :meth:`CniPods.recover` DELs every cached attachment of a pod with no committed
  record (the shim died between the ADD and the record) and unpins what such pods left.

``backend_data["netns"]`` marks a pod on CNI: stop and remove act on it whatever the handler's
``pod_network`` says now, so that pods made before a change are released all the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterable, Mapping
from typing import Any

import structlog

from backends.cni.client import Readiness
from backends.cni.pods import CNI, CniPodNetwork, pod_network, settings_from
from backends.contract import SandboxNetwork, SandboxRecord
from backends.contract.errors import CriError, FailedPreconditionError, InvalidArgumentError
from backends.linux import netns

log = structlog.get_logger("cri-shim.cni")

NETNS = "netns"  # backend_data: the pinned network namespace of a pod on CNI


class CniPods:
    """One handler's pods on CNI: ``adds`` when its ``pod_network`` is ``cni``; either way it
    releases what pods made with CNI hold."""

    def __init__(self, network: CniPodNetwork, pin_dir: str, *, adds: bool) -> None:
        self.network = network
        self.pin_dir = pin_dir
        self.adds = adds

    @classmethod
    def of_handler(cls, handler: str, config: Mapping[str, Any], state_dir: str) -> CniPods | None:
        """None without CNI settings on the builtin network; else the pods on CNI, which, on the
        builtin network, still release what pods made on CNI before a change hold."""
        mode = pod_network(handler, config)
        table = config.get("cni")
        if table is None and mode != CNI:
            return None
        if not state_dir:
            raise InvalidArgumentError(
                f"[handlers.{handler}] pods on CNI need a state_dir (for their namespaces)"
            )
        network = CniPodNetwork(settings_from(handler, table or {}, state_dir))
        return cls(network, os.path.join(state_dir, "netns"), adds=mode == CNI)

    async def readiness(self) -> Readiness:
        return await self.network.readiness()

    def set_pod_cidr(self, cidr: str) -> None:
        self.network.set_pod_cidr(cidr)

    async def attach(self, sandbox: SandboxRecord, pid: int) -> SandboxNetwork:
        """Pin the network namespace of process ``pid`` and ADD it. On failure the caller
        calls :meth:`release` (a cancelled ADD has DELed what it made, too)."""
        path = os.path.join(self.pin_dir, sandbox.id)
        pinning = asyncio.ensure_future(asyncio.to_thread(netns.pin, pid, path))
        try:
            await asyncio.shield(pinning)
        except asyncio.CancelledError:
            # The thread pins all the same: let it finish, so that the release undoes it.
            with contextlib.suppress(Exception):
                await pinning
            raise
        except OSError as exc:
            raise FailedPreconditionError(f"sandbox {sandbox.id}: {exc.strerror}") from exc
        sandbox.backend_data[NETNS] = path
        return await self.network.add(sandbox.id, path, sandbox.config)

    async def detach(self, sandbox: SandboxRecord) -> None:
        """DEL the pod, then unpin; the plugin's error (and the pin) stay if the DEL fails."""
        await self.network.delete(sandbox.id)
        await self._unpin(sandbox)

    async def release(self, sandbox: SandboxRecord) -> None:
        """DEL what is still cached and unpin; a failure is logged, never raised."""
        try:
            await self.network.delete(sandbox.id)
        except CriError as exc:
            log.error("cni DEL failed; the next start retries it", sandbox_id=sandbox.id, error=exc.message)
        await self._unpin(sandbox)

    async def _unpin(self, sandbox: SandboxRecord) -> None:
        path = str(sandbox.backend_data.get(NETNS) or os.path.join(self.pin_dir, sandbox.id))
        try:
            await asyncio.to_thread(netns.unpin, path)
        except OSError as exc:
            log.error("network namespace not unpinned", sandbox_id=sandbox.id, path=path, error=str(exc))
            return
        sandbox.backend_data.pop(NETNS, None)

    async def recover(self, sandbox_ids: Iterable[str]) -> None:
        """Release the attachments and pins of every pod not in ``sandbox_ids``."""
        keep = set(sandbox_ids)
        try:
            await self.network.release_all_but(keep)
        except CriError as exc:
            log.error("cni: releasing the attachments of pods with no record failed", error=exc.message)
        for name in await asyncio.to_thread(netns.pins, self.pin_dir):
            if name not in keep:
                log.info("released the network of a pod with no record", sandbox_id=name)
                try:
                    await asyncio.to_thread(netns.unpin, os.path.join(self.pin_dir, name))
                except OSError as exc:
                    log.error("network namespace not unpinned", path=exc.filename, error=str(exc))
