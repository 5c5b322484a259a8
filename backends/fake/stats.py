"""The fake's usage figures: plausible growth from how long each container has run."""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Sequence

from backends.contract import ContainerRecord, ContainerUsage, SandboxRecord, SandboxUsage
from backends.contract.usage import Interface, Layer, Sample
from backends.fake.lifecycle import FakeLifecycle


class FakeStats:
    """The Stats protocol over the fake's containers."""

    def __init__(
        self, lifecycle: FakeLifecycle, mountpoint: str, clock: Callable[[], int] = time.time_ns
    ) -> None:
        self.lifecycle = lifecycle
        self.clock = clock
        self._mountpoint = mountpoint or "/"

    def _container(self, c: ContainerRecord, now: int) -> ContainerUsage:
        run = self.lifecycle.running.get(c.id)
        seconds = (time.monotonic() - run.started_mono) if run is not None else 0.0
        # Plausible growth: 5% of a core, memory that settles logarithmically.
        seed = int(c.id[:4], 16)
        base = (4 + seed % 16) << 20
        ws = int(base + (1 << 20) * math.log1p(seconds)) if run is not None else 0
        sample = Sample(
            timestamp=now,
            cpu_ns=int(seconds * 0.05e9),
            working_set=ws,
            memory_usage=ws + (1 << 20),
            rss=ws,
            page_faults=int(seconds * 10),
        )
        layer = Layer(self._mountpoint, 4096 + int(seconds) * 512, 3 + int(seconds) // 60)
        # The rate is known from the first sample on: the program's.
        return ContainerUsage(sample, layer, cpu_nano_cores=int(0.05e9) if run is not None else 0)

    async def container_stats(self, containers: Sequence[ContainerRecord]) -> dict[str, ContainerUsage]:
        now = self.clock()
        return {c.id: self._container(c, now) for c in containers}

    async def sandbox_stats(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> dict[str, SandboxUsage]:
        now = self.clock()
        running = self.lifecycle.running
        by_sb: dict[str, list[ContainerRecord]] = collections.defaultdict(list)
        for c in containers:
            by_sb[c.sandbox_id].append(c)
        out = {}
        for sb in sandboxes:
            mine = {c.id: self._container(c, now) for c in by_sb.get(sb.id, [])}
            cpu = sum(u.sample.cpu_ns or 0 for u in mine.values())
            sample = Sample(
                timestamp=now,
                cpu_ns=cpu,
                working_set=sum(u.sample.working_set or 0 for u in mine.values()),
                pids=sum(1 for c in by_sb.get(sb.id, []) if c.id in running),
            )
            eth0 = Interface("eth0", rx_bytes=cpu // 1000, rx_errors=0, tx_bytes=cpu // 2000, tx_errors=0)
            out[sb.id] = SandboxUsage(sample, (eth0,), containers=mine)
        return out
