"""Resource usage in the guest: a container's cgroup counters, the VM's network counters."""

from __future__ import annotations

import os

from backends.linux import cgroup_usage
from backends.runv.agent.guest import Guest
from backends.runv.agent.messages import (
    ContainerMetrics,
    MetricsReply,
    MetricsRequest,
    StatsReply,
    StatsRequest,
)


async def stats(g: Guest, req: StatsRequest) -> StatsReply:
    c = g.get(req.id)
    sample = None
    if not c.exited.is_set() and c.pid:
        sample = g.cgroups.sample(c.pid, expect=c.id)
    if sample is None:
        return StatsReply()
    return StatsReply(
        cpu_ns=sample.cpu_ns or 0,
        memory_bytes=sample.memory_usage or 0,
        working_set_bytes=sample.working_set or 0,
    )


async def metrics(g: Guest, req: MetricsRequest) -> MetricsReply:
    """cAdvisor-style counters of the VM's running containers and of its network."""
    out: dict[str, ContainerMetrics] = {}
    for cid in req.ids:
        c = g.containers.get(cid)
        if c is None or c.exited.is_set() or not c.pid:
            continue
        sample = g.cgroups.sample(c.pid, expect=c.id, full=True)
        if sample is None:
            continue
        out[c.id] = ContainerMetrics(sample=sample, detail=g.cgroups.detail(c.pid, expect=c.id))
    return MetricsReply(containers=out, interfaces=list(cgroup_usage.net_interfaces(os.getpid())))
