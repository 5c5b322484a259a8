"""RunvBackend: one VM per pod, containers inside it through the guest agent.

A sandbox is a VM booted by a hypervisor driver (:mod:`.drivers`); its record keeps the VM
in ``backend_data["vm"]`` (and its network in ``["net"]``, or its pinned namespace in
``["netns"]`` on CNI), so that a restarted shim adopts it. This class only names the parts
of the contract: ``lifecycle`` (:mod:`.lifecycle`: the driver, :mod:`.recovery`, and its
halves :mod:`.sandbox`, with its network (:mod:`.plumbing` on the own bridge, :mod:`.cninet`
on CNI) and :mod:`.warm` VMs, and :mod:`.container`; it is ``resources`` too), ``exec``
(:mod:`.exec`), ``stats`` and ``metrics`` (:mod:`.stats`), ``images``
(:mod:`.images.service`, over the store of :mod:`.images.store`, ``image_store``);
``checkpoint`` (on the qemu driver :mod:`.checkpoint`, CRIU in the guest; on the stub
:class:`backends.linux.criu.NeedsCriu`: refused, saying what the host's CRIU says).
They share the driver, the pod networks, the image store and the live pods
(:mod:`.context`, :mod:`.state`).
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import TYPE_CHECKING, Any

from backends import contract
from backends.cni.pinned import CniPods
from backends.contract import errors, options
from backends.contract.pinning import PinnedImages
from backends.contract.pool import PoolFigures
from backends.linux.criu import NeedsCriu
from backends.oci.settings import PullSettings
from backends.runv import config as runv_config
from backends.runv.agent import rro
from backends.runv.drivers.qemu import QemuHypervisor
from backends.runv.drivers.stub import StubHypervisor
from backends.runv.hypervisor import MIB, Fault, Hypervisor
from backends.runv.images.service import VmImages
from backends.runv.images.store import ImageStore
from backends.runv.network import BridgeNetwork
from backends.runv.pool import PoolConfig

from .checkpoint import VmCheckpoints
from .context import VM_CRASH_EXIT, VM_CRASH_REASON, Shared
from .exec import Execs
from .lifecycle import VmLifecycle
from .sandbox import vm_size
from .state import VmProcess
from .stats import RunvStats
from .warm import WarmVMs

__all__ = ["VM_CRASH_EXIT", "VM_CRASH_REASON", "RunvBackend", "VmProcess"]


def _driver(handler: str, config: dict[str, Any], run_dir: str) -> Hypervisor:
    """The hypervisor driver the handler's config names, with its table."""
    driver = str(config.get("driver", "stub"))
    if driver not in ("stub", "qemu"):
        raise errors.InvalidArgumentError(
            f"runv handler {handler!r}: driver must be 'stub' or 'qemu', not {driver!r}"
        )
    table = dict(config.get(driver) or {})
    table.setdefault("run_dir", run_dir)
    return QemuHypervisor(table) if driver == "qemu" else StubHypervisor(table)


def pull_settings(config: dict[str, Any]) -> PullSettings:
    """How the handler's image store pulls: its options (the shim's ``[images]`` section, which
    the handler's table may override, and ``insecure_registries``)."""
    default = PullSettings()
    insecure = config.get("insecure_registries")
    downloads = int(config.get("max_concurrent_downloads", default.max_concurrent_downloads))
    if downloads < 1:
        raise errors.InvalidArgumentError("max_concurrent_downloads: must be at least 1")
    return PullSettings(
        insecure=frozenset(insecure) if insecure else default.insecure,
        config_path=str(config.get("registry_config_path", default.config_path)),
        credentials_file=str(config.get("credentials_file", default.credentials_file)),
        max_concurrent_downloads=downloads,
        progress_timeout=options.pull_progress_timeout(config, default.progress_timeout),
        pinned=tuple(config.get("pinned") or ()),
    )


class RunvBackend:
    """The ``runv`` runtime handler."""

    capabilities = (
        contract.Capability.HOST_NETWORK
        | contract.Capability.SUPPLEMENTAL_GROUPS_POLICY
        | contract.Capability.IMAGE_VOLUMES
        | contract.Capability.USER_NAMESPACES
    )

    def __init__(self, name: str, config: dict[str, Any], hypervisor: Hypervisor | None = None) -> None:
        runv_config.check(name, config)
        self.name = name
        self.config = config
        # Per handler by default, so that two runv handlers (a stub one and a qemu one) never
        # take each other's VMs for leftovers; the handler "runv" keeps the historic paths.
        own = name if re.fullmatch(r"[A-Za-z0-9_.-]+", name) and name not in (".", "..") else "runv"
        self.root = str(config.get("root", f"/var/lib/cri-shim/{own}"))
        run_dir = str(config.get("run_dir", f"/run/cri-shim/{own}"))
        # Pins of pod namespaces under root, not run_dir: every directory there is a VM's.
        self.cni = CniPods.of_handler(name, config, self.root)
        self.driver = str(config.get("driver", "stub"))
        self.hv: Hypervisor = hypervisor if hypervisor is not None else _driver(name, config, run_dir)
        caps = type(self).capabilities
        # The guest binds a share with the flags of Mount.mount_options (runc applies them; an
        # agent older than operations version 3, in a VM booted before an upgrade, is refused them).
        caps |= contract.Capability.MOUNT_OPTIONS
        if self.hv.name == "qemu":
            # A VM has its own kernel (Debian's 6.1: recursive read-only mounts) and network.
            caps = (caps | contract.Capability.RECURSIVE_READ_ONLY_MOUNTS) & ~contract.Capability.HOST_NETWORK
        else:
            if rro.supported():  # the stub's guests run on this kernel
                caps |= contract.Capability.RECURSIVE_READ_ONLY_MOUNTS
        self.capabilities = caps
        self.overhead_vcpus = float(config.get("overhead_vcpus", 0.0))
        self.overhead_memory = int(config.get("overhead_memory_mib", 32)) * MIB
        self.image_store = ImageStore(os.path.join(self.root, "images"), pull_settings(config))
        net_config = dict(config.get("network") or {})
        net_config.setdefault("owner", hashlib.sha256(os.path.abspath(self.root).encode()).hexdigest()[:12])
        self.net = BridgeNetwork(net_config)
        containers_dir = os.path.join(self.root, "containers")
        self._shared = Shared(
            self.hv,
            self.net,
            self.image_store,
            containers_dir=containers_dir,
            agent_timeout=float(config["agent_timeout"]) if config.get("agent_timeout") is not None else None,
            overhead_vcpus=self.overhead_vcpus,
            overhead_memory=self.overhead_memory,
            cni=self.cni,
        )
        # Warm VMs: the shape of a pod without limits unless the pool table says otherwise.
        self.pool_config = PoolConfig.from_table(config.get("pool"), name)
        plain_vcpus, plain_memory = vm_size(0, 100_000, 0, self.overhead_vcpus, self.overhead_memory)
        self.pool_shape = (
            self.pool_config.vcpus or plain_vcpus,
            self.pool_config.memory_mib * MIB or plain_memory,
        )
        self.warm = WarmVMs(self._shared, self.pool_config, self.pool_shape)
        self.pool = self.warm.pool
        pinned = PinnedImages.of(self.image_store.settings.pinned, str(config.get("pause_image", "")))
        self.images = VmImages(self.image_store, containers_dir, pinned)
        self.lifecycle = VmLifecycle(
            self._shared,
            self.warm,
            self.images,
            runc=str(config.get("stub", {}).get("runc", "runc")),
            cgroup_driver=str(config.get("cgroup_driver", "")),
        )
        self.resources = self.lifecycle
        self.exec = Execs(self._shared)
        self.stats = self.metrics = RunvStats(self._shared)
        self.checkpoint: contract.Checkpoint | None = NeedsCriu(name)
        if isinstance(self.hv, QemuHypervisor):
            # CRIU in the guest (checkpoint.py); the stub's containers are the host's processes,
            # and the host's CRIU is what NeedsCriu asks.
            checkpoints = VmCheckpoints(
                name, self._shared, self.images, os.path.join(self.root, "checkpoints"), self.hv.guest_dir
            )
            checkpoints.tidy()  # what a shim killed mid-checkpoint staged
            self.checkpoint = checkpoints

    @property
    def agent_timeout(self) -> float:
        return self._shared.agent_timeout

    @agent_timeout.setter
    def agent_timeout(self, value: float) -> None:
        self._shared.agent_timeout_setting = value

    def why_not(self, capability: contract.Capability) -> str:
        return ""

    def set_pod_cidr(self, cidr: str) -> None:
        """On CNI, the node's pod CIDR goes to the plugins (``ipRanges``, the config template);
        the backend's own bridge keeps its own subnet."""
        if self.cni is not None and self.cni.adds:
            self.cni.set_pod_cidr(cidr)

    def warm_figures(self) -> PoolFigures | None:
        return self.pool.figures() if self.pool.size > 0 else None

    # ------------------------------------------------------------------ test hooks
    def inject(self, fault: Fault, sandbox_id: str | None = None) -> None:
        """Inject a hypervisor fault, into the VM of ``sandbox_id`` when given."""
        self.hv.inject(fault, self._shared.pods[sandbox_id].vm if sandbox_id else None)


if TYPE_CHECKING:
    _: type[contract.Backend] = RunvBackend  # the class is a Backend (mypy checks it here)
