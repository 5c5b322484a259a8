"""Tools whose answers depend on the container's security context (``io.privileges``) and mounts:
id, whoami, nnp (the setuid program of the Kubernetes e2e image nonewprivs), ip link, mount, sysctl."""

from __future__ import annotations

from backends.fake.shell.control import ToolError
from backends.fake.shell.evaluation import Builtin, Shell
from backends.fake.shell.options import getopt


def _names(sh: Shell, path: str) -> dict[int, str]:
    """The names /etc/passwd or /etc/group gives the IDs it lists (the first one of each)."""
    try:
        text = sh.io.fs.read(path).decode(errors="replace")
    except OSError:
        return {}
    names: dict[int, str] = {}
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) > 2 and fields[2].isdecimal():
            names.setdefault(int(fields[2]), fields[0])
    return names


async def _t_id(sh: Shell, argv: list[str]) -> int:
    """id [-u|-g|-G] [-n]: the uid, gid and groups the container's processes run with."""
    opts, _ = getopt(argv, "ugGnr")
    p = sh.io.privileges
    users, groups = _names(sh, "/etc/passwd"), _names(sh, "/etc/group")
    gids = [p.gid, *(g for g in p.groups if g != p.gid)]
    if {"u", "g", "G"} & set(opts):
        ids, table = ([p.uid], users) if "u" in opts else ([p.gid], groups) if "g" in opts else (gids, groups)
        await sh.out(" ".join(table.get(n, str(n)) if "n" in opts else str(n) for n in ids) + "\n")
        return 0

    def named(n: int, table: dict[int, str]) -> str:
        return f"{n}({table[n]})" if n in table else str(n)

    groups_text = ",".join(named(g, groups) for g in gids)
    await sh.out(f"uid={named(p.uid, users)} gid={named(p.gid, groups)} groups={groups_text}\n")
    return 0


async def _t_whoami(sh: Shell, argv: list[str]) -> int:
    uid = sh.io.privileges.uid
    name = _names(sh, "/etc/passwd").get(uid)
    if name is None:
        raise ToolError(f"unknown uid {uid}")
    await sh.out(name + "\n")
    return 0


async def _t_nnp(sh: Shell, argv: list[str]) -> int:
    """The nonewprivs image's program, setuid root: root's uid, unless no_new_privs keeps the caller's
    (allowPrivilegeEscalation: false)."""
    p = sh.io.privileges
    await sh.out(f"Effective uid: {p.uid if p.no_new_privs else 0}\n")
    return 0


async def _t_ip(sh: Shell, argv: list[str]) -> int:
    """ip link add NAME type TYPE, ip link del NAME: allowed with CAP_NET_ADMIN (a privileged
    container), else refused as the kernel refuses them. No other ip command is simulated."""
    args = argv[1:]
    if len(args) < 3 or args[0] != "link" or args[1] not in ("add", "del", "delete"):
        raise ToolError(f"not simulated: ip {' '.join(args)}", 1)
    if not sh.io.privileges.can("NET_ADMIN"):
        await sh.err("ip: RTNETLINK answers: Operation not permitted")
        return 2
    return 0


async def _t_mount(sh: Shell, argv: list[str]) -> int:
    """mount: the container's mounts, from /proc/mounts; mounting anything is not permitted."""
    if len(argv) > 1:
        raise ToolError("permission denied (are you root?)", 255)
    try:
        table = sh.io.fs.read("/proc/mounts").decode(errors="replace")
    except OSError as exc:
        raise ToolError(f"/proc/mounts: {exc.strerror}") from None
    for line in table.splitlines():
        fields = line.split()
        if len(fields) >= 4:
            await sh.out(f"{fields[0]} on {fields[1]} type {fields[2]} ({fields[3]})\n")
    return 0


def sysctl_path(name: str) -> str:
    """/proc/sys/... of a key as sysctl(8) takes it: with dots (``kernel.shm_rmid_forced``, where a
    slash stands for a dot of the name: ``net.ipv4.conf.eth0/100.forwarding``) or with slashes."""
    name = name.strip("./")
    dot, slash = name.find("."), name.find("/")
    if slash != -1 and (dot == -1 or slash < dot):
        return "/proc/sys/" + name
    return "/proc/sys/" + name.replace("/", "\0").replace(".", "/").replace("\0", ".")


def _sysctl_name(path: str) -> str:
    """The dotted name sysctl shows for a /proc/sys path."""
    return path.removeprefix("/proc/sys/").replace(".", "\0").replace("/", ".").replace("\0", "/")


async def _t_sysctl(sh: Shell, argv: list[str]) -> int:
    """sysctl [-n] KEY...: the values of the pod's namespace, from /proc/sys (the keys the pod
    sets are there); sysctl -w KEY=VALUE fails, as /proc/sys is read-only in a container."""
    opts, names = getopt(argv, "nweq")
    code = 0
    for name in names:
        key, assigned, _ = name.partition("=")
        path = sysctl_path(key)
        shown = _sysctl_name(path)
        if "w" in opts or assigned:
            await sh.err(f"sysctl: error setting key '{shown}': Read-only file system")
            code = 1
            continue
        try:
            value = sh.io.fs.read(path).decode(errors="replace").strip()
        except OSError:
            if "e" not in opts:
                await sh.err(f"sysctl: error: '{shown}' is an unknown key")
            code = 255
            continue
        if "q" not in opts:
            await sh.out(f"{value}\n" if "n" in opts else f"{shown} = {value}\n")
    return code


COMMANDS: dict[str, Builtin] = {
    "id": _t_id,
    "whoami": _t_whoami,
    "nnp": _t_nnp,
    "ip": _t_ip,
    "mount": _t_mount,
    "sysctl": _t_sysctl,
}
