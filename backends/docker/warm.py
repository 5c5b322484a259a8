"""Warm pause containers: created and started before a pod asks, for the pods that can take one.

What the engine fixes when it creates a container, with no call to change it
afterwards: the hostname (``Config.Hostname``, which a pod's containers copy
when they join the pause container's network), port mappings, the network,
IPC and PID modes, sysctls, security options, privileged, read-only root, the
runtime, the labels and the cgroup parent. A pause container made before its
pod is known can therefore only serve a pod whose engine config does not
depend on the pod: one that shares the host's network (its hostname is the
node's, it publishes no ports) with the namespaces and security settings of
the items in the pool. DNS is a file the shim writes after the start, warm
or cold alike. Every other pod starts cold, as before.

The shape of the pool's items is the engine config of such a pod minus its
labels and cgroup parent. It starts as that of a kubelet's host-network pod and
follows the pods that come: a host-network pod of another shape starts cold,
and the pool drops its ready items and makes new ones of that shape.

A warm pod differs from a cold one only outside the CRI:
- its pause container's labels name the pool item (``io.cri-shim.id`` =
  ``warm-…``, kind ``warm``), not the pod; the record keeps the link
  (``backend_data["warm_id"]``) and recovery and the event watcher follow it.
  Its engine name is the pod's (renamed when claimed);
- its pause process stays in the handler's ``cgroup_parent`` (the engine's
  default when empty), not the pod's; the pod's containers go into the pod's
  as always. A pause process sleeps and holds well under 1 MiB.

Pool items are in no CRI list. A SIGKILL of the shim leaves them with no
record, so the next start removes them with the other leftovers; a clean stop
removes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import secrets
from collections.abc import Mapping
from typing import Any

import structlog

from backends.contract import SandboxRecord, options
from backends.contract.errors import CriError, InternalError, InvalidArgumentError
from backends.contract.options import Kind, Schema
from backends.contract.pool import CpuMeter, Pool
from cri_api import api_pb2 as pb

from . import convert
from . import labels as lbl
from .context import ENGINE_ID, Shared

log = structlog.get_logger("docker.warm")

WARM_ID = "warm_id"  # backend_data key of a pod that took a warm pause container


POOL_SCHEMA: Schema = {"size": Kind.INT, "refill_interval": Kind.NUMBER, "max_cpu": Kind.NUMBER}


@dataclasses.dataclass(frozen=True, slots=True)
class PoolSettings:
    size: int = 0  # pause containers kept ready; 0: no pool
    refill_interval: float = 0.05  # seconds between two makes of a refill
    max_cpu: float = 0.8  # share of all CPUs busy above which refilling pauses; 0: ignore the CPU

    @classmethod
    def from_table(cls, handler: str, table: object) -> PoolSettings:
        if table is None:
            return cls()
        options.check_section(f"handlers.{handler}.pool", table, POOL_SCHEMA)
        assert isinstance(table, Mapping)
        size, interval = table.get("size", 0), table.get("refill_interval", 0.05)
        max_cpu = table.get("max_cpu", 0.8)
        if max_cpu > 1:
            raise InvalidArgumentError(f"[handlers.{handler}.pool] max_cpu: expected 0..1, got {max_cpu!r}")
        return cls(size, float(interval), float(max_cpu))


def shape_of(cfg: dict[str, Any]) -> str:
    """What a pause container's engine config is, minus what differs between pods of one shape."""
    rest = {k: v for k, v in cfg.items() if k != "Labels"}
    rest["HostConfig"] = {k: v for k, v in cfg["HostConfig"].items() if k != "CgroupParent"}
    return json.dumps(rest, sort_keys=True)


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The engine settings in which two pause container configs differ, with both values."""
    keys = sorted((set(a) | set(b)) - {"Labels", "HostConfig"})
    out = [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]
    ha, hb = a.get("HostConfig") or {}, b.get("HostConfig") or {}
    hkeys = sorted((set(ha) | set(hb)) - {"CgroupParent"})
    return out + [f"HostConfig.{k}: {ha.get(k)!r} -> {hb.get(k)!r}" for k in hkeys if ha.get(k) != hb.get(k)]


def kubelet_host_network_pod() -> pb.PodSandboxConfig:
    """What a kubelet (v1.26) asks for a ``hostNetwork: true`` pod with no security settings of
    its own: the pool's first shape, so that the first such pod is already warm. (For the
    sandbox it asks for the runtime's default seccomp profile.)"""
    ns = pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER, ipc=pb.POD)
    default = pb.SecurityProfile(profile_type=pb.SecurityProfile.RuntimeDefault)
    sc = pb.LinuxSandboxSecurityContext(namespace_options=ns, seccomp=default)
    return pb.PodSandboxConfig(linux=pb.LinuxPodSandboxConfig(security_context=sc))


@dataclasses.dataclass(frozen=True, slots=True)
class WarmPause:
    warm_id: str
    engine_id: str
    shape: str


class WarmPauses:
    """The pool of one docker backend, and how a pod claims an item of it."""

    def __init__(self, shared: Shared, settings: PoolSettings, handler: str) -> None:
        self._shared = shared
        self.settings = settings
        self.starting = 0  # RunPodSandbox calls in progress: the refill waits for them
        # IDs of the items this pool made and still holds (or is making): recovery, which runs
        # after the pool started filling, must not take them for a dead shim's leftovers.
        self.made: set[str] = set()
        self._cpu = CpuMeter()
        self._cfg = convert.sandbox_config(
            "",
            handler,
            0,
            kubelet_host_network_pod(),
            image=shared.engine_images.pause_image,
            network=shared.network,
            runtime=shared.runtime(handler),
            cgroup_parent=shared.cgroup_parent,
            instance=shared.instance,
        )
        self.shape = shape_of(self._cfg)
        self.pool: Pool[WarmPause] = Pool(
            settings.size,
            self._make,
            self._discard,
            lambda _: True,  # claim() looks at the item itself
            self._busy,
            settings.refill_interval,
            name="docker",
        )

    def _busy(self) -> bool:
        return self.starting > 0 or self._cpu.over(self.settings.max_cpu)

    async def _make(self) -> WarmPause:
        shared = self._shared
        cfg, shape = copy.deepcopy(self._cfg), self.shape
        warm_id = "warm-" + secrets.token_hex(16)
        cfg["Labels"] = {lbl.KIND: lbl.WARM, lbl.INSTANCE: shared.instance, lbl.ID: warm_id}
        cfg["HostConfig"]["CgroupParent"] = shared.cgroup_parent
        self.made.add(warm_id)
        data: dict[str, Any] = {}
        try:
            await shared.engine_images.ensure(str(cfg["Image"]))
            eid = await shared.create(lbl.warm_name(warm_id), cfg, data)
        except BaseException:
            # Cancelled mid-create (the pool closes): the engine finished the create all the
            # same and ``data`` holds its ID; the item must not outlive the pool.
            if data.get(ENGINE_ID):
                with contextlib.suppress(CriError):
                    await asyncio.shield(shared.remove(str(data[ENGINE_ID])))
            self.made.discard(warm_id)
            raise
        try:
            await shared.engine.start_container(eid)
        except BaseException:
            await asyncio.shield(shared.remove(eid))
            self.made.discard(warm_id)
            raise
        return WarmPause(warm_id, eid, shape)

    async def _discard(self, item: WarmPause) -> None:
        self.made.discard(item.warm_id)
        with contextlib.suppress(CriError):
            await self._shared.remove(item.engine_id)

    def _drop(self, item: WarmPause) -> None:
        self._shared.spawn(self._discard(item))

    async def claim(self, sandbox: SandboxRecord, cfg: dict[str, Any]) -> dict[str, Any] | None:
        """A running warm pause container made the pod's (its inspect), or None: start cold.

        ``cfg`` is the engine config a cold start would create. Never waits for
        a refill; an item that fails to become the pod is removed.
        """
        shape = shape_of(cfg)
        if shape != self.shape:
            # Pods come in another shape than the pool's: follow them.
            differs = differences(self._cfg, cfg)
            self._cfg, self.shape = copy.deepcopy(cfg), shape
            self.pool.flush()
            log.info(
                "warm.shape_changed",
                differs=differs,
                note="this pod starts cold; the pool now makes pause containers like its",
            )
            return None
        item = self.pool.take()
        if item is None or item.shape != shape:
            if item is not None:
                self._drop(item)
            return None
        shared = self._shared
        try:
            await shared.engine.rename_container(item.engine_id, lbl.sandbox_name(sandbox.id, sandbox.config))
            info = await shared.engine.inspect_container(item.engine_id)
            if not info["State"].get("Running"):
                raise InternalError("warm pause container exited in the pool")
        except (CriError, KeyError) as exc:
            log.warning("warm.claim_failed", error=str(exc), note="the pod starts cold")
            self._drop(item)
            return None
        except BaseException:  # cancelled: the client gave up
            self._drop(item)
            raise
        sandbox.backend_data[WARM_ID] = item.warm_id
        self.made.discard(item.warm_id)  # the pod's now: its record claims it
        return info
