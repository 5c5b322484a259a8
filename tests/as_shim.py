"""The CRI messages the shim builds from a backend's figures, for tests that drive a backend directly."""

from __future__ import annotations

import time
from collections.abc import Sequence

from backends.contract import ContainerRecord, Metrics, SandboxRecord, Stats
from cri_api import api_pb2 as pb
from shim.cri import sandbox_metrics, stats_messages


class AsShim:
    """Stats and metrics of a backend as ListContainerStats & co. answer them (CPU rates kept)."""

    def __init__(self) -> None:
        self.rates = stats_messages.CpuRates()

    async def container_stats(
        self, backend: Stats, containers: Sequence[ContainerRecord]
    ) -> dict[str, pb.ContainerStats]:
        got = await backend.container_stats(containers)
        now = time.time_ns()
        return {
            c.id: stats_messages.container_stats(c, got[c.id], self.rates, now)
            for c in containers
            if c.id in got
        }

    async def sandbox_stats(
        self, backend: Stats, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> dict[str, pb.PodSandboxStats]:
        got = await backend.sandbox_stats(sandboxes, containers)
        now = time.time_ns()
        return {
            sb.id: stats_messages.sandbox_stats(sb, got[sb.id], containers, self.rates, now)
            for sb in sandboxes
            if sb.id in got
        }

    @staticmethod
    def metric_descriptors() -> list[pb.MetricDescriptor]:
        return sandbox_metrics.descriptors()

    @staticmethod
    async def sandbox_metrics(
        backend: Metrics, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> list[pb.PodSandboxMetrics]:
        got = await backend.sandbox_metrics(sandboxes, containers)
        return [sandbox_metrics.pod_metrics(sb, got.get(sb.id), containers) for sb in sandboxes]
