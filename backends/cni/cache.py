"""The attachment cache: per (network, container, ifname), the config used, the parameters and the result.

Layout: ``<root>/<network>/<container id>/<ifname>.json``, each written atomically. An entry
is written before an ADD chain runs, with no result, so that a runtime that dies in the middle
still finds what the DEL needs; the chain's result is added when it succeeds, and the entry goes
after a successful DEL (with its container's directory once empty; a network's directory stays:
removing it could race with another container's first write). With the exact config in it, a DEL
works after a restart and after the network config changed or was removed (as libcni's cache
allows).

The files are small and the calls synchronous: the client runs them in a worker thread.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import structlog

from backends.linux.files import write_atomic

log = structlog.get_logger("cri-shim.cni")

_FORMAT = 1


@dataclasses.dataclass(frozen=True, slots=True)
class CacheEntry:
    network: str
    container_id: str
    ifname: str
    netns: str
    cni_args: str
    runtime_args: Mapping[str, Any]
    config: Mapping[str, Any]  # the configuration list, as the ADD ran it
    result: Mapping[str, Any] | None = None  # None while the ADD is under way (or died)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "network": self.network,
            "containerId": self.container_id,
            "ifName": self.ifname,
            "netns": self.netns,
            "cniArgs": self.cni_args,
            "runtimeConfig": dict(self.runtime_args),
            "config": dict(self.config),
            "result": None if self.result is None else dict(self.result),
        }


def _entry(data: object) -> CacheEntry:
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise ValueError("not a cache entry of this format")
    strings = ("network", "containerId", "ifName", "netns", "cniArgs")
    if not all(isinstance(data.get(k), str) for k in strings):
        raise ValueError("a key field is missing")
    if not isinstance(data.get("runtimeConfig"), dict) or not isinstance(data.get("config"), dict):
        raise ValueError("runtimeConfig or config is not an object")
    result = data.get("result")
    if result is not None and not isinstance(result, dict):
        raise ValueError("result is not an object")
    return CacheEntry(
        network=data["network"],
        container_id=data["containerId"],
        ifname=data["ifName"],
        netns=data["netns"],
        cni_args=data["cniArgs"],
        runtime_args=data["runtimeConfig"],
        config=data["config"],
        result=result,
    )


class AttachmentCache:
    def __init__(self, root: str) -> None:
        self.root = root

    def path(self, network: str, container_id: str, ifname: str) -> str:
        # All three are validated names without path separators (config, Attachment).
        return os.path.join(self.root, network, container_id, f"{ifname}.json")

    def write(self, entry: CacheEntry) -> None:
        path = self.path(entry.network, entry.container_id, entry.ifname)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomic(path, json.dumps(entry.to_json()).encode())

    def _load(self, path: str) -> CacheEntry | None:
        try:
            with open(path, "rb") as f:
                return _entry(json.load(f))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("cni cache entry unreadable, ignored", path=path, error=str(exc))
            return None

    def read(self, network: str, container_id: str, ifname: str) -> CacheEntry | None:
        return self._load(self.path(network, container_id, ifname))

    def entries(self, container_id: str = "", ifname: str = "") -> list[CacheEntry]:
        """Every entry, or those of one container (and interface), in any network."""
        found: list[CacheEntry] = []
        for network in sorted(_listdir(self.root)):
            under = os.path.join(self.root, network)
            containers = [container_id] if container_id else sorted(_listdir(under))
            for cid in containers:
                directory = os.path.join(self.root, network, cid)
                names = [f"{ifname}.json"] if ifname else sorted(_listdir(directory))
                for name in names:
                    if name.endswith(".json") and not name.startswith("."):
                        entry = self._load(os.path.join(directory, name))
                        if entry is not None:
                            found.append(entry)
        return found

    def remove(self, entry: CacheEntry) -> None:
        path = self.path(entry.network, entry.container_id, entry.ifname)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        try:
            os.rmdir(os.path.dirname(path))
        except OSError:
            pass  # other interfaces of the container are still cached (or it is gone)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
