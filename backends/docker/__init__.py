"""The ``docker`` backend: CRI pods and containers on a Docker Engine, through the docker SDK."""

from __future__ import annotations

import hashlib
import os
from typing import Any

from backends.cni.pinned import CniPods
from backends.contract import options
from backends.contract.options import Kind, Schema
from backends.contract.pinning import PinnedImages

from .backend import DockerBackend
from .warm import POOL_SCHEMA, PoolSettings

__all__ = ["DockerBackend", "create"]


SCHEMA: Schema = {
    "endpoint": Kind.STR,
    "network": Kind.STR,
    "runtime": Kind.STR_MAP,  # runtime handler -> engine runtime
    "cgroup_parent": Kind.STR,
    "call_timeout": Kind.NUMBER,
    "instance": Kind.STR,
    "pool": POOL_SCHEMA,
    "pod_network": Kind.STR,
}


def _instance_of(name: str, state_dir: object) -> str:
    # The shim's state directory identifies the shim whose records these
    # are: two shims (or test runs) with their own state never share one.
    if not state_dir:
        return name
    digest = hashlib.sha256(os.path.abspath(str(state_dir)).encode()).hexdigest()[:12]
    return f"{name}-{digest}"


def create(name: str, config: dict[str, Any]) -> DockerBackend:
    """Build the backend from its config table.

    Keys: ``endpoint`` (unix:///var/run/docker.sock), ``pause_image``
    (registry.k8s.io/pause:3.10), ``network`` (bridge), ``runtime`` (runtime
    handler -> engine runtime), ``image_pull_progress_timeout`` (s, 120; 0 disables; its
    old name ``pull_no_progress_timeout`` is read too), ``pinned`` (patterns of images
    reported pinned, besides the pause image: backends.contract.pinning),
    ``cgroup_parent`` (""), ``call_timeout`` (s, 60), ``instance``: a label
    value that scopes recovery, so that several shims (or test runs) can share
    one engine without removing each other's containers; by default the
    handler name, qualified by a hash of ``state_dir`` when that is given.
    ``cgroup_driver`` is what RuntimeConfig reports until the engine has said
    which driver it uses. ``pool`` (a table: ``size`` (0 = off), ``refill_interval``
    (s, 0.05), ``max_cpu`` (0.8)): warm pause containers for host-network pods
    (see warm.py). ``pod_network``: ``builtin`` (the engine network ``network``) or
    ``cni`` (the node's CNI network, from the shim's ``cni`` table: network.py).
    """
    options.check(name, config, SCHEMA)
    runtimes = config.get("runtime") or {}
    state_dir = str(config.get("state_dir", ""))
    return DockerBackend(
        name,
        endpoint=str(config.get("endpoint", "unix:///var/run/docker.sock")),
        pause_image=str(config.get("pause_image", "registry.k8s.io/pause:3.10")),
        network=str(config.get("network", "bridge")),
        runtimes={str(k): v for k, v in runtimes.items()},
        pull_no_progress_timeout=options.pull_progress_timeout(config, 120),
        pinned=PinnedImages.of(config.get("pinned") or ()),
        cgroup_parent=str(config.get("cgroup_parent", "")),
        call_timeout=float(config.get("call_timeout", 60)),
        instance=str(config.get("instance") or _instance_of(name, config.get("state_dir"))),
        cgroup_driver=str(config.get("cgroup_driver", "")),
        state_dir=state_dir,
        pool=PoolSettings.from_table(name, config.get("pool")),
        cni=CniPods.of_handler(name, config, state_dir),
    )
