"""The OCI runtime-spec config.json the agent hands to runc."""

from __future__ import annotations

import os
from typing import Any

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


def resolve_user(rootfs: str, user: dict[str, Any]) -> tuple[int, int]:
    """uid/gid of the CRI user spec (uid or name, optional gid) inside the image."""
    name = str(user.get("name") or "")
    uid = user.get("uid")
    gid = user.get("gid")
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
    group = str(user.get("group") or "")
    if group:
        g = _lookup(os.path.join(rootfs, "etc/group"), group, by_name=True)
        if g is None:
            raise ValueError(f"group {group!r} not found in the image")
        gid = g[0]
    return int(uid), int(gid if gid is not None else default_gid)


def build_config(
    spec: dict[str, Any], rootfs: str, etc_files: dict[str, str], cgroup_path: str
) -> dict[str, Any]:
    uid, gid = resolve_user(rootfs, spec.get("user") or {})
    caps = [c for c in DEFAULT_CAPS if c not in set(spec.get("drop_caps") or [])]
    caps += [c for c in spec.get("add_caps") or [] if c not in caps]
    mounts = list(_BASE_MOUNTS)
    if not spec.get("privileged"):
        mounts.append(
            {
                "destination": "/sys/fs/cgroup",
                "type": "cgroup",
                "source": "cgroup",
                "options": ["nosuid", "noexec", "nodev", "relatime", "ro"],
            }
        )
    taken = {m["destination"] for m in spec.get("mounts") or []}
    for dest, src in etc_files.items():
        if dest not in taken:
            mounts.append(
                {"destination": dest, "type": "bind", "source": src, "options": ["rbind", "rprivate"]}
            )
    for m in spec.get("mounts") or []:
        opts = ["rbind", "rprivate", "ro" if m.get("readonly") else "rw"]
        mounts.append(
            {"destination": m["destination"], "type": "bind", "source": m["source"], "options": opts}
        )
    resources: dict[str, Any] = {"devices": [{"allow": False, "access": "rwm"}]}
    res = spec.get("resources") or {}
    if res.get("memory"):
        resources["memory"] = {"limit": int(res["memory"])}
    cpu: dict[str, Any] = {}
    if res.get("cpu_quota"):
        cpu["quota"] = int(res["cpu_quota"])
        cpu["period"] = int(res.get("cpu_period") or 100000)
    if res.get("cpu_shares"):
        cpu["shares"] = int(res["cpu_shares"])
    if cpu:
        resources["cpu"] = cpu
    env = list(spec.get("env") or [])
    if not any(e.startswith("PATH=") for e in env):
        env.insert(0, "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    if spec.get("tty") and not any(e.startswith("TERM=") for e in env):
        env.append("TERM=xterm")
    capset = {"bounding": caps, "effective": caps, "permitted": caps}
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": uid, "gid": gid, "additionalGids": list(spec.get("supplemental_groups") or [])},
            "args": list(spec["args"]),
            "env": env,
            "cwd": spec.get("cwd") or "/",
            "capabilities": capset,
            "noNewPrivileges": bool(spec.get("no_new_privs")),
        },
        "root": {"path": rootfs, "readonly": bool(spec.get("readonly_rootfs"))},
        "mounts": mounts,
        "linux": {
            # net, ipc and uts are the VM's, shared by the pod's containers.
            "namespaces": [{"type": "pid"}, {"type": "mount"}],
            "cgroupsPath": cgroup_path,
            "resources": resources,
            "maskedPaths": []
            if spec.get("privileged")
            else ["/proc/kcore", "/proc/keys", "/proc/timer_list"],
            "readonlyPaths": []
            if spec.get("privileged")
            else ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys"],
        },
    }
