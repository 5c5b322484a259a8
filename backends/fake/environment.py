"""What a fake container's command sees: its files, environment, host name, processes.

The built-in shell (:mod:`backends.fake.shell`) runs a container's command
and its execs over this: the files of :mod:`backends.fake.files` (the pod's
``/etc/hostname``, ``/etc/hosts``, ``/etc/resolv.conf`` and sysctls as a
runtime would make them, and the kubelet's volumes), the container's
environment, its pod's ports (:mod:`backends.fake.ports`, where its
``httpd`` listens), and ``sysctl``, the one command the shell lacks that pods
use to check their pod's settings.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence

from backends.contract import ContainerRecord, SandboxRecord
from backends.fake.files import ContainerFiles, Mount
from backends.fake.shell import ShellIO
from backends.fake.shell.caller import Network

Write = Callable[[bytes], Awaitable[None]]

_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def hostname_of(c: ContainerRecord, sb: SandboxRecord | None) -> str:
    return (sb.config.hostname if sb else "") or c.sandbox_id[:12]


def container_files(
    c: ContainerRecord, sb: SandboxRecord | None, image_files: Mapping[str, bytes] | None = None
) -> ContainerFiles:
    """A new container's files: its image's, what its runtime writes for its pod, and its mounts."""
    hostname = hostname_of(c, sb)
    own: dict[str, bytes] = dict(image_files or {})
    own |= {
        "/etc/hostname": f"{hostname}\n".encode(),
        "/etc/hosts": f"127.0.0.1\tlocalhost\n{sb.status.ip if sb else ''}\t{hostname}\n".encode(),
        "/etc/passwd": b"root:x:0:0:root:/root:/bin/sh\n",
        "/etc/group": b"root:x:0:\n",
    }
    if sb is not None:
        dns = sb.config.dns_config
        resolv = "".join(f"nameserver {s}\n" for s in dns.servers)
        if dns.searches:
            resolv += "search " + " ".join(dns.searches) + "\n"
        if dns.options:
            resolv += "options " + " ".join(dns.options) + "\n"
        own["/etc/resolv.conf"] = resolv.encode()
        for key, value in sb.config.linux.sysctls.items():
            own["/proc/sys/" + key.replace(".", "/")] = f"{value}\n".encode()
    mounts = [Mount(m.container_path, m.host_path, m.readonly) for m in c.config.mounts if m.container_path]
    files = ContainerFiles(own, mounts)
    for directory in ("/root", "/tmp", "/var/log", "/home"):
        files.memory.mkdir(directory, parents=True)
    return files


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
) -> ShellIO:
    """How the shell runs in container ``c``, for its command or for an exec in it; ``processes``
    are those of its PID namespace (:mod:`backends.fake.pids`)."""
    env = {"PATH": _PATH, "HOSTNAME": hostname_of(c, sb), "HOME": "/root"}
    env.update({kv.key: kv.value.decode(errors="replace") for kv in c.config.envs})

    async def sysctl(args: list[str], io: ShellIO) -> int:
        """``sysctl [-n] KEY``: the pod's value, from /proc/sys."""
        names = [a for a in args[1:] if not a.startswith("-")]
        quiet = "-n" in args[1:]
        code = 0
        for name in names:
            try:
                value = io.fs.read("/proc/sys/" + name.replace(".", "/")).decode().strip()
            except OSError:
                await io.stderr(f"sysctl: error: '{name}' is an unknown key\n".encode())
                code = 255
                continue
            await io.stdout(f"{value}\n".encode() if quiet else f"{name} = {value}\n".encode())
        return code

    return ShellIO(
        files,
        env,
        hostname=hostname_of(c, sb),
        cwd=c.config.working_dir or "/",
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        commands={"sysctl": sysctl},
        processes=processes,
        network=network,
    )
