"""Pods on the node's CNI network (``pod_network = "cni"``), as cri-dockerd wires them.

The pause container of a pod that does not share the host's network is created with no engine
network (``none``). Once it runs, the network namespace of its process is pinned to a file
(``<state_dir>/netns/<sandbox id>``, :mod:`backends.linux.netns`) and ADDed to the network of the
node's CNI config (:mod:`backends.cni.pods`); the pod's addresses are the result's. The app
containers join that namespace as with the engine's network. The pin's path is what the CNI
cache keeps, so a DEL made after the pause process is gone (or after a restart) still reaches
that namespace and no other.

- a failed ADD (or a failure after it) DELs and unpins, and the caller removes the pause
  container: nothing is left;
- StopPodSandbox DELs, from the cache, before the pause container stops, then unpins. A DEL
  that fails is raised after the pause container stopped (the kubelet stops again);
- RemovePodSandbox DELs what a stop did not, logs a plugin's failure, and unpins whatever
  happened: a remove never fails because a plugin does (a later start's recovery DELs from the
  cache what is still there);
- recovery DELs every cached attachment of a pod with no committed record (the shim died between
  the ADD and the record) and unpins what such pods left.

``backend_data["netns"]`` marks a pod on CNI: stop and remove act on it whatever the handler's
``pod_network`` says now, so that pods made before a change are released all the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterable

import structlog

from backends.cni.client import Readiness
from backends.cni.pods import PodNetwork
from backends.contract import SandboxNetwork, SandboxRecord
from backends.contract.errors import CriError, FailedPreconditionError
from backends.linux import netns

log = structlog.get_logger("docker.network")

NETNS = "netns"  # backend_data: the pinned network namespace of a pod on CNI


class CniPods:
    """One handler's pods on CNI: ``adds`` when its ``pod_network`` is ``cni``; either way it
    releases what pods made with CNI hold."""

    def __init__(self, network: PodNetwork, pin_dir: str, *, adds: bool) -> None:
        self.network = network
        self.pin_dir = pin_dir
        self.adds = adds

    async def readiness(self) -> Readiness:
        return await self.network.readiness()

    def set_pod_cidr(self, cidr: str) -> None:
        self.network.set_pod_cidr(cidr)

    async def attach(self, sandbox: SandboxRecord, pid: int) -> SandboxNetwork:
        """Pin the namespace of the pause process ``pid`` and ADD it. On failure the caller
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
