"""Records → NRI's pod and container messages; NRI adjustments and updates → CRI terms.

Every backend creates containers from a CRI ``ContainerConfig`` and updates them with
CRI ``LinuxContainerResources``, so a plugin's adjustment is applied by rewriting
those before the backend sees them: what the CRI can say (environment, arguments,
annotations, bind mounts, devices, CPU, memory, hugepages, unified cgroup keys, OOM
score) is applied on every backend alike; what it cannot (OCI hooks, rlimits, CDI
devices, namespaces, sysctls, seccomp policies, scheduling, RDT, I/O priority,
network devices, pids limits, cgroup paths, memory policies) is refused with an
error naming the plugin and the field, never dropped silently.
"""

from __future__ import annotations

from backends.contract import ContainerRecord, SandboxRecord
from cri_api import api_pb2 as pb
from cri_api import nri_pb2 as nri

_STATES = {
    pb.CONTAINER_CREATED: nri.CONTAINER_CREATED,
    pb.CONTAINER_RUNNING: nri.CONTAINER_RUNNING,
    pb.CONTAINER_EXITED: nri.CONTAINER_STOPPED,
    pb.CONTAINER_UNKNOWN: nri.CONTAINER_UNKNOWN,
}


class AdjustmentError(Exception):
    """A plugin asked for something the CRI cannot express: the field, in NRI's terms."""


def pod(sb: SandboxRecord) -> nri.PodSandbox:
    cfg = sb.config
    out = nri.PodSandbox(
        id=sb.id,
        name=cfg.metadata.name,
        uid=cfg.metadata.uid,
        namespace=cfg.metadata.namespace,
        labels=dict(cfg.labels),
        annotations=dict(cfg.annotations),
        runtime_handler=sb.handler,
        ips=[ip for ip in (sb.status.ip, *sb.status.additional_ips) if ip],
    )
    out.linux.cgroup_parent = cfg.linux.cgroup_parent
    if cfg.linux.HasField("resources"):
        resources_from_cri(cfg.linux.resources, out.linux.pod_resources)
    if cfg.linux.HasField("overhead"):
        resources_from_cri(cfg.linux.overhead, out.linux.pod_overhead)
    return out


def container(c: ContainerRecord) -> nri.Container:
    cfg = c.config
    st = c.status
    out = nri.Container(
        id=c.id,
        pod_sandbox_id=c.sandbox_id,
        name=cfg.metadata.name,
        state=_STATES.get(st.state, nri.CONTAINER_UNKNOWN),
        labels=dict(cfg.labels),
        annotations=dict(cfg.annotations),
        args=[*cfg.command, *cfg.args],
        env=[f"{kv.key}={kv.value.decode(errors='replace')}" for kv in cfg.envs],
        created_at=c.created_at,
        started_at=st.started_at,
        finished_at=st.finished_at,
        exit_code=st.exit_code,
        status_reason=st.reason,
        status_message=st.message,
        pid=st.pid,
    )
    for m in cfg.mounts:
        options = ["rbind", "ro" if m.readonly else "rw"]
        out.mounts.append(
            nri.Mount(destination=m.container_path, type="bind", source=m.host_path, options=options)
        )
    for d in cfg.devices:
        out.linux.devices.append(nri.LinuxDevice(path=d.container_path))
    resources = c.resources.linux if c.resources is not None else cfg.linux.resources
    resources_from_cri(resources, out.linux.resources)
    if resources.oom_score_adj:
        out.linux.oom_score_adj.value = resources.oom_score_adj
    return out


def resources_from_cri(r: pb.LinuxContainerResources, out: nri.LinuxResources) -> None:
    if r.memory_limit_in_bytes:
        out.memory.limit.value = r.memory_limit_in_bytes
    if r.memory_swap_limit_in_bytes:
        out.memory.swap.value = r.memory_swap_limit_in_bytes
    if r.cpu_shares:
        out.cpu.shares.value = r.cpu_shares
    if r.cpu_quota:
        out.cpu.quota.value = r.cpu_quota
    if r.cpu_period:
        out.cpu.period.value = r.cpu_period
    out.cpu.cpus, out.cpu.mems = r.cpuset_cpus, r.cpuset_mems
    for h in r.hugepage_limits:
        out.hugepage_limits.append(nri.HugepageLimit(page_size=h.page_size, limit=h.limit))
    out.unified.update(r.unified)


# ---------------------------------------------------------------------- adjustments


def adjust(cfg: pb.ContainerConfig, a: nri.ContainerAdjustment) -> None:
    """Apply one plugin's adjustment to ``cfg`` in place; AdjustmentError for what the
    CRI cannot carry (``cfg`` is then partly changed: callers work on a copy)."""
    _refuse_unsupported(a)
    for key, value in a.annotations.items():
        if key.startswith("-"):
            cfg.annotations.pop(key[1:], None)
        else:
            cfg.annotations[key] = value
    for kv in a.env:
        name = kv.key[1:] if kv.key.startswith("-") else kv.key
        kept = [e for e in cfg.envs if e.key != name]
        if not kv.key.startswith("-"):
            kept.append(pb.KeyValue(key=name, value=kv.value.encode()))
        del cfg.envs[:]
        cfg.envs.extend(kept)
    if a.args:
        del cfg.command[:]
        del cfg.args[:]
        cfg.command.extend(a.args)
    for m in a.mounts:
        _adjust_mount(cfg, m)
    linux = a.linux
    for d in linux.devices:
        if not d.path:
            raise AdjustmentError("linux.devices: a device without a path")
        kept_devices = [x for x in cfg.devices if x.container_path != d.path]
        del cfg.devices[:]
        cfg.devices.extend(kept_devices)
        cfg.devices.append(pb.Device(container_path=d.path, host_path=d.path, permissions="rwm"))
    if linux.HasField("resources"):
        apply_resources(linux.resources, cfg.linux.resources)
    if linux.HasField("oom_score_adj"):
        cfg.linux.resources.oom_score_adj = linux.oom_score_adj.value


def _adjust_mount(cfg: pb.ContainerConfig, m: nri.Mount) -> None:
    dest = m.destination
    removing = dest.startswith("-")
    dest = dest[1:] if removing else dest
    kept = [x for x in cfg.mounts if x.container_path != dest]
    del cfg.mounts[:]
    cfg.mounts.extend(kept)
    if removing:
        return
    options = set(m.options)
    if m.type not in ("", "bind") and "bind" not in options and "rbind" not in options:
        raise AdjustmentError(f"mounts: a {m.type!r} mount at {dest} (the CRI carries bind mounts only)")
    if not dest.startswith("/") or not m.source.startswith("/"):
        raise AdjustmentError(f"mounts: {m.source!r} at {dest!r}: both paths must be absolute")
    cfg.mounts.append(pb.Mount(container_path=dest, host_path=m.source, readonly="ro" in options))


def apply_resources(r: nri.LinuxResources, out: pb.LinuxContainerResources) -> None:
    """NRI resources onto CRI ones, in place (what NRI leaves unset is kept)."""
    mem, cpu = r.memory, r.cpu
    for name in ("reservation", "kernel", "kernel_tcp", "swappiness", "disable_oom_killer", "use_hierarchy"):
        if mem.HasField(name):
            raise AdjustmentError(f"linux.resources.memory.{name}")
    for name in ("realtime_runtime", "realtime_period"):
        if cpu.HasField(name):
            raise AdjustmentError(f"linux.resources.cpu.{name}")
    for name in ("blockio_class", "rdt_class", "pids"):
        if r.HasField(name):
            raise AdjustmentError(f"linux.resources.{name}")
    if r.devices:
        raise AdjustmentError("linux.resources.devices")
    if mem.HasField("limit"):
        out.memory_limit_in_bytes = mem.limit.value
    if mem.HasField("swap"):
        out.memory_swap_limit_in_bytes = mem.swap.value
    if cpu.HasField("shares"):
        out.cpu_shares = cpu.shares.value
    if cpu.HasField("quota"):
        out.cpu_quota = cpu.quota.value
    if cpu.HasField("period"):
        out.cpu_period = cpu.period.value
    if cpu.cpus:
        out.cpuset_cpus = cpu.cpus
    if cpu.mems:
        out.cpuset_mems = cpu.mems
    if r.hugepage_limits:
        del out.hugepage_limits[:]
        out.hugepage_limits.extend(
            pb.HugepageLimit(page_size=h.page_size, limit=h.limit) for h in r.hugepage_limits
        )
    for key, value in r.unified.items():
        out.unified[key] = value


def _refuse_unsupported(a: nri.ContainerAdjustment) -> None:
    if a.HasField("hooks") and a.hooks.ByteSize():
        raise AdjustmentError("hooks (OCI hooks)")
    if a.rlimits:
        raise AdjustmentError("rlimits")
    if a.CDI_devices:
        raise AdjustmentError("CDI_devices")
    linux = a.linux
    for name in ("io_priority", "seccomp_policy", "scheduler", "rdt", "memory_policy"):
        if linux.HasField(name):
            raise AdjustmentError(f"linux.{name}")
    if linux.cgroups_path:
        raise AdjustmentError("linux.cgroups_path")
    if linux.namespaces:
        raise AdjustmentError("linux.namespaces")
    if linux.sysctl:
        raise AdjustmentError("linux.sysctl")
    if linux.net_devices:
        raise AdjustmentError("linux.net_devices")
