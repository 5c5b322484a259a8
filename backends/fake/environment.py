"""What a fake container's command sees: its files, environment, host name, processes, privileges.

The built-in shell (:mod:`backends.fake.shell`) runs a container's command
and its execs over this: the files of :mod:`backends.fake.files` (the pod's
``/etc/hostname``, ``/etc/hosts``, ``/etc/resolv.conf``, sysctls and
``/proc/mounts`` as a runtime would make them, and the kubelet's volumes;
read-only but for the volumes with readOnlyRootFilesystem), the container's
environment, its pod's ports (:mod:`backends.fake.ports`, where its
``httpd`` listens), and the uid and capabilities its security context gives.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence

from backends.contract import ContainerRecord, SandboxRecord
from backends.fake.files import ContainerFiles, Mount
from backends.fake.shell import Privileges, ShellIO
from backends.fake.shell.caller import DEFAULT_CAPABILITIES, Network
from backends.fake.shell.tools.security import sysctl_path
from cri_api import api_pb2 as pb

Write = Callable[[bytes], Awaitable[None]]

_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def hostname_of(c: ContainerRecord, sb: SandboxRecord | None) -> str:
    return (sb.config.hostname if sb else "") or c.sandbox_id[:12]


# Contents many containers have alike (/proc/mounts of one pod spec, a cluster's resolv.conf), one
# object each: at 30,000 containers a copy apiece was ~20 MiB. Bounded: past it, copies again.
_SHARED: dict[bytes, bytes] = {}
_SHARED_MAX = 4096


def _shared(data: bytes) -> bytes:
    kept = _SHARED.get(data)
    if kept is not None:
        return kept
    if len(_SHARED) < _SHARED_MAX:
        _SHARED[data] = data
    return data


def container_files(
    c: ContainerRecord, sb: SandboxRecord | None, image_files: Mapping[str, bytes] | None = None
) -> ContainerFiles:
    """A new container's files: its image's, what its runtime writes for its pod, and its mounts."""
    hostname = hostname_of(c, sb)
    own: dict[str, bytes] = dict(image_files or {})
    own |= {
        "/etc/hostname": f"{hostname}\n".encode(),
        "/etc/hosts": f"127.0.0.1\tlocalhost\n{sb.status.ip if sb else ''}\t{hostname}\n".encode(),
        "/etc/passwd": b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/home:/bin/false\n",
        "/etc/group": b"root:x:0:\nnobody:x:65534:\n",
        "/proc/mounts": _shared(proc_mounts(c.config).encode()),
    }
    if sb is not None:
        dns = sb.config.dns_config
        resolv = "".join(f"nameserver {s}\n" for s in dns.servers)
        if dns.searches:
            resolv += "search " + " ".join(dns.searches) + "\n"
        if dns.options:
            resolv += "options " + " ".join(dns.options) + "\n"
        own["/etc/resolv.conf"] = _shared(resolv.encode())
        for key, value in sb.config.linux.sysctls.items():
            own[sysctl_path(key)] = f"{value}\n".encode()
    mounts = [
        Mount(
            m.container_path,
            m.host_path,
            m.readonly or "ro" in m.mount_options,
            noexec="noexec" in m.mount_options,
        )
        for m in c.config.mounts
        if m.container_path
    ]
    files = ContainerFiles(own, mounts)
    for directory in ("/root", "/tmp", "/var/log", "/home"):
        files.memory.mkdir(directory, parents=True)
    files.memory.share_dirs()
    if c.config.linux.security_context.readonly_rootfs:
        files.memory.read_only_root(writable=("/dev", "/proc"))
    return files


# What a runtime mounts in every container besides its root, as /proc/mounts shows them.
_SYSTEM_MOUNTS = (
    "proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0",
    "tmpfs /dev tmpfs rw,nosuid,size=65536k,mode=755 0 0",
    "devpts /dev/pts devpts rw,nosuid,noexec,relatime,gid=5,mode=620,ptmxmode=666 0 0",
    "mqueue /dev/mqueue mqueue rw,nosuid,nodev,noexec,relatime 0 0",
    "sysfs /sys sysfs {sys},nosuid,nodev,noexec,relatime 0 0",
    "cgroup /sys/fs/cgroup cgroup2 {sys},nosuid,nodev,noexec,relatime 0 0",
    "shm /dev/shm tmpfs rw,nosuid,nodev,noexec,relatime,size=65536k 0 0",
)
# The masked paths that are directories (a read-only tmpfs hides them); the others are files,
# /dev/null bound over them.
_MASKED_DIRECTORIES = frozenset({"/proc/acpi", "/proc/asound", "/proc/scsi", "/sys/firmware"})


def proc_mounts(config: pb.ContainerConfig) -> str:
    """/proc/mounts of a container: its root, the system mounts, its CRI mounts, and the masked
    and read-only paths its security context names (the kubelet's defaults, unless privileged or
    procMount Unmasked), as runc mounts them."""
    sc = config.linux.security_context
    lines = [f"overlay / overlay {'ro' if sc.readonly_rootfs else 'rw'},relatime 0 0"]
    lines += [m.format(sys="rw" if sc.privileged else "ro") for m in _SYSTEM_MOUNTS]
    for m in config.mounts:
        if m.container_path:
            lines.append(f"/dev/root {m.container_path} ext4 {'ro' if m.readonly else 'rw'},relatime 0 0")
    for path in sc.masked_paths:
        if path in _MASKED_DIRECTORIES or path.startswith("/sys/devices/"):
            lines.append(f"tmpfs {path} tmpfs ro,relatime 0 0")
        else:
            lines.append(f"tmpfs {path} tmpfs rw,nosuid,size=65536k,mode=755 0 0")
    lines += [f"proc {path} proc ro,nosuid,nodev,noexec,relatime 0 0" for path in sc.readonly_paths]
    return "".join(line + "\n" for line in lines)


def privileges(c: ContainerRecord, image_uid: int | None) -> Privileges:
    """The uid, groups and capabilities of the container's processes: its security context's
    runAsUser, else its image's user, else root."""
    sc = c.config.linux.security_context
    uid = sc.run_as_user.value if sc.HasField("run_as_user") else image_uid or 0
    gid = sc.run_as_group.value if sc.HasField("run_as_group") else 0
    added = {cap.upper().removeprefix("CAP_") for cap in sc.capabilities.add_capabilities}
    dropped = {cap.upper().removeprefix("CAP_") for cap in sc.capabilities.drop_capabilities}
    base = frozenset() if "ALL" in dropped else DEFAULT_CAPABILITIES
    caps = frozenset({"ALL"}) if sc.privileged or "ALL" in added else (base - dropped) | added
    return Privileges(uid, gid, tuple(sc.supplemental_groups), caps, sc.no_new_privs)


def command_of(c: ContainerRecord, entrypoint: Sequence[str] = (), cmd: Sequence[str] = ()) -> list[str]:
    """What the container runs, as Kubernetes combines its config with its image's ENTRYPOINT and
    CMD: its command replaces both; with no command, its args (else the CMD) follow the ENTRYPOINT."""
    command, args = list(c.config.command), list(c.config.args)
    if not command:
        command, args = list(entrypoint), args or list(cmd)
    return command + args


def shell_io(
    c: ContainerRecord,
    sb: SandboxRecord | None,
    files: ContainerFiles,
    stdout: Write,
    stderr: Write,
    stdin: Callable[[], Awaitable[bytes]] | None = None,
    processes: Callable[[], list[tuple[int, str]]] | None = None,
    network: Network | None = None,
    image_uid: int | None = None,
) -> ShellIO:
    """How the shell runs in container ``c``, for its command or for an exec in it; ``processes``
    are those of its PID namespace (:mod:`backends.fake.pids`)."""
    env = {"PATH": _PATH, "HOSTNAME": hostname_of(c, sb), "HOME": "/root"}
    env.update({kv.key: kv.value.decode(errors="replace") for kv in c.config.envs})

    return ShellIO(
        files,
        env,
        hostname=hostname_of(c, sb),
        cwd=c.config.working_dir or "/",
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        processes=processes,
        network=network,
        privileges=privileges(c, image_uid),
    )
