"""CRI configs -> Engine API container configs (the JSON of POST /containers/create).

Pure functions: everything engine-specific that depends on the live engine
(the pause container's engine ID, the resolved image ID) is passed in.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from typing import Any

from backends.contract import Seccomp, seccomp_of, signal_name
from backends.contract.errors import InvalidArgumentError
from cri_api import api_pb2 as pb

from . import labels as lbl

_PROTO = {pb.TCP: "tcp", pb.UDP: "udp", pb.SCTP: "sctp"}
_PROPAGATION = {
    pb.PROPAGATION_PRIVATE: "rprivate",
    pb.PROPAGATION_HOST_TO_CONTAINER: "rslave",
    pb.PROPAGATION_BIDIRECTIONAL: "rshared",
}


# Capability names by number, as the engine spells them.
CAPABILITIES = (
    "CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP LINUX_IMMUTABLE "
    "NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER SYS_MODULE SYS_RAWIO SYS_CHROOT "
    "SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE "
    "AUDIT_WRITE AUDIT_CONTROL SETFCAP MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ "
    "PERFMON BPF CHECKPOINT_RESTORE"
).split()


_ENGINE_LAST_CAP = CAPABILITIES.index("AUDIT_READ")


@dataclasses.dataclass(frozen=True, slots=True)
class HostFacts:
    """What the engine host allows, probed once."""

    # Without CAP_SYS_RESOURCE runc cannot lower oom_score_adj below 0
    # (it fails with "can't get final child's PID from pipe: EOF").
    negative_oom_score_adj: bool
    # The capabilities root has, when it lacks some the kernel knows; None when
    # it has them all. The engine grants a privileged container (or "ALL")
    # every capability the kernel knows, and runc then fails with "unable to
    # apply caps: operation not permitted" on such a host.
    bounding_caps: tuple[str, ...] | None = None


def probe_host() -> HostFacts:
    cap_sys_resource = 24
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        eff = int(fields["CapEff"].strip(), 16)
        bnd = int(fields["CapBnd"].strip(), 16)
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = min(int(f.read()), len(CAPABILITIES) - 1)
    except (OSError, KeyError, ValueError):
        return HostFacts(negative_oom_score_adj=False)
    missing = [i for i in range(last + 1) if not bnd >> i & 1]
    # Docker 20.10 rejects names past AUDIT_READ (PERFMON, BPF, CHECKPOINT_RESTORE).
    held = tuple(CAPABILITIES[i] for i in range(min(last, _ENGINE_LAST_CAP) + 1) if bnd >> i & 1)
    return HostFacts(
        negative_oom_score_adj=bool(eff >> cap_sys_resource & 1), bounding_caps=held if missing else None
    )


def _host_devices() -> list[dict[str, str]]:
    """Every device node under /dev, as a privileged container gets them."""
    skip = {"pts", "shm", "mqueue", "hugepages", "console", "ptmx", "fd", "core", "stdin", "stdout", "stderr"}
    out = []
    for root, dirs, files in os.walk("/dev"):
        dirs[:] = [d for d in dirs if d not in skip]
        for name in files:
            path = os.path.join(root, name)
            if name in skip:
                continue
            try:
                st = os.stat(path, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                out.append({"PathOnHost": path, "PathInContainer": path, "CgroupPermissions": "rwm"})
    return out


def _ns(sc: pb.LinuxSandboxSecurityContext | pb.LinuxContainerSecurityContext) -> pb.NamespaceOption:
    return sc.namespace_options


def sandbox_host_network(config: pb.PodSandboxConfig) -> bool:
    return _ns(config.linux.security_context).network == pb.NODE


def resolv_conf(dns: pb.DNSConfig) -> str:
    lines = []
    if dns.searches:
        lines.append("search " + " ".join(dns.searches))
    lines += [f"nameserver {s}" for s in dns.servers]
    if dns.options:
        lines.append("options " + " ".join(dns.options))
    return "\n".join(lines) + "\n"


def sandbox_config(
    sandbox_id: str,
    handler: str,
    created_at: int,
    config: pb.PodSandboxConfig,
    *,
    image: str,
    network: str,
    runtime: str | None,
    cgroup_parent: str,
    instance: str,
) -> dict[str, Any]:
    """The pause container of a pod."""
    linux = config.linux
    sc = linux.security_context
    ns = sc.namespace_options
    host_net = ns.network == pb.NODE
    host: dict[str, Any] = {
        "NetworkMode": "host" if host_net else network,
        "PidMode": "host" if ns.pid == pb.NODE else "",
        # "shareable" so that app containers can join it with container:<id>.
        "IpcMode": "host" if ns.ipc == pb.NODE else "shareable",
        "Privileged": sc.privileged,
        "ReadonlyRootfs": sc.readonly_rootfs,
        "CgroupParent": linux.cgroup_parent or cgroup_parent,
        "Sysctls": dict(linux.sysctls),
        "SecurityOpt": security_opts(
            seccomp_of(sc.seccomp if sc.HasField("seccomp") else None, sc.seccomp_profile_path), None, False
        ),
    }
    if runtime:
        host["Runtime"] = runtime
    exposed: dict[str, dict[str, Any]] = {}
    bindings: dict[str, list[dict[str, str]]] = {}
    # With no engine network (a pod on CNI) the engine publishes nothing: the portmap plugin does.
    if not host_net and network != "none":
        for pm in config.port_mappings:
            if pm.container_port <= 0:
                continue
            key = f"{pm.container_port}/{_PROTO.get(pm.protocol, 'tcp')}"
            exposed[key] = {}
            if pm.host_port > 0:
                bindings.setdefault(key, []).append({"HostIp": pm.host_ip, "HostPort": str(pm.host_port)})
    host["PortBindings"] = bindings
    labels = {
        lbl.KIND: lbl.SANDBOX,
        lbl.INSTANCE: instance,
        lbl.ID: sandbox_id,
        lbl.HANDLER: handler,
        lbl.CREATED: str(created_at),
        lbl.CONFIG: lbl.encode_config(config),
    }
    cfg: dict[str, Any] = {
        "Image": image,
        "Labels": labels,
        "ExposedPorts": exposed,
        "HostConfig": host,
        "StopSignal": "SIGTERM",
    }
    # The engine refuses a hostname together with the host's UTS namespace.
    if config.hostname and not host_net:
        cfg["Hostname"] = config.hostname
    return cfg


def _user(sc: pb.LinuxContainerSecurityContext) -> str:
    user = ""
    if sc.run_as_username:
        user = sc.run_as_username
    elif sc.HasField("run_as_user"):
        user = str(sc.run_as_user.value)
    if user and sc.HasField("run_as_group"):
        user += f":{sc.run_as_group.value}"
    return user


def _profile_from_path(path: str) -> pb.SecurityProfile | None:
    """The deprecated string form: runtime/default, docker/default, unconfined, localhost/<ref>."""
    if not path:
        return None
    if path in ("runtime/default", "docker/default"):
        return pb.SecurityProfile(profile_type=pb.SecurityProfile.RuntimeDefault)
    if path == "unconfined":
        return pb.SecurityProfile(profile_type=pb.SecurityProfile.Unconfined)
    if path.startswith("localhost/"):
        return pb.SecurityProfile(profile_type=pb.SecurityProfile.Localhost, localhost_ref=path[10:])
    raise InvalidArgumentError(f"unknown security profile {path!r}")


def security_opts(
    seccomp: Seccomp,
    apparmor: pb.SecurityProfile | None,
    no_new_privs: bool,
) -> list[str]:
    opts: list[str] = []
    if seccomp.kind == "unconfined":
        opts.append("seccomp=unconfined")
    elif seccomp.kind == "localhost":
        opts.append("seccomp=" + seccomp.profile)
    if apparmor is not None:
        if apparmor.profile_type == pb.SecurityProfile.Unconfined:
            opts.append("apparmor=unconfined")
        elif apparmor.profile_type == pb.SecurityProfile.Localhost:
            opts.append("apparmor=" + apparmor.localhost_ref)
    if no_new_privs:
        opts.append("no-new-privileges")
    return opts


def resources(res: pb.LinuxContainerResources) -> dict[str, Any]:
    """Engine resource fields (also the body of POST /containers/{id}/update)."""
    out: dict[str, Any] = {
        "CpuPeriod": res.cpu_period,
        "CpuQuota": res.cpu_quota,
        "CpuShares": res.cpu_shares,
        "Memory": res.memory_limit_in_bytes,
        "CpusetCpus": res.cpuset_cpus,
        "CpusetMems": res.cpuset_mems,
    }
    if res.memory_swap_limit_in_bytes:
        out["MemorySwap"] = res.memory_swap_limit_in_bytes
    elif res.memory_limit_in_bytes:
        # As the kubelet means it: no swap beyond the memory limit.
        out["MemorySwap"] = res.memory_limit_in_bytes
    return out


def oom_score_adj(value: int, facts: HostFacts) -> int:
    if value < 0 and not facts.negative_oom_score_adj:
        return 0
    return max(-1000, min(1000, value))


def container_config(
    container_id: str,
    sandbox_id: str,
    created_at: int,
    config: pb.ContainerConfig,
    sandbox: pb.PodSandboxConfig,
    *,
    image_id: str,
    image_name: str,
    log_path: str,
    pause_engine_id: str,
    target_engine_id: str,
    runtime: str | None,
    cgroup_parent: str,
    facts: HostFacts,
    instance: str,
    stop_signal: int = 0,
) -> dict[str, Any]:
    """``stop_signal``: the CRI Signal chosen for it (``decide_stop_signal``); 0: the config's,
    else the image's, which the engine then picks itself."""
    linux = config.linux
    sc = linux.security_context
    ns = sc.namespace_options
    sandbox_ns = sandbox.linux.security_context.namespace_options
    joined = f"container:{pause_engine_id}"
    host: dict[str, Any] = {
        "NetworkMode": "host" if sandbox_ns.network == pb.NODE else joined,
        "IpcMode": "host" if sandbox_ns.ipc == pb.NODE else joined,
        "CgroupParent": sandbox.linux.cgroup_parent or cgroup_parent,
        "Privileged": sc.privileged,
        "ReadonlyRootfs": sc.readonly_rootfs,
        "CapAdd": list(sc.capabilities.add_capabilities),
        "CapDrop": list(sc.capabilities.drop_capabilities),
        "GroupAdd": [str(g) for g in sc.supplemental_groups],
        "Binds": [bind(m) for m in config.mounts if m.host_path],
        "Devices": [
            {
                "PathOnHost": d.host_path,
                "PathInContainer": d.container_path or d.host_path,
                "CgroupPermissions": d.permissions or "rwm",
            }
            for d in config.devices
        ],
        "SecurityOpt": security_opts(
            seccomp_of(sc.seccomp if sc.HasField("seccomp") else None, sc.seccomp_profile_path),
            sc.apparmor if sc.HasField("apparmor") else _profile_from_path(sc.apparmor_profile),
            sc.no_new_privs,
        ),
        "OomScoreAdj": oom_score_adj(linux.resources.oom_score_adj, facts),
    }
    host.update(resources(linux.resources))
    if ns.pid == pb.NODE or (ns.pid == pb.POD and sandbox_ns.pid == pb.NODE):
        host["PidMode"] = "host"
    elif ns.pid == pb.POD:
        host["PidMode"] = joined
    elif ns.pid == pb.TARGET:
        if not target_engine_id:
            raise InvalidArgumentError(f"target container {ns.target_id!r} of the PID namespace not found")
        host["PidMode"] = f"container:{target_engine_id}"
    if not sc.privileged:
        # An empty list from the kubelet means "the runtime's default", which
        # is the engine's when the field is absent.
        if sc.masked_paths:
            host["MaskedPaths"] = list(sc.masked_paths)
        if sc.readonly_paths:
            host["ReadonlyPaths"] = list(sc.readonly_paths)
    if runtime:
        host["Runtime"] = runtime
    caps = facts.bounding_caps
    if caps is not None:
        if sc.privileged:
            _emulate_privileged(host, caps)
        elif any(c.upper() in ("ALL", "CAP_ALL") for c in host["CapAdd"]):
            host["CapAdd"] = list(caps)
    labels = {
        lbl.KIND: lbl.CONTAINER,
        lbl.INSTANCE: instance,
        lbl.ID: container_id,
        lbl.SANDBOX_ID: sandbox_id,
        lbl.CREATED: str(created_at),
        lbl.CONFIG: lbl.encode_config(config),
        lbl.LOG_PATH: log_path,
        lbl.IMAGE_NAME: image_name,
    }
    cfg: dict[str, Any] = {
        "Image": image_id,
        # KeyValue.value is bytes in the schema; the engine takes JSON strings.
        "Env": [f"{kv.key}={kv.value.decode('utf-8', 'replace')}" for kv in config.envs],
        "WorkingDir": config.working_dir,
        "Tty": config.tty,
        "OpenStdin": config.stdin,
        "StdinOnce": config.stdin_once,
        "AttachStdin": config.stdin,
        "AttachStdout": True,
        "AttachStderr": not config.tty,
        "User": _user(sc),
        "Labels": labels,
        "HostConfig": host,
    }
    if config.command:
        cfg["Entrypoint"] = list(config.command)
        # A command without args must not inherit the image's CMD as args.
        cfg["Cmd"] = list(config.args)
    elif config.args:
        cfg["Cmd"] = list(config.args)
    stop = signal_name(stop_signal or config.stop_signal)
    if stop:  # else the image's StopSignal, as the engine does
        cfg["StopSignal"] = stop
    return cfg


def _emulate_privileged(host: dict[str, Any], caps: tuple[str, ...]) -> None:
    """A privileged container on a host whose root lacks capabilities (see HostFacts).

    Everything privileged means, with the capabilities root really has:
    no seccomp/AppArmor confinement, no masked or read-only /proc paths,
    every device. Only /sys stays read-only, which the engine ties to its
    privileged flag.
    """
    host["Privileged"] = False
    host["CapAdd"] = list(caps)
    host["CapDrop"] = []
    confinement = ("seccomp=", "apparmor=")
    host["SecurityOpt"] = [o for o in host["SecurityOpt"] if not o.startswith(confinement)] + [
        "seccomp=unconfined",
        "apparmor=unconfined",
    ]
    devices = _host_devices()
    present = {d["PathInContainer"] for d in devices}
    host["Devices"] = devices + [d for d in host["Devices"] if d["PathInContainer"] not in present]
    host["DeviceCgroupRules"] = ["a *:* rwm"]
    # Empty lists, not absent: absent means the engine's defaults.
    host["MaskedPaths"] = []
    host["ReadonlyPaths"] = []


def bind(m: pb.Mount) -> str:
    if ":" in m.host_path or ":" in m.container_path:
        raise InvalidArgumentError(f"mount paths may not contain ':' ({m.host_path} -> {m.container_path})")
    opts = ["ro" if m.readonly else "rw", _PROPAGATION.get(m.propagation, "rprivate")]
    if m.selinux_relabel:
        opts.append("Z")
    # The engine would create a missing source as a directory; the CRI asks
    # for a failure instead, like containerd.
    if not os.path.exists(m.host_path):
        raise InvalidArgumentError(f"mount source {m.host_path!r} does not exist")
    return f"{m.host_path}:{m.container_path}:{','.join(opts)}"
