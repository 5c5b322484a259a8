"""What the CRI layer adds to a backend's usage figures, once for every backend.

A backend reports cumulative CPU time (``usage_core_nano_seconds``); the CRI
also wants the rate (``usage_nano_cores``), which the kubelet's summary API
and metrics-server read. It is the change since the previous sample of the
same container or pod, so it is computed here, where every sample passes.
"""

from __future__ import annotations

from collections.abc import Iterable

from cri_api import api_pb2 as pb

NS = 1_000_000_000


class CpuRates:
    """The previous CPU sample of each container and pod, and the rate since then."""

    def __init__(self) -> None:
        self._prev: dict[str, tuple[int, int]] = {}  # key -> (timestamp, cumulative ns)

    def fill(self, key: str, cpu: pb.CpuUsage) -> None:
        """Set ``usage_nano_cores`` where the backend left it out (the first sample has none)."""
        if not cpu.timestamp or not cpu.HasField("usage_core_nano_seconds"):
            return
        now, used = cpu.timestamp, cpu.usage_core_nano_seconds.value
        prev = self._prev.get(key)
        if prev is None or now > prev[0]:
            self._prev[key] = (now, used)
        if cpu.HasField("usage_nano_cores") or prev is None:
            return
        then, before = prev
        if now > then and used >= before:
            cpu.usage_nano_cores.value = (used - before) * NS // (now - then)

    def container(self, stats: pb.ContainerStats) -> pb.ContainerStats:
        if stats.HasField("cpu"):
            self.fill(stats.attributes.id, stats.cpu)
        return stats

    def sandbox(self, stats: pb.PodSandboxStats) -> pb.PodSandboxStats:
        if stats.HasField("linux"):
            if stats.linux.HasField("cpu"):
                self.fill("pod/" + stats.attributes.id, stats.linux.cpu)
            for c in stats.linux.containers:
                self.container(c)
        return stats

    def retain(self, container_ids: Iterable[str], sandbox_ids: Iterable[str]) -> None:
        """Forget the samples of what no longer exists."""
        keep = set(container_ids) | {"pod/" + s for s in sandbox_ids}
        for key in [k for k in self._prev if k not in keep]:
            del self._prev[key]
