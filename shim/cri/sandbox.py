"""RunPodSandbox, StopPodSandbox, RemovePodSandbox, PodSandboxStatus, ListPodSandbox
and the sandbox stats/metrics RPCs."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import structlog

from backends.contract import (
    Capability,
    ContainerRecord,
    ExitInfo,
    SandboxRecord,
    SandboxStatus,
    Stats,
)
from cri_api import api_pb2 as pb
from shim.cri import sandbox_metrics, stats_messages, validate
from shim.cri.errors import (
    InvalidArgumentError,
    UnimplementedError,
)
from shim.cri.filters import with_labels
from shim.cri.messages import sandbox_pb, sandbox_status_pb
from shim.cri.state import Shim
from shim.cri.store import sandbox_name, sandbox_to_json

log = structlog.get_logger("sandbox")


class SandboxService:
    def __init__(self, shim: Shim) -> None:
        self.shim = shim

    async def run(self, req: pb.RunPodSandboxRequest) -> pb.RunPodSandboxResponse:
        shim = self.shim
        cfg = req.config
        validate.sandbox_config(cfg, req.HasField("config"))
        try:
            backend_name = shim.registry.resolve_name(req.runtime_handler)
        except LookupError as exc:
            raise InvalidArgumentError(f"runtime_handler: {exc}") from None
        backend = shim.registry.get(backend_name)
        if cfg.linux.security_context.namespace_options.network == pb.NODE and not (
            backend.capabilities & Capability.HOST_NETWORK
        ):
            raise UnimplementedError(f"runtime handler {backend_name!r} does not support host networking")
        validate.userns_for(
            cfg, backend.capabilities, backend_name, backend.why_not(Capability.USER_NAMESPACES)
        )
        sid = shim.fresh_id()
        name = sandbox_name(cfg.metadata)
        shim.store.sandbox_names.reserve(name, sid)
        record = SandboxRecord(
            id=sid,
            handler=req.runtime_handler,
            backend=backend_name,
            config=cfg,
            created_at=shim.clock(),
        )
        async with shim.locks.hold(sid):
            try:
                # Recorded before any effect: after a crash, recovery finds the
                # uncommitted record and removes whatever the backend left.
                shim.store.add(record)
            except BaseException:
                shim.store.sandbox_names.release(name, sid)
                raise
            told_nri = False
            try:
                net = await backend.lifecycle.run_sandbox(record)
                # NRI plugins see the pod made (with its addresses) before anyone
                # else can: not listed, not ready, no container can join it yet.
                addresses = SandboxStatus(ready=False, ip=net.ip, additional_ips=net.additional_ips)
                shim.store.update(record, status=addresses)
                told_nri = True
                await shim.nri.run_pod_sandbox(record)
                # Acknowledged means recorded.
                shim.store.update(record, status=dataclasses.replace(addresses, ready=True), committed=True)
            except BaseException:
                await _undo_sandbox(shim, record)
                if told_nri:
                    await shim.nri.remove_pod_sandbox(record)
                raise
        return pb.RunPodSandboxResponse(pod_sandbox_id=sid)

    async def stop(self, req: pb.StopPodSandboxRequest) -> pb.StopPodSandboxResponse:
        # Idempotent by the CRI: an unknown or already-stopped sandbox is OK.
        sb = self.shim.store.sandboxes.find(req.pod_sandbox_id, missing="none")
        if sb is not None:
            async with self.shim.locks.hold(sb.id):
                await stop_sandbox(self.shim, sb)
        return pb.StopPodSandboxResponse()

    async def remove(self, req: pb.RemovePodSandboxRequest) -> pb.RemovePodSandboxResponse:
        shim = self.shim
        # Idempotent by the CRI: an unknown sandbox is OK.
        sb = shim.store.sandboxes.find(req.pod_sandbox_id, missing="none")
        if sb is None:
            return pb.RemovePodSandboxResponse()
        async with shim.locks.hold(sb.id):
            if shim.store.sandboxes.get(sb.id) is None:
                return pb.RemovePodSandboxResponse()
            running = any(c.status.state == pb.CONTAINER_RUNNING for c in shim.store.containers_of(sb.id))
            if sb.status.ready or running:
                # The kubelet stops before it removes; a second stop would only cost
                # a round trip to the runtime. remove_sandbox cleans up either way.
                await stop_sandbox(shim, sb)
            for c in shim.store.containers_of(sb.id):
                await shim.remove_container(c)
            await shim.backend(sb.backend).lifecycle.remove_sandbox(sb)
            shim.store.remove(sb)
            await shim.nri.remove_pod_sandbox(sb)
        return pb.RemovePodSandboxResponse()

    def find(self, ref: str) -> SandboxRecord:
        """The made pod sandbox whose ID is or starts with ``ref``, else NOT_FOUND."""
        return self.shim.store.sandboxes.find(ref, made=True)

    def status(self, req: pb.PodSandboxStatusRequest) -> pb.PodSandboxStatusResponse:
        sb = self.find(req.pod_sandbox_id)
        resp = pb.PodSandboxStatusResponse(status=sandbox_status_pb(sb))
        if req.verbose:
            info = sandbox_to_json(sb)
            info.pop("config", None)
            resp.info["info"] = json.dumps(info)
        return resp

    def list_(self, req: pb.ListPodSandboxRequest) -> pb.ListPodSandboxResponse:
        return pb.ListPodSandboxResponse(items=[sandbox_pb(sb) for sb in self.select(req.filter)])

    def select(self, f: pb.PodSandboxFilter) -> list[SandboxRecord]:
        """The pods a List with filter ``f`` answers: made ones (committed) only; an ID that is
        unknown or ambiguous matches nothing."""
        store = self.shim.store
        if f.id:
            sb = store.sandboxes.find(f.id, missing="quiet")
            candidates = [sb] if sb is not None else []
        else:
            candidates = store.sandboxes.values()
        want_state = f.state.state if f.HasField("state") else None
        keep = [sb for sb in candidates if sb.committed and (want_state is None or sb.state == want_state)]
        return with_labels(keep, f.label_selector)

    # ------------------------------------------------------------------ stats
    async def stats(self, req: pb.PodSandboxStatsRequest) -> pb.PodSandboxStatsResponse:
        sb = self.find(req.pod_sandbox_id)
        stats = _stats_of(self.shim, sb)
        containers = self.shim.store.containers_of(sb.id)
        got = await stats.sandbox_stats([sb], containers)
        return pb.PodSandboxStatsResponse(
            stats=stats_messages.sandbox_stats(
                sb, got.get(sb.id), containers, self.shim.cpu_rates, self.shim.clock()
            )
        )

    async def list_stats(self, req: pb.ListPodSandboxStatsRequest) -> pb.ListPodSandboxStatsResponse:
        shim = self.shim
        f = req.filter
        sandboxes = [
            sb
            for sb in shim.store.sandboxes.values()
            if sb.committed and (not f.id or sb.id.startswith(f.id))
        ]
        sandboxes = with_labels(sandboxes, dict(f.label_selector) if f.label_selector else {})
        resp = pb.ListPodSandboxStatsResponse()
        by_backend: dict[str, list[SandboxRecord]] = {}
        for sb in sandboxes:
            by_backend.setdefault(sb.backend, []).append(sb)
        results = await asyncio.gather(
            *(self._backend_stats(name, group) for name, group in by_backend.items())
        )
        for got in results:
            resp.stats.extend(got)
        return resp

    async def _backend_stats(self, name: str, group: list[SandboxRecord]) -> list[pb.PodSandboxStats]:
        stats = self.shim.backend(name).stats
        if stats is None:
            return []
        containers: list[ContainerRecord] = []
        for sb in group:
            containers.extend(self.shim.store.containers_of(sb.id))
        got = await stats.sandbox_stats(group, containers)
        now = self.shim.clock()
        return [
            stats_messages.sandbox_stats(sb, got[sb.id], containers, self.shim.cpu_rates, now)
            for sb in group
            if sb.id in got
        ]

    async def metric_descriptors(
        self, req: pb.ListMetricDescriptorsRequest
    ) -> pb.ListMetricDescriptorsResponse:
        # Every handler that exports metrics; one descriptor per name.
        exporting = [b for _, b in self.shim.registry.items() if b.metrics is not None]
        if not exporting:
            raise UnimplementedError("no runtime handler exports metrics")
        return pb.ListMetricDescriptorsResponse(descriptors=sandbox_metrics.descriptors())

    async def metrics(self, req: pb.ListPodSandboxMetricsRequest) -> pb.ListPodSandboxMetricsResponse:
        resp = pb.ListPodSandboxMetricsResponse()
        store = self.shim.store
        for _, backend in self.shim.registry.items():
            metrics = backend.metrics
            if metrics is None:
                continue
            sandboxes = [sb for sb in store.sandboxes.values() if sb.backend == backend.name and sb.committed]
            containers = [c for sb in sandboxes for c in store.containers_of(sb.id) if c.committed]
            got = await metrics.sandbox_metrics(sandboxes, containers)
            resp.pod_metrics.extend(
                sandbox_metrics.pod_metrics(sb, got.get(sb.id), containers) for sb in sandboxes
            )
        return resp

    async def update_resources(
        self, req: pb.UpdatePodSandboxResourcesRequest
    ) -> pb.UpdatePodSandboxResourcesResponse:
        """The pod-level resources the kubelet has just given the pod's cgroup (an in-place
        resize): NRI plugins hear of them first (and may refuse), then the backend applies them
        where it owns a pod-level cgroup, and the record keeps them (PodSandboxConfig's
        ``linux.resources`` and ``linux.overhead``), across a restart too. Best effort for the
        kubelet, which goes on with the resize whatever the answer."""
        shim = self.shim
        sb = self.find(req.pod_sandbox_id)
        updater = shim.backend(sb.backend).resources
        if updater is None:
            raise UnimplementedError(f"runtime handler {sb.backend!r} cannot update pod sandbox resources")
        overhead = req.overhead if req.HasField("overhead") else None
        resources = req.resources if req.HasField("resources") else None
        if overhead is None and resources is None:
            raise InvalidArgumentError("neither resources nor overhead is set: nothing to update")
        for field, value in (("overhead", overhead), ("resources", resources)):
            if value is not None:
                validate.linux_resources(value, field)
        async with shim.locks.hold(sb.id):
            shim.check_ready(sb, ": its resources cannot change")
            config = pb.PodSandboxConfig()
            config.CopyFrom(sb.config)
            if overhead is not None:
                config.linux.overhead.CopyFrom(overhead)
            if resources is not None:
                config.linux.resources.CopyFrom(resources)
            await shim.nri.update_pod_sandbox(sb, overhead, resources)
            shim.store.update(sb)  # a full disk refuses the update before the backend applies it
            await updater.update_sandbox_resources(sb, req)
            shim.store.record_effect(sb, config=config)  # with what the backend noted of it (a VM's size)
            shim.nri.post_update_pod_sandbox(sb)
        return pb.UpdatePodSandboxResourcesResponse()


def _stats_of(shim: Shim, sb: SandboxRecord) -> Stats:
    stats = shim.backend(sb.backend).stats
    if stats is None:
        raise UnimplementedError(f"runtime handler {sb.backend!r} does not report stats")
    return stats


async def stop_sandbox(shim: Shim, sb: SandboxRecord) -> None:
    """Kill every container of the sandbox, then stop its infrastructure. Caller holds sb's lock."""
    backend = shim.backend(sb.backend)
    for c in shim.store.containers_of(sb.id):
        if c.status.state not in (pb.CONTAINER_RUNNING, pb.CONTAINER_CREATED):
            continue
        # Each container's lock: a create or start in progress finishes first, so
        # that what it did is stopped here, not torn down under it.
        async with shim.locks.hold(c.id):
            if shim.store.containers.get(c.id) is not c:
                continue  # its create failed and was undone meanwhile
            if c.status.state == pb.CONTAINER_RUNNING:
                await shim.stop_container(backend, c, 0)
            elif c.status.state == pb.CONTAINER_CREATED:
                # Never started: it can no longer start once the sandbox is gone.
                shim.record_exit(c, ExitInfo(exit_code=0, finished_at=shim.clock(), reason="SandboxStopped"))
    if sb.status.ready:
        # NRI plugins hear of the stop once, with the containers stopped and the pod's
        # infrastructure still up (what the plugin may want to look at or release).
        await shim.nri.stop_pod_sandbox(sb)
    await backend.lifecycle.stop_sandbox(sb)
    if sb.status.ready:
        # A stop is never refused for a full disk: it is how a node under disk
        # pressure evicts. The pod is stopped; its record is written when the disk
        # takes it (and docker and runv read a stop off the runtime after a restart).
        shim.store.record_effect(sb, status=dataclasses.replace(sb.status, ready=False))


async def _undo_sandbox(shim: Shim, record: SandboxRecord) -> None:
    """Roll back a failed RunPodSandbox: nothing may be left behind."""
    backend = shim.backend(record.backend)

    async def undo() -> None:
        # Each step whatever the other did (a failed stop must not keep the pod's remains);
        # the original error is what the client must see.
        lifecycle = backend.lifecycle
        for step in (lifecycle.stop_sandbox, lifecycle.remove_sandbox):
            try:
                await step(record)
            except Exception as exc:
                log.error("sandbox.rollback_failed", sandbox_id=record.id, step=step.__name__, error=str(exc))

    await asyncio.shield(undo())
    shim.store.remove(record)
