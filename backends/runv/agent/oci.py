"""The OCI runtime-spec config.json the agent hands to runc."""

from __future__ import annotations

import os
from typing import Any

from backends.runv.agent.messages import ContainerSpec, Seccomp, User

DEFAULT_CAPS = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
]

# Every capability of Linux 5.9+ (runc ignores those the kernel lacks), for privileged and "ALL".
ALL_CAPS = [
    "CAP_" + n
    for n in (
        "CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP LINUX_IMMUTABLE "
        "NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER SYS_MODULE SYS_RAWIO "
        "SYS_CHROOT SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE SYS_RESOURCE SYS_TIME "
        "SYS_TTY_CONFIG MKNOD LEASE AUDIT_WRITE AUDIT_CONTROL SETFCAP MAC_OVERRIDE MAC_ADMIN SYSLOG "
        "WAKE_ALARM BLOCK_SUSPEND AUDIT_READ PERFMON BPF CHECKPOINT_RESTORE"
    ).split()
]


def available_caps() -> set[str]:
    """Capabilities this process (the agent, root of the VM) can hand out: its bounding set.

    A container cannot get more; asking runc for more fails ("unable to apply caps").
    """
    return _own_caps("CapBnd:")


def oom_score_adj(value: int, caps: set[str]) -> int:
    """The oom_score_adj runc can give the container: lowering it below 0 needs CAP_SYS_RESOURCE,
    which a VM's agent has and the stub's (a namespace of a host where root may lack it) may not;
    without it a negative value is 0, as the docker backend does, rather than a failed start."""
    value = max(-1000, min(1000, value))
    return 0 if value < 0 and "CAP_SYS_RESOURCE" not in caps else value


def effective_caps() -> set[str]:
    """Capabilities this process has in effect now (CapEff)."""
    return _own_caps("CapEff:")


def _own_caps(field: str) -> set[str]:
    """The capabilities of one mask of /proc/self/status (``field``: "CapBnd:", "CapEff:");
    all of them when it cannot be read."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field):
                    mask = int(line.split()[1], 16)
                    return {c for i, c in enumerate(ALL_CAPS) if mask >> i & 1}
    except (OSError, ValueError):
        pass
    return set(ALL_CAPS)


DEFAULT_MASKED = ["/proc/kcore", "/proc/keys", "/proc/timer_list"]
DEFAULT_READONLY = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys"]

# The runtime default seccomp profile: allow, but deny (EPERM) what a container must not do
# to its kernel. A denylist, smaller than Docker's allowlist; the calls that CAP_SYS_ADMIN
# legitimately needs are only denied without that capability.
DENIED_SYSCALLS = (
    "acct add_key bpf clock_adjtime clock_settime create_module delete_module finit_module "
    "get_kernel_syms init_module ioperm iopl kcmp kexec_file_load kexec_load keyctl "
    "lookup_dcookie nfsservctl open_by_handle_at perf_event_open ptrace query_module quotactl "
    "reboot request_key settimeofday stime swapon swapoff sysfs _sysctl uselib userfaultfd "
    "ustat vm86 vm86old process_vm_readv process_vm_writev"
).split()
DENIED_WITHOUT_SYS_ADMIN = "mount umount umount2 unshare setns pivot_root name_to_handle_at".split()
EPERM = 1
_SECCOMP_KEYS = ("defaultAction", "defaultErrnoRet", "architectures", "flags", "listenerPath")


def seccomp_config(seccomp: Seccomp | None, caps: list[str]) -> dict[str, Any] | None:
    """OCI linux.seccomp from the agent spec's seccomp (runtime default or a Docker-format profile)."""
    if seccomp is None:
        return None
    if seccomp.default:
        names = list(DENIED_SYSCALLS)
        if "CAP_SYS_ADMIN" not in caps:
            names += DENIED_WITHOUT_SYS_ADMIN
        return {
            "defaultAction": "SCMP_ACT_ALLOW",
            "syscalls": [{"names": names, "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM}],
        }
    if seccomp.profile is None:
        return None
    profile = dict(seccomp.profile)
    out: dict[str, Any] = {k: profile[k] for k in _SECCOMP_KEYS if k in profile}
    out.setdefault("defaultAction", "SCMP_ACT_ALLOW")
    if "archMap" in profile and "architectures" not in out:
        arches: list[str] = []
        for entry in profile["archMap"] or []:
            arches += [entry["architecture"], *(entry.get("subArchitectures") or [])]
        out["architectures"] = arches
    rules = []
    for rule in profile.get("syscalls") or []:
        names = list(rule.get("names") or ([rule["name"]] if rule.get("name") else []))
        inc = rule.get("includes") or {}
        exc = rule.get("excludes") or {}
        # Docker-format conditions on capabilities: keep the rule only where it applies.
        if inc.get("caps") and not set(inc["caps"]) <= set(caps):
            continue
        if exc.get("caps") and set(exc["caps"]) & set(caps):
            continue
        if not names:
            continue
        oci_rule = {"names": names, "action": rule.get("action", "SCMP_ACT_ERRNO")}
        for key in ("errnoRet", "args"):
            if rule.get(key) is not None:
                oci_rule[key] = rule[key]
        rules.append(oci_rule)
    out["syscalls"] = rules
    return out


_BASE_MOUNTS: list[dict[str, Any]] = [
    {"destination": "/proc", "type": "proc", "source": "proc"},
    {
        "destination": "/dev",
        "type": "tmpfs",
        "source": "tmpfs",
        "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
    },
    {
        "destination": "/dev/pts",
        "type": "devpts",
        "source": "devpts",
        "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
    },
    {
        "destination": "/dev/shm",
        "type": "tmpfs",
        "source": "shm",
        "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
    },
    {
        "destination": "/dev/mqueue",
        "type": "mqueue",
        "source": "mqueue",
        "options": ["nosuid", "noexec", "nodev"],
    },
    {
        "destination": "/sys",
        "type": "sysfs",
        "source": "sysfs",
        "options": ["nosuid", "noexec", "nodev", "ro"],
    },
]


def _lookup(path: str, key: str, by_name: bool) -> tuple[int, int] | None:
    """(id, gid) from an /etc/passwd or /etc/group style file of the rootfs."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                parts = line.rstrip("\n").split(":")
                if len(parts) < 4:
                    continue
                if (parts[0] == key) if by_name else (parts[2] == key):
                    return int(parts[2]), int(parts[3])
    except (OSError, ValueError):
        return None
    return None


def resolve_user(rootfs: str, user: User) -> tuple[int, int]:
    """uid/gid of the CRI user spec (uid or name, optional gid) inside the image."""
    name = user.name
    uid = user.uid
    gid = user.gid
    passwd = os.path.join(rootfs, "etc/passwd")
    if name:
        found = _lookup(passwd, name, by_name=True)
        if found is None:
            raise ValueError(f"user {name!r} not found in the image")
        uid, default_gid = found
    else:
        uid = int(uid or 0)
        found = _lookup(passwd, str(uid), by_name=False)
        default_gid = found[1] if found else 0
    group = user.group
    if group:
        g = _lookup(os.path.join(rootfs, "etc/group"), group, by_name=True)
        if g is None:
            raise ValueError(f"group {group!r} not found in the image")
        gid = g[0]
    return int(uid), int(gid if gid is not None else default_gid)


def image_groups(rootfs: str, uid: int) -> list[int]:
    """GIDs of the image's /etc/group entries that list the user of ``uid`` (by its /etc/passwd name)."""
    name = ""
    try:
        with open(os.path.join(rootfs, "etc/passwd"), encoding="utf-8", errors="replace") as fh:
            for line in fh:
                parts = line.rstrip("\n").split(":")
                if len(parts) >= 3 and parts[2] == str(uid):
                    name = parts[0]
                    break
        if not name:
            return []
        out = []
        with open(os.path.join(rootfs, "etc/group"), encoding="utf-8", errors="replace") as fh:
            for line in fh:
                parts = line.rstrip("\n").split(":")
                if len(parts) >= 4 and name in parts[3].split(","):
                    out.append(int(parts[2]))
        return out
    except (OSError, ValueError):
        return []


def identity(spec: ContainerSpec, rootfs: str) -> tuple[int, int, list[int]]:
    """uid, gid and supplementary groups (the primary gid first) the container's processes get."""
    uid, gid = resolve_user(rootfs, spec.user)
    groups = [gid, *spec.supplemental_groups]
    if spec.groups_policy != "strict":
        groups += image_groups(rootfs, uid)
    return uid, gid, list(dict.fromkeys(groups))


def build_config(
    spec: ContainerSpec,
    rootfs: str,
    etc_files: dict[str, str],
    cgroup_path: str,
    pid_ns_path: str = "",
    user_ns_path: str = "",
) -> dict[str, Any]:
    """config.json of ``spec``; ``pid_ns_path``: the PID namespace to join (pid_mode pod: the pod's
    shared one; target: the target container's);
    ``user_ns_path``: the pod's user namespace (made with the mappings of ``spec``)."""
    uid, gid, groups = identity(spec, rootfs)
    privileged = spec.privileged
    drop = set(spec.drop_caps)
    add = list(spec.add_caps)
    if privileged or "CAP_ALL" in add:
        caps = list(ALL_CAPS)
    else:
        caps = [c for c in DEFAULT_CAPS if "CAP_ALL" not in drop] + [c for c in add if c != "CAP_ALL"]
    usable = available_caps()
    caps = [c for c in dict.fromkeys(caps) if (privileged or c not in drop) and c in usable]
    mounts = list(_BASE_MOUNTS)
    if privileged:
        mounts = [dict(m, options=[o for o in m.get("options", []) if o != "ro"]) for m in mounts]
    else:
        mounts.append(
            {
                "destination": "/sys/fs/cgroup",
                "type": "cgroup",
                "source": "cgroup",
                "options": ["nosuid", "noexec", "nodev", "relatime", "ro"],
            }
        )
    if spec.uid_mappings:
        # In the pod's user namespace, filesystems of namespaces it does not own (the VM's
        # IPC, network and cgroups) cannot be mounted anew: the VM's are bound in instead.
        kernel_fs = {"mqueue": "/dev/mqueue", "sysfs": "/sys", "cgroup": "/sys/fs/cgroup"}
        mounts = [
            {
                "destination": m["destination"],
                "type": "bind",
                "source": kernel_fs[m["type"]],
                "options": [
                    "rbind",
                    "nosuid",
                    "noexec",
                    "nodev",
                    "ro" if "ro" in m.get("options", []) else "rw",
                ],
            }
            if m.get("type") in kernel_fs
            else m
            for m in mounts
            if m.get("type") not in kernel_fs or os.path.exists(kernel_fs[m["type"]])
        ]
    taken = {m.destination for m in spec.mounts}
    for dest, src in etc_files.items():
        if dest not in taken:
            mounts.append(
                {"destination": dest, "type": "bind", "source": src, "options": ["rbind", "rprivate"]}
            )
    for m in spec.mounts:
        opts = ["rbind", m.propagation or "rprivate", "ro" if m.readonly else "rw", *m.options]
        mounts.append({"destination": m.destination, "type": "bind", "source": m.source, "options": opts})
    resources: dict[str, Any] = {"devices": [{"allow": privileged, "access": "rwm"}]}
    res = spec.resources
    if res.memory:
        resources["memory"] = {"limit": res.memory}
    cpu: dict[str, Any] = {}
    if res.cpu_quota:
        cpu["quota"] = res.cpu_quota
        cpu["period"] = res.cpu_period or 100000
    if res.cpu_shares:
        cpu["shares"] = res.cpu_shares
    if cpu:
        resources["cpu"] = cpu
    env = list(spec.env)
    if not any(e.startswith("PATH=") for e in env):
        env.insert(0, "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    if spec.tty and not any(e.startswith("TERM=") for e in env):
        env.append("TERM=xterm")
    capset = {"bounding": caps, "effective": caps, "permitted": caps}
    # CONTAINER: a PID namespace of its own; POD: the pod's (pid_ns_path, made by the agent);
    # TARGET: another container's (pid_ns_path); NODE: the VM's (the "host" of a container in a VM
    # is its guest).
    namespaces: list[dict[str, str]] = [{"type": "mount"}]
    if pid_ns_path:
        namespaces.insert(0, {"type": "pid", "path": pid_ns_path})
    elif spec.pid_mode == "container":
        namespaces.insert(0, {"type": "pid"})
    masked = spec.masked_paths or DEFAULT_MASKED
    readonly = spec.readonly_paths or DEFAULT_READONLY
    linux: dict[str, Any] = {
        "namespaces": namespaces,
        "cgroupsPath": cgroup_path,
        "resources": resources,
        "maskedPaths": [] if privileged else masked,
        "readonlyPaths": [] if privileged else readonly,
    }
    if any(m.propagation == "rshared" for m in spec.mounts):
        # A BIDIRECTIONAL mount: the container's mount tree shared, so that what the
        # container mounts under it reaches the VM's share and, from there, the host.
        linux["rootfsPropagation"] = "rshared"
    if spec.uid_mappings or spec.gid_mappings:
        namespaces.append({"type": "user", "path": user_ns_path} if user_ns_path else {"type": "user"})
        for key, maps in (("uidMappings", spec.uid_mappings), ("gidMappings", spec.gid_mappings)):
            linux[key] = [{"containerID": m.container_id, "hostID": m.host_id, "size": m.size} for m in maps]
    seccomp = None if privileged else seccomp_config(spec.seccomp, caps)
    if seccomp is not None:
        linux["seccomp"] = seccomp
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": uid, "gid": gid, "additionalGids": groups},
            "args": list(spec.args),
            "env": env,
            "cwd": spec.cwd or "/",
            "capabilities": capset,
            "noNewPrivileges": spec.no_new_privs,
            "oomScoreAdj": oom_score_adj(spec.resources.oom_score_adj, effective_caps()),
        },
        "root": {"path": rootfs, "readonly": spec.readonly_rootfs},
        "mounts": mounts,
        # net, ipc and uts are the VM's, shared by the pod's containers.
        "linux": linux,
    }
