"""ListContainerStats, ListPodSandboxStats, ListPodSandboxMetrics: each VM's agent reads its
containers' cgroups (and its network), the host the VM's cgroup and the writable layers."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Sequence

from backends import contract
from backends.contract import errors
from backends.contract.usage import Layer, Sample
from backends.linux import cgroup_usage
from backends.linux.usage import UsageCache
from backends.runv.agent import messages as m
from cri_api import api_pb2 as pb

from .context import Shared


class RunvStats:
    def __init__(self, shared: Shared) -> None:
        self._shared = shared

    def _writable_usage(self, cid: str) -> UsageCache:
        shared = self._shared
        layer = shared.layer_usage_of.get(cid)
        if layer is None:
            layer = UsageCache(os.path.join(shared.containers_dir, cid, "upper"), max_age=10.0)
            shared.layer_usage_of[cid] = layer
        return layer

    async def container_stats(
        self, containers: Sequence[contract.ContainerRecord]
    ) -> dict[str, contract.ContainerUsage]:
        async def one(ct: contract.ContainerRecord) -> contract.ContainerUsage | None:
            pod = self._shared.pods.get(ct.sandbox_id)
            if pod is None or pod.dead or pod.agent is None or pod.agent.closed:
                return None
            try:
                s = await pod.agent.call(m.StatsRequest(id=ct.id))
            except errors.CriError:
                return None
            used, inodes = await self._writable_usage(ct.id).get()
            sample = Sample(
                timestamp=time.time_ns(),
                cpu_ns=s.cpu_ns,
                memory_usage=s.memory_bytes,
                working_set=s.working_set_bytes,
            )
            return contract.ContainerUsage(sample, Layer(self._shared.containers_dir, used, inodes))

        # Each VM's agent answers for its own containers: ask them all at once.
        got = await asyncio.gather(*(one(ct) for ct in containers))
        return {ct.id: u for ct, u in zip(containers, got, strict=True) if u is not None}

    async def sandbox_stats(
        self, sandboxes: Sequence[contract.SandboxRecord], containers: Sequence[contract.ContainerRecord]
    ) -> dict[str, contract.SandboxUsage]:
        per_ct = await self.container_stats(containers)
        out: dict[str, contract.SandboxUsage] = {}
        for sb in sandboxes:
            pod = self._shared.pods.get(sb.id)
            if pod is None or pod.dead:
                continue
            cpu, mem = self._shared.hv.usage(pod.vm)
            # The VM is the pod: its cgroup's figures, its memory as the limit.
            sample = Sample(
                timestamp=time.time_ns(),
                cpu_ns=cpu,
                memory_usage=mem,
                working_set=mem,
                memory_limit=pod.vm.memory_bytes,
            )
            mine = {cid: u for cid, u in per_ct.items() if self._shared.owner.get(cid) == sb.id}
            out[sb.id] = contract.SandboxUsage(sample, containers=mine)
        return out

    async def sandbox_metrics(
        self, sandboxes: Sequence[contract.SandboxRecord], containers: Sequence[contract.ContainerRecord]
    ) -> dict[str, contract.PodMetrics]:
        """cAdvisor's container_* figures, from each VM's agent (its containers' cgroups and
        its network)."""
        running: dict[str, list[contract.ContainerRecord]] = {}
        for ct in containers:
            if ct.status.state == pb.CONTAINER_RUNNING:
                running.setdefault(ct.sandbox_id, []).append(ct)
        layer_fs = await asyncio.to_thread(_fs_of, self._shared.containers_dir)

        async def one(sb: contract.SandboxRecord) -> contract.PodMetrics | None:
            pod = self._shared.pods.get(sb.id)
            if pod is None or pod.dead or pod.agent is None or pod.agent.closed:
                return None
            cts = running.get(sb.id, [])
            try:
                got = await pod.agent.call(m.MetricsRequest(ids=[c.id for c in cts]))
            except errors.CriError:
                return None
            found: dict[str, contract.ContainerUsage] = {}
            for ct in cts:
                part = got.containers.get(ct.id)
                if part is None:
                    continue
                used, inodes = await self._writable_usage(ct.id).get()
                layer = (
                    dataclasses.replace(layer_fs, used_bytes=used, inodes_used=inodes) if layer_fs else None
                )
                found[ct.id] = contract.ContainerUsage(part.sample, layer, part.detail)
            return contract.PodMetrics(
                name=pod.vm.id,
                interfaces=None if pod.vm.host_network else tuple(got.interfaces),
                containers=found,
            )

        got = await asyncio.gather(*(one(sb) for sb in sandboxes))
        return {sb.id: pm for sb, pm in zip(sandboxes, got, strict=True) if pm is not None}


def _fs_of(path: str) -> Layer | None:
    """The filesystem holding ``path``: its device and size (usage filled in per container)."""
    try:
        st, vfs = os.stat(path), os.statvfs(path)
    except OSError:
        return None
    return Layer(
        mountpoint=path,
        used_bytes=0,
        inodes_used=0,
        device=cgroup_usage.device_name(os.major(st.st_dev), os.minor(st.st_dev)),
        capacity_bytes=vfs.f_blocks * vfs.f_frsize,
        inodes_total=vfs.f_files,
        inodes_free=vfs.f_ffree,
    )
