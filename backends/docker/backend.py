"""DockerBackend: CRI pods and containers on a Docker Engine.

A sandbox is a pause container; app containers join its network, IPC and
UTS namespaces. The engine container ID of each record is kept in
``record.backend_data["engine_id"]`` and every engine container carries
its CRI ID in a label (see :mod:`.labels`).

This class only names the parts of the contract: ``lifecycle`` (:mod:`.lifecycle`: the
engine, :mod:`.recovery`, and its halves :mod:`.sandbox` and :mod:`.container`; it is
``resources`` too), ``exec`` (:mod:`.exec`), ``stats`` and ``metrics`` (:mod:`.stats`),
``images`` (:mod:`.images`, its list mirrored by :mod:`.image_mirror`, and :mod:`.image_fs`);
``checkpoint`` (:class:`backends.linux.criu.NeedsCriu`: refused, saying what CRIU says
here). They share the engine and the per-object state table (:mod:`.context`,
:mod:`.state`); :mod:`.events` and :mod:`.logs` follow the containers.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from backends.contract import Backend, Capability, Checkpoint
from backends.contract.pinning import PinnedImages
from backends.contract.pool import PoolFigures
from backends.linux.criu import NeedsCriu

from .context import Shared, exit_info
from .engine import EngineClient
from .engine_api import EngineAPI, parse_time
from .events import EventWatcher
from .exec import Execs
from .image_fs import StoreUsage
from .image_volumes import ImageVolumes
from .images import DockerImages, EngineImages
from .lifecycle import DockerLifecycle
from .logs import LogResume
from .network import CniPods
from .pod_files import PodFiles
from .stats import DockerStats
from .warm import PoolSettings, WarmPauses

__all__ = ["DockerBackend", "LogResume", "exit_info", "parse_time"]


class DockerBackend:
    """The ``docker`` runtime handler."""

    def __init__(
        self,
        name: str,
        *,
        endpoint: str = "unix:///var/run/docker.sock",
        pause_image: str = "registry.k8s.io/pause:3.10",
        network: str = "bridge",
        runtimes: dict[str, str] | None = None,
        pull_no_progress_timeout: float = 120.0,
        pinned: PinnedImages | None = None,
        cgroup_parent: str = "",
        call_timeout: float = 60.0,
        instance: str = "",
        cgroup_driver: str = "",
        engine: EngineAPI | None = None,
        state_dir: str = "",
        pool: PoolSettings | None = None,
        cni: CniPods | None = None,
    ) -> None:
        self.name = name
        self.instance = instance or name
        # ``engine``: another implementation of the engine API (the recording fake in tests).
        self.engine: EngineAPI = engine or EngineClient(endpoint, call_timeout=call_timeout)
        self._shared = Shared(
            self.engine,
            EngineImages(self.engine, pause_image, pull_no_progress_timeout, pinned),
            instance=self.instance,
            network=network,
            runtimes=dict(runtimes or {}),
            cgroup_parent=cgroup_parent,
            volumes=ImageVolumes(os.path.join(state_dir, "image-volumes") if state_dir else ""),
            cni=cni,
            pod_files=PodFiles(os.path.join(state_dir, "pod-files") if state_dir else ""),
        )
        self.states = self._shared.states
        pool = pool or PoolSettings()
        self.warm = WarmPauses(self._shared, pool, name) if pool.size > 0 else None
        self._store_usage = StoreUsage(self.engine, self._shared.spawn)
        self.exec = Execs(self._shared)
        self.lifecycle = DockerLifecycle(
            self._shared,
            handler=name,
            warm=self.warm,
            events=EventWatcher(self._shared),
            execs=self.exec,
            store_usage=self._store_usage,
            cgroup_driver=cgroup_driver,
        )
        self.resources = self.lifecycle
        self.images = DockerImages(self._shared.engine_images, self._store_usage)
        self.stats = self.metrics = DockerStats(self._shared)
        self.checkpoint: Checkpoint | None = NeedsCriu(name)

    @property
    def capabilities(self) -> Capability:
        """Image volumes once the engine's storage driver is known to allow them (at start)."""
        volumes = Capability.IMAGE_VOLUMES if self._shared.volumes.usable else Capability.NONE
        options = Capability.MOUNT_OPTIONS if self._shared.volumes.flags_usable else Capability.NONE
        return Capability.HOST_NETWORK | volumes | options

    def why_not(self, capability: Capability) -> str:
        """The engine's limits, said in the shim's refusals."""
        if capability & Capability.USER_NAMESPACES:
            return (
                "the Docker Engine's user namespaces are daemon-wide (dockerd --userns-remap maps every "
                "container alike); it cannot map a pod's IDs as the kubelet asks (hostUsers: false): use a "
                "runv handler, or hostUsers: true"
            )
        return ""

    def set_pod_cidr(self, cidr: str) -> None:
        """On CNI, the node's pod CIDR goes to the plugins (``ipRanges``, the config template);
        the engine's own network keeps its own range."""
        cni = self._shared.cni
        if cni is not None and cni.adds:
            cni.set_pod_cidr(cidr)

    def warm_figures(self) -> PoolFigures | None:
        return self.warm.pool.figures() if self.warm is not None else None


if TYPE_CHECKING:
    _: type[Backend] = DockerBackend  # the class is a Backend (mypy checks it here)
