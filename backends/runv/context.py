"""What the runv backend's parts share: the driver, the pod network (its own bridge, and the
node's CNI network), the image store, the settings, the table of live pods, and the agent
plumbing every RPC family uses (a pod's VM and agent by sandbox ID, the agent's exit events,
the watch on each VM for a crash).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from typing import Any

import structlog

from backends import contract
from backends.cni.pinned import CniPods
from backends.contract import errors
from backends.linux.usage import UsageCache
from backends.runv.agent import messages as m
from backends.runv.agent.client import AgentClient
from backends.runv.agent.protocol import AgentError
from backends.runv.hypervisor import Hypervisor
from backends.runv.images.store import ImageStore
from backends.runv.network import BridgeNetwork

from .state import Pod

log = structlog.get_logger(__name__)

VM_CRASH_EXIT = 255
VM_CRASH_REASON = "VMCrashed"


class Shared:
    """The driver, networks, image store, settings and live pods of one backend instance."""

    def __init__(
        self,
        hv: Hypervisor,
        net: BridgeNetwork,
        image_store: ImageStore,
        *,
        containers_dir: str,
        agent_timeout: float | None,
        overhead_vcpus: float,
        overhead_memory: int,
        cni: CniPods | None = None,
    ) -> None:
        self.hv = hv
        self.net = net  # the backend's own bridge
        self.cni = cni  # pods on CNI (cninet.py); None: the handler has no CNI settings
        self.image_store = image_store
        self.containers_dir = containers_dir  # the containers' writable layers, one directory each
        # Unset: the driver's (seconds of work for an agent on an emulated CPU), else 10 s.
        self.agent_timeout_setting = agent_timeout
        self.overhead_vcpus = overhead_vcpus
        self.overhead_memory = overhead_memory
        self.pods: dict[str, Pod] = {}
        self.owner: dict[str, str] = {}  # container ID -> sandbox ID
        self.layer_usage_of: dict[str, UsageCache] = {}  # container ID -> its writable layer
        self.events: contract.EventSink | None = None

    @property
    def agent_timeout(self) -> float:
        if self.agent_timeout_setting is not None:
            return self.agent_timeout_setting
        return float(getattr(self.hv, "agent_timeout", 10.0))

    def pod(self, sandbox_id: str) -> Pod:
        pod = self.pods.get(sandbox_id)
        if pod is None:
            raise errors.NotFoundError(f"VM of sandbox {sandbox_id} is not running")
        if pod.dead:
            raise errors.FailedPreconditionError(f"VM of sandbox {sandbox_id} crashed")
        return pod

    @staticmethod
    def agent(pod: Pod) -> AgentClient:
        if pod.agent is None or pod.agent.closed:
            raise errors.UnavailableError(f"agent of sandbox {pod.sandbox_id} is not connected")
        return pod.agent

    async def connect(self, pod: Pod) -> None:
        try:
            reader, writer = await self.hv.connect(pod.vm)
        except OSError as exc:
            # A VM whose agent refuses or has no socket left: that pod is down, not the backend.
            raise errors.UnavailableError(f"agent of VM {pod.vm.id} does not answer: {exc}") from exc
        pod.agent = AgentClient(reader, writer, lambda n, b: self._on_event(pod, n, b), self.agent_timeout)
        hello = await pod.agent.call(m.HelloRequest())
        pod.agent_version = hello.version

    def _on_event(self, pod: Pod, name: str, body: dict[str, Any]) -> None:
        if name == m.EXIT_EVENT:
            try:
                state = m.ContainerState.from_dict(body)
            except AgentError as exc:
                log.warning("agent sent a bad exit event", sandbox_id=pod.sandbox_id, error=exc.message)
                return
            info = contract.ExitInfo(
                exit_code=state.exit_code,
                finished_at=state.finished_at or time.time_ns(),
                reason=state.reason,
            )
            self.report_exit(pod, state.id, info)

    @staticmethod
    def report_exit(pod: Pod, cid: str, info: contract.ExitInfo) -> None:
        """The container's exit, to the shim following it (the first report wins)."""
        proc = pod.procs.get(cid)
        if proc is not None:
            proc.exit.set(info)

    def watch(self, pod: Pod) -> None:
        """Report the pod's containers exited and the pod not ready if its VM dies unasked."""

        async def monitor() -> None:
            await self.hv.wait(pod.vm)
            if pod.stopping:
                return
            pod.dead = True
            now = time.time_ns()
            msg = f"the VM of the pod exited unexpectedly: {self.hv.console(pod.vm)[-200:].strip()}"
            for cid in sorted(pod.containers):
                self.report_exit(pod, cid, contract.ExitInfo(VM_CRASH_EXIT, now, VM_CRASH_REASON, msg))
            if self.events is not None:
                self.events.sandbox_not_ready(pod.sandbox_id, VM_CRASH_REASON)

        pod.monitor = asyncio.get_running_loop().create_task(monitor())

    def forget(self, cid: str) -> None:
        """Drop what is kept of a removed container: its owner, its layer's usage, its directory."""
        self.owner.pop(cid, None)
        self.layer_usage_of.pop(cid, None)
        shutil.rmtree(os.path.join(self.containers_dir, cid), ignore_errors=True)
