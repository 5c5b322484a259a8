"""/etc/hosts and /etc/resolv.conf of a pod on CNI, written by the backend instead of the engine.

A pod on CNI gets its network from the plugins, never from the engine, so its pause container is
created with the engine's networking off (``NetworkDisabled``): the engine then makes no network
sandbox for it and adds no prestart hook that runs the engine's binary again inside runc, which
was half of what the engine spent on a pause container (measured here: 81-92 ms of CPU against
162-229 ms with network mode ``none`` alone). It also writes no hosts or resolv.conf for such a
container, so the backend writes both, under ``<root>/<sandbox id>/``, and the pod's app containers
bind them where the engine bound its own:

- ``hosts``: what the engine writes for a container with no network (localhost and the IPv6
  names); the kubelet mounts a hosts file of its own over it in the pods it runs;
- ``resolv.conf``: the pod's DNS config; with none, the host's own, less its loopback
  nameservers (unreachable from the pod's namespace; the engine's defaults when none is left),
  as the engine does.

A mount of the same path in a container's config wins (the engine refuses two mounts on one
path). The files go with the pod (RemovePodSandbox, or the rollback of a failed start); a
restarted shim sweeps those of pods it no longer has.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable

from backends.linux.files import unclaimed
from cri_api import api_pb2 as pb

from . import convert

POD_FILES = "pod_files"  # backend_data: the directory of a pod's own hosts and resolv.conf

HOSTS = (
    "127.0.0.1\tlocalhost\n"
    "::1\tlocalhost ip6-localhost ip6-loopback\n"
    "fe00::0\tip6-localnet\n"
    "ff00::0\tip6-mcastprefix\n"
    "ff02::1\tip6-allnodes\n"
    "ff02::2\tip6-allrouters\n"
)
# What the engine puts in a container's resolv.conf when the host's names no server it can reach.
FALLBACK_SERVERS = ("8.8.8.8", "8.8.4.4")
HOST_RESOLV_CONF = "/etc/resolv.conf"


def _loopback(address: str) -> bool:
    return address.startswith("127.") or address == "::1"


def resolv_from_host(text: str) -> str:
    """The host's resolv.conf as a pod on its own network sees it: loopback nameservers dropped."""
    lines, servers = [], 0
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "nameserver":
            if _loopback(words[1]):
                continue
            servers += 1
        lines.append(line)
    if not servers:
        lines += [f"nameserver {s}" for s in FALLBACK_SERVERS]
    return "\n".join(lines) + "\n"


def _write(path: str, content: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(content)
    os.replace(tmp, path)


class PodFiles:
    """The pods' own hosts and resolv.conf files of one docker handler, under ``root``."""

    def __init__(self, root: str, host_resolv_conf: str = HOST_RESOLV_CONF) -> None:
        self.root = root
        self.host_resolv_conf = host_resolv_conf

    def write(self, sandbox_id: str, dns: pb.DNSConfig | None) -> str:
        """Write the pod's files (blocking: call it off the loop); their directory."""
        if not self.root:
            raise ValueError("pod files need a state_dir")
        d = os.path.join(self.root, sandbox_id)
        os.makedirs(d, mode=0o755, exist_ok=True)
        if dns is not None:
            resolv = convert.resolv_conf(dns)
        else:
            try:
                with open(self.host_resolv_conf) as f:
                    resolv = resolv_from_host(f.read())
            except OSError:
                resolv = resolv_from_host("")
        _write(os.path.join(d, "hosts"), HOSTS)
        _write(os.path.join(d, "resolv.conf"), resolv)
        return d

    def remove(self, sandbox_id: str) -> None:
        if self.root:
            shutil.rmtree(os.path.join(self.root, sandbox_id), ignore_errors=True)

    def sweep(self, known: Iterable[str]) -> None:
        """Remove the files of pods this handler no longer has (after a restart)."""
        for name in unclaimed(self.root, known):
            self.remove(name)


def binds(directory: str, config: pb.ContainerConfig) -> list[str]:
    """The engine binds of a pod's files into one of its containers, but for paths it mounts itself."""
    taken = {os.path.normpath(m.container_path) for m in config.mounts}
    return [
        f"{os.path.join(directory, name)}:{target}"
        for name, target in (("hosts", "/etc/hosts"), ("resolv.conf", "/etc/resolv.conf"))
        if target not in taken
    ]
