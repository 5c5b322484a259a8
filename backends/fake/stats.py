"""The fake's usage figures: plausible growth from how long each container has run."""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Sequence

from backends.contract import ContainerRecord, SandboxRecord, container_stats_of, sandbox_stats_of
from backends.fake.lifecycle import FakeLifecycle
from cri_api import api_pb2 as pb


class FakeStats:
    """The Stats protocol over the fake's containers."""

    def __init__(
        self, lifecycle: FakeLifecycle, mountpoint: str, clock: Callable[[], int] = time.time_ns
    ) -> None:
        self.lifecycle = lifecycle
        self.clock = clock
        self._mountpoint = mountpoint or "/"

    def _container_stats(self, c: ContainerRecord, now: int) -> pb.ContainerStats:
        st = container_stats_of(c)
        run = self.lifecycle.running.get(c.id)
        seconds = (time.monotonic() - run.started_mono) if run is not None else 0.0
        # Plausible growth: 5% of a core, memory that settles logarithmically.
        seed = int(c.id[:4], 16)
        st.cpu.timestamp = now
        st.cpu.usage_core_nano_seconds.value = int(seconds * 0.05e9)
        st.cpu.usage_nano_cores.value = int(0.05e9) if run is not None else 0
        base = (4 + seed % 16) << 20
        ws = int(base + (1 << 20) * math.log1p(seconds)) if run is not None else 0
        st.memory.timestamp = now
        st.memory.working_set_bytes.value = ws
        st.memory.usage_bytes.value = ws + (1 << 20)
        st.memory.rss_bytes.value = ws
        st.memory.page_faults.value = int(seconds * 10)
        st.writable_layer.timestamp = now
        st.writable_layer.fs_id.mountpoint = self._mountpoint
        st.writable_layer.used_bytes.value = 4096 + int(seconds) * 512
        st.writable_layer.inodes_used.value = 3 + int(seconds) // 60
        return st

    async def container_stats(self, containers: Sequence[ContainerRecord]) -> dict[str, pb.ContainerStats]:
        now = self.clock()
        return {c.id: self._container_stats(c, now) for c in containers}

    async def sandbox_stats(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> dict[str, pb.PodSandboxStats]:
        now = self.clock()
        running = self.lifecycle.running
        by_sb: dict[str, list[ContainerRecord]] = collections.defaultdict(list)
        for c in containers:
            by_sb[c.sandbox_id].append(c)
        out = {}
        for sb in sandboxes:
            st = sandbox_stats_of(sb)
            lin = st.linux
            cpu = mem = 0
            for c in by_sb.get(sb.id, []):
                cs = self._container_stats(c, now)
                lin.containers.append(cs)
                cpu += cs.cpu.usage_core_nano_seconds.value
                mem += cs.memory.working_set_bytes.value
            lin.cpu.timestamp = now
            lin.cpu.usage_core_nano_seconds.value = cpu
            lin.memory.timestamp = now
            lin.memory.working_set_bytes.value = mem
            lin.process.timestamp = now
            lin.process.process_count.value = sum(1 for c in by_sb.get(sb.id, []) if c.id in running)
            lin.network.timestamp = now
            iface = lin.network.default_interface
            iface.name = "eth0"
            iface.rx_bytes.value = cpu // 1000
            iface.tx_bytes.value = cpu // 2000
            out[sb.id] = st
        return out
