"""CreateContainer, StartContainer, StopContainer, RemoveContainer,
UpdateContainerResources, and the reattach to a running container after a restart: a
container is a process in its pod's VM, made by the agent on the image's layers and the
mounts, shared into the VM."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import time

import structlog

from backends import contract
from backends.contract import errors
from backends.runv.agent import messages as m
from backends.runv.images.service import VmImages
from backends.runv.images.store import Image
from cri_api import api_pb2 as pb

from . import spec as specs
from .context import VM_CRASH_EXIT, VM_CRASH_REASON, Shared
from .state import Pod, VmProcess

MOUNT_OPTIONS_SINCE = 3  # the agent's operations version that applies Mount.options

log = structlog.get_logger(__name__)


class Containers:
    def __init__(self, shared: Shared, images: VmImages) -> None:
        self._shared = shared
        self._images = images
        self._selinux_said = False

    async def _image_volume(
        self, pod: Pod, container: contract.ContainerRecord, mnt: pb.Mount, tag: str
    ) -> m.Mount:
        """An image's layers shared into the VM, for the agent to stack read-only at the mount
        (or, where the driver assembles overlays on the host, stacked there: share ``tag``)."""
        shared = self._shared
        img = await self._images.find(mnt.image.image, [mnt.image.user_specified_image])
        layers = shared.image_store.lowers(img)
        if not layers:
            raise errors.InvalidArgumentError(
                f"image {mnt.image.image!r} of {mnt.container_path} has no layers"
            )
        attach_rootfs = getattr(shared.hv, "attach_rootfs", None)
        merged = None
        if attach_rootfs is not None and len(layers) > 1:
            merged = await attach_rootfs(pod.vm, tag, layers, "", "")
        lowers = [merged] if merged is not None else []
        for layer in layers if merged is None else []:
            layer_tag = "layer-" + os.path.basename(os.path.dirname(layer))[:12]
            lowers.append(await shared.hv.attach_share(pod.vm, layer_tag, layer, readonly=True))
        # ContainerStatus reports which image each image volume is (Mount.image.image_ref).
        container.image_volume_refs[mnt.container_path] = img.id
        return m.Mount(
            source="",
            destination=mnt.container_path,
            readonly=True,
            image_lowers=lowers,
            image_sub_path=mnt.image_sub_path,
        )

    async def create_container(
        self, container: contract.ContainerRecord, sandbox: contract.SandboxRecord
    ) -> None:
        shared = self._shared
        hv = shared.hv
        pod = shared.pod(sandbox.id)
        agent = shared.agent(pod)
        cfg = container.config
        for mnt in cfg.mounts:
            if any(o != "ro" for o in mnt.mount_options) and pod.agent_version < MOUNT_OPTIONS_SINCE:
                raise errors.FailedPreconditionError(
                    f"mount {mnt.container_path}: options {list(mnt.mount_options)} need a guest agent of "
                    f"operations version {MOUNT_OPTIONS_SINCE}; this pod's VM runs version "
                    f"{pod.agent_version} (booted before an upgrade): recreate the pod"
                )
        img = await self._images.find(cfg.image.image, [container.image_name, cfg.image.user_specified_image])
        container.image_ref = img.id
        # What StopContainer sends it: the config's signal, else the image config's STOPSIGNAL.
        contract.decide_stop_signal(container, str(img.config.get("StopSignal") or ""))
        host_dir = os.path.join(shared.containers_dir, container.id)
        upper, work = os.path.join(host_dir, "upper"), os.path.join(host_dir, "work")
        os.makedirs(upper, exist_ok=True)
        os.makedirs(work, exist_ok=True)
        try:
            rootfs = await self._rootfs(pod, container.id, img, upper, work)
            mounts: list[m.Mount] = []
            host_ro = bool(getattr(hv, "readonly_on_host", False))
            for mnt in cfg.mounts:
                if mnt.HasField("image") and mnt.image.image:
                    tag = f"mnt-{container.id[:12]}-{len(mounts)}"
                    mounts.append(await self._image_volume(pod, container, mnt, tag))
                    continue
                if mnt.selinux_relabel and not self._selinux_said:
                    # No SELinux in the VM (nor, mostly, on the host): nothing to relabel.
                    self._selinux_said = True
                    log.info("selinux_relabel ignored: runv VMs have no SELinux", container_id=container.id)
                if not os.path.exists(mnt.host_path):  # noqa: ASYNC240 - one stat
                    raise errors.InvalidArgumentError(f"mount source {mnt.host_path} does not exist")
                bidirectional = mnt.propagation == pb.PROPAGATION_BIDIRECTIONAL
                # Mount.mount_options: ro as readonly, the others as flags of the guest's bind.
                readonly = mnt.readonly or "ro" in mnt.mount_options
                guest = await hv.attach_share(
                    pod.vm,
                    f"mnt-{container.id[:12]}-{len(mounts)}",
                    mnt.host_path,
                    readonly,
                    bidirectional=bidirectional,
                )
                mounts.append(
                    m.Mount(
                        source=guest,
                        destination=mnt.container_path,
                        # Where the driver makes the share read-only on the host (qemu, over 9p),
                        # the guest's bind stays writable: host mounts under it (a tmpfs in the
                        # directory) then keep their own mode, as a non-recursive read-only mount
                        # wants, which one read-only bind over the 9p tree could not give.
                        readonly=readonly and (not host_ro or mnt.recursive_read_only),
                        recursive_readonly=mnt.recursive_read_only,
                        options=[o for o in mnt.mount_options if o != "ro"],
                        # Host mounts reach the VM (a slave of the host), and from there a
                        # HOST_TO_CONTAINER mount; a BIDIRECTIONAL one is shared all the way
                        # (the stub's VM is a mount namespace; a real VM's driver refuses it).
                        propagation=(
                            "rprivate"
                            if mnt.propagation == pb.PROPAGATION_PRIVATE
                            else "rshared"
                            if bidirectional
                            else "rslave"
                        ),
                    )
                )
            spec = specs.process_spec(cfg, img, rootfs, mounts)
            ns = sandbox.config.linux.security_context.namespace_options
            userns = ns.userns_options
            if ns.HasField("userns_options") and userns.mode == pb.POD and userns.uids:
                # The pod's user namespace, the same for all its containers.
                spec = dataclasses.replace(
                    spec,
                    uid_mappings=[m.IdMap(u.container_id, u.host_id, u.length) for u in userns.uids],
                    gid_mappings=[m.IdMap(g.container_id, g.host_id, g.length) for g in userns.gids],
                )
            created = await agent.call(m.CreateRequest(id=container.id, spec=spec))
            # ContainerStatus.user: the effective identity
            container.effective_user = contract.EffectiveUser(created.uid, created.gid, tuple(created.groups))
        except BaseException:
            with contextlib.suppress(Exception):  # before the layer they may show goes
                await self._detach_shares(pod, container.id)
            shutil.rmtree(host_dir, ignore_errors=True)
            raise
        shared.owner[container.id] = sandbox.id
        pod.containers.add(container.id)
        container.backend_data["vm"] = pod.vm.id

    async def _rootfs(self, pod: Pod, cid: str, img: Image, upper: str, work: str) -> m.Rootfs:
        """The container's root: an overlay the driver assembles on the host and shares merged
        (the qemu driver on virtio-fs, where the guest's overlayfs cannot have its upper layer),
        else the layers and the writable directory shared for the agent to stack."""
        hv = self._shared.hv
        layers = self._shared.image_store.lowers(img)
        tag = f"ct-{cid[:12]}"
        attach_rootfs = getattr(hv, "attach_rootfs", None)
        merged = await attach_rootfs(pod.vm, tag, layers, upper, work) if attach_rootfs else None
        if merged is not None:
            return m.Rootfs(path=merged)
        rw = await hv.attach_share(pod.vm, tag, os.path.dirname(upper), readonly=False)
        lowers = []
        for layer in layers:
            layer_tag = "layer-" + os.path.basename(os.path.dirname(layer))[:12]
            lowers.append(await hv.attach_share(pod.vm, layer_tag, layer, readonly=True))
        return m.Rootfs(lowers=lowers, upper=os.path.join(rw, "upper"), work=os.path.join(rw, "work"))

    async def _detach_shares(self, pod: Pod, cid: str) -> None:
        """The container's own shares out of its VM: its volumes and its root (layers stay)."""
        hv = self._shared.hv
        for tag in [t for t in pod.vm.shares if t.startswith(f"mnt-{cid[:12]}-")]:
            await hv.detach_share(pod.vm, tag)
        await hv.detach_share(pod.vm, f"ct-{cid[:12]}")

    async def _subscribe(
        self, pod: Pod, cid: str, resume: bool = False, after: contract.LogMarks | None = None
    ) -> VmProcess:
        """The container's output stream, subscribed before anything of it can be missed.

        An agent from version 2 stamps each piece with its time, which goes into the CRI log;
        a re-subscription (``resume``) names the last time the log holds per stream (``after``;
        none: the log has nothing) and gets the rest of what the agent keeps (1 MiB): also
        what was in flight to a shim that went away.
        """
        agent = self._shared.agent(pod)
        stamped = pod.agent_version >= 2
        marks = after or {}
        req = m.OutputRequest(
            id=cid,
            stream=0,
            stamped=stamped,
            resume=stamped and resume,
            after_stdout=marks.get("stdout", (0, 0))[0],
            after_stderr=marks.get("stderr", (0, 0))[0],
        )
        stream = agent.stream()
        try:
            await agent.call(dataclasses.replace(req, stream=stream.id))
        except BaseException:
            stream.forget()
            raise
        proc = pod.procs[cid] = VmProcess(stream, stamped)
        return proc

    async def start_container(
        self, container: contract.ContainerRecord, sandbox: contract.SandboxRecord
    ) -> contract.Started:
        pod = self._shared.pod(sandbox.id)
        agent = self._shared.agent(pod)
        proc = await self._subscribe(pod, container.id)
        state = await agent.call(m.StartRequest(id=container.id))
        return contract.Started(state.started_at or time.time_ns(), proc)

    async def reattach(
        self, container: contract.ContainerRecord, after: contract.LogMarks | None
    ) -> VmProcess | None:
        # The agent sends what the log is missing of what it holds (see _subscribe), so nothing
        # written while the shim was away, or in flight when it went, is lost.
        pod = self._shared.pods.get(container.sandbox_id)
        if pod is None or pod.dead or container.id not in pod.containers:
            return None
        proc = await self._subscribe(pod, container.id, resume=after is not None, after=after)
        # An exit event that came before the subscription found no process to report to.
        state = await self._shared.agent(pod).call(m.StateRequest(id=container.id))
        if state.status == "exited":
            proc.exit.set(contract.ExitInfo(state.exit_code, state.finished_at, state.reason))
        return proc

    async def stop_container(self, container: contract.ContainerRecord, timeout: int) -> contract.ExitInfo:
        pod = self._shared.pods.get(container.sandbox_id)
        if pod is None or pod.dead:
            return contract.ExitInfo(VM_CRASH_EXIT, time.time_ns(), VM_CRASH_REASON, "the pod's VM is gone")
        agent = self._shared.agent(pod)
        state = await agent.call(m.StateRequest(id=container.id))
        if state.status == "running":
            sig = contract.host_signal(contract.recorded_stop_signal(container)) or int(signal.SIGTERM)
            await agent.call(m.SignalRequest(id=container.id, signal=sig))
            try:
                state = await agent.call(m.WaitRequest(id=container.id), timeout=max(timeout, 0) or 0.01)
            except errors.UnavailableError:
                await agent.call(m.SignalRequest(id=container.id, signal=int(signal.SIGKILL)))
                state = await agent.call(m.WaitRequest(id=container.id))
        elif state.status == "created":
            return contract.ExitInfo(0, time.time_ns(), "Completed")
        info = contract.ExitInfo(state.exit_code, state.finished_at, state.reason)
        self._shared.report_exit(pod, container.id, info)
        return info

    async def remove_container(self, container: contract.ContainerRecord) -> None:
        shared = self._shared
        pod = shared.pods.get(container.sandbox_id)
        if pod is not None and not pod.dead and pod.agent is not None and not pod.agent.closed:
            await pod.agent.call(m.RemoveRequest(id=container.id))
        if pod is not None:
            await self._detach_shares(pod, container.id)
        if pod is not None:
            pod.containers.discard(container.id)
            pod.procs.pop(container.id, None)
        shared.forget(container.id)

    async def update_container_resources(
        self, container: contract.ContainerRecord, resources: pb.LinuxContainerResources
    ) -> None:
        shared = self._shared
        pod = shared.pod(container.sandbox_id)
        agent = shared.agent(pod)
        # Hot-plug: the VM grows to fit the container's new limits (it never shrinks under them).
        if resources.cpu_quota > 0 and resources.cpu_period > 0:
            need = -(-resources.cpu_quota // resources.cpu_period)
            if need > pod.vm.vcpus:
                await shared.hv.set_vcpus(pod.vm, need)
        if resources.memory_limit_in_bytes > pod.vm.memory_bytes:
            await shared.hv.set_memory(pod.vm, resources.memory_limit_in_bytes + shared.overhead_memory)
        await agent.call(m.UpdateRequest(id=container.id, resources=specs.resources(resources)))
