"""CheckpointContainer, CheckpointPod, RestorePod and CreateContainer from a checkpoint on runv's
qemu driver: CRIU inside the pod's VM (issue 43).

Why CRIU in the guest and not a snapshot of the VM: QEMU 7.2 refuses to migrate a VM while a 9p
export is mounted in its guest, and a vhost-user-fs (virtio-fs) device cannot be migrated at
all; the containers' roots live on those shares, so a running pod's VM cannot be saved as the
templates save an idle one (:mod:`.drivers.qemu_template`). The guest image then needs CRIU
(``scripts/runv-guest --criu``); without it every call is FailedPrecondition saying so.

A checkpoint (:mod:`.checkpoint_archive` has the format):

1. a host directory of the runtime's (``<root>/checkpoints/<token>``) is shared into the VM;
2. the agent pauses the containers together (one cut: their cgroups frozen), dumps each with
   ``runc checkpoint --leave-running`` and copies the images into the share
   (:mod:`.agent.criu`); they stay paused while
3. the host reads each container's writable layer (its overlay's upper directory, on the host)
   into ``rootfs-diff.tar`` and ``deleted.files``; then
4. the containers are resumed (on every path: an error, the call's deadline; the agent resumes
   them by itself if the host never says so), and the archive is written beside its place and
   renamed there, so that no half-written archive is ever seen.

A restore: the archive is verified whole before anything is made; the shim creates the pod (a
new VM, its own network identity) and each container as usual; then for each container the
host extracts its members into a share and the agent replaces the created init with the
checkpoint (``restore_prepare``: the root's changes applied, CRIU's restore of its processes,
left paused: a pod's containers are all restored before any runs, as they share a PID
namespace). Its StartContainer resumes them; they go on with their memory as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Mapping, Sequence

import structlog

from backends.contract import ContainerCheckpoint, ContainerRecord, PodCheckpoint, SandboxRecord, errors
from backends.runv import checkpoint_archive as archive
from backends.runv.agent import criu as agent_criu
from backends.runv.images.service import VmImages
from cri_api import api_pb2 as pb

from .context import Shared
from .state import Pod

log = structlog.get_logger(__name__)

CRIU_SINCE = 4  # the agent's operations version with checkpoint, thaw and restore_prepare
HOLD = 120.0  # seconds the agent keeps a checkpoint's containers paused without the host's thaw
DUMP_TIMEOUT = 600.0  # seconds the agent may take to dump (the call's own deadline bounds it too)


def _no_options(options: Mapping[str, str]) -> None:
    for key in sorted(options):
        raise errors.InvalidArgumentError(f"option {key!r} is not one runv knows (it takes none)")


class VmCheckpoints:
    """The Checkpoint part of a runv handler on the qemu driver."""

    def __init__(self, handler: str, shared: Shared, images: VmImages, work_dir: str, guest_dir: str) -> None:
        self.handler = handler
        self._shared = shared
        self._images = images
        self.work_dir = work_dir  # what a checkpoint or restore stages: removed when it ends
        self.guest_dir = guest_dir

    # ------------------------------------------------------------------ checks
    def guest_has_criu(self) -> bool:
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(self.guest_dir, "manifest.json")) as fh:
                return bool(json.load(fh).get("criu"))
        return False

    def _criu(self, what: str) -> None:
        if not self.guest_has_criu():
            raise errors.FailedPreconditionError(
                f"runtime handler {self.handler!r}: {what} needs CRIU in the VM's guest image, and the image "
                f"in {self.guest_dir} has none: build it with "
                f"`scripts/runv-guest --criu --out {self.guest_dir}`"
            )

    def _ready(self, pod: Pod, what: str) -> None:
        self._criu(what)
        if pod.agent_version < CRIU_SINCE:
            raise errors.FailedPreconditionError(
                f"{what}: this pod's VM runs a guest agent of operations version {pod.agent_version} "
                f"(booted before an upgrade), {CRIU_SINCE} is needed: recreate the pod"
            )

    def tidy(self) -> None:
        """What an earlier run of the shim left staged (a SIGKILL mid-checkpoint)."""
        shutil.rmtree(self.work_dir, ignore_errors=True)

    def _stage(self) -> str:
        os.makedirs(self.work_dir, exist_ok=True)
        path = os.path.join(self.work_dir, secrets.token_hex(6))
        os.mkdir(path, 0o700)
        return path

    # ------------------------------------------------------------------ checkpoints
    async def _capture(
        self, sandbox_id: str, containers: Sequence[ContainerRecord], stage: str, what: str
    ) -> list[archive.Captured]:
        """Every container of ``containers`` dumped into ``stage``/ID (one cut), with its
        writable layer's changes; the containers run again when this returns or raises."""
        shared = self._shared
        pod = shared.pod(sandbox_id)
        self._ready(pod, what)
        agent = shared.agent(pod)
        ids = [c.id for c in containers]
        images_dir = os.path.join(stage, "images")
        os.mkdir(images_dir)
        os.chmod(images_dir, 0o777)  # the share's writer may be QEMU's own user
        tag = "ckpt-" + os.path.basename(stage)
        guest = await shared.hv.attach_share(pod.vm, tag, images_dir, readonly=False)
        out: list[archive.Captured] = []
        try:
            t = time.monotonic()
            try:
                dumped = await agent.call(
                    agent_criu.CheckpointRequest(ids=ids, dir=guest, hold=HOLD), timeout=DUMP_TIMEOUT
                )
                for c in containers:
                    try:
                        out.append(await asyncio.to_thread(self._pack, c, images_dir, stage))
                    except OSError as exc:
                        raise errors.InternalError(
                            f"container {c.id}: cannot read its checkpoint or its writable layer: {exc}"
                        ) from None
            finally:
                await asyncio.shield(self._thaw(pod, ids))
            log.info(
                "checkpoint.captured",
                sandbox_id=sandbox_id,
                containers=ids,
                paused_seconds=round(time.monotonic() - t, 3),
                image_bytes=dumped.sizes,
            )
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(shared.hv.detach_share(pod.vm, tag))
        return out

    async def _thaw(self, pod: Pod, ids: list[str]) -> None:
        """The containers running again (idempotent: the agent resumed them itself when its dump
        failed, and resumes them after ``HOLD`` seconds if this never reaches it)."""
        try:
            await self._shared.agent(pod).call(agent_criu.ThawRequest(ids=ids))
        except errors.CriError as exc:
            log.warning("checkpoint.thaw_failed", containers=ids, error=str(exc), resumes_within=HOLD)

    def _pack(self, c: ContainerRecord, images_dir: str, stage: str) -> archive.Captured:
        """Container ``c``'s members in ``stage``/c/: CRIU's images and its root's changes."""
        own = os.path.join(stage, "c-" + c.id)
        os.mkdir(own)
        dumped = os.path.join(images_dir, c.id)
        if not os.path.isfile(os.path.join(dumped, "inventory.img")):
            raise errors.InternalError(f"container {c.id}: the guest wrote no CRIU images")
        shutil.move(dumped, os.path.join(own, "checkpoint"))
        upper = os.path.join(self._shared.containers_dir, c.id, "upper")
        removed = archive.rootfs_diff(upper, os.path.join(own, "rootfs-diff.tar"))
        with open(os.path.join(own, "deleted.files"), "w") as fh:
            json.dump(removed, fh)
        entry = archive.Entry(
            name=c.config.metadata.name,
            id=c.id,
            config=c.config,
            image=c.config.image.image or c.image_name,
            image_ref=c.image_ref,
        )
        return archive.Captured(entry, own)

    async def _write(
        self, path: str, kind: str, pod: pb.PodSandboxConfig | None, captured: list[archive.Captured]
    ) -> None:
        """The archive at ``path``, through a file beside it renamed there; nothing at ``path``
        (nor beside it) when this fails or is cancelled."""
        tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
        writing = asyncio.ensure_future(asyncio.to_thread(archive.write, tmp, kind, pod, captured))
        try:
            try:
                await asyncio.shield(writing)
            except asyncio.CancelledError:
                with contextlib.suppress(BaseException):
                    await writing  # the thread cannot be stopped: its file goes once it is done
                raise
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    async def _checkpoint(
        self,
        sandbox_id: str,
        pod_config: pb.PodSandboxConfig | None,
        containers: Sequence[ContainerRecord],
        path: str,
        what: str,
    ) -> None:
        stage = await asyncio.to_thread(self._stage)
        try:
            captured = await self._capture(sandbox_id, containers, stage, what)
            await self._write(path, "pod" if pod_config is not None else "container", pod_config, captured)
        finally:
            await asyncio.shield(asyncio.to_thread(shutil.rmtree, stage, True))

    async def checkpoint_container(self, container: ContainerRecord, location: str, timeout: int) -> None:
        await self._checkpoint(container.sandbox_id, None, [container], location, "CheckpointContainer")

    async def checkpoint_pod(
        self,
        sandbox: SandboxRecord,
        containers: Sequence[ContainerRecord],
        output_dir: str,
        options: Mapping[str, str],
    ) -> None:
        _no_options(options)
        path = os.path.join(output_dir, archive.POD_ARCHIVE)
        await self._checkpoint(sandbox.id, sandbox.config, containers, path, "CheckpointPod")

    # ------------------------------------------------------------------ restores
    async def open_pod_checkpoint(
        self, path: str, options: Mapping[str, str], configs: Sequence[pb.ContainerConfig]
    ) -> PodCheckpoint:
        _no_options(options)
        self._criu("RestorePod")
        file = os.path.join(path, archive.POD_ARCHIVE)
        m = await asyncio.to_thread(archive.verify, file, "pod")
        for cfg in configs:
            if cfg.metadata.name in {e.name for e in m.containers}:
                await self._same_image(cfg.image.image, m.entry(cfg.metadata.name))
        return PodCheckpoint(tuple(e.name for e in m.containers), data=(file, m))

    async def _same_image(self, image: str, entry: archive.Entry) -> None:
        """CRIU restores the processes onto the image they ran from: nothing else will do."""
        img = await self._images.find(image, [image])
        if img.id != entry.image_ref:
            raise errors.FailedPreconditionError(
                f"container {entry.name!r} was checkpointed on image {entry.image} ({entry.image_ref}); "
                f"its restore asks for {image} ({img.id}): CRIU restores onto the same image only"
            )

    def checkpoint_image(self, image: str) -> bool:
        return False  # images made from an archive (buildah add) are not looked for: a path is

    async def open_container_checkpoint(self, source: str) -> ContainerCheckpoint:
        if not source.startswith("/"):
            raise errors.InvalidArgumentError(f"{source!r} is no checkpoint archive of runv")
        self._criu("CreateContainer from a checkpoint")
        m = await asyncio.to_thread(archive.verify, source, "container")
        if len(m.containers) != 1:
            raise errors.InvalidArgumentError(
                f"checkpoint archive {source} holds {len(m.containers)} containers, not 1"
            )
        return ContainerCheckpoint(config=m.containers[0].config, data=(source, m))

    async def restore_container(
        self,
        container: ContainerRecord,
        sandbox: SandboxRecord,
        checkpoint: PodCheckpoint | ContainerCheckpoint,
    ) -> None:
        data = checkpoint.data
        if not (isinstance(data, tuple) and len(data) == 2 and isinstance(data[1], archive.Manifest)):
            raise errors.InvalidArgumentError("the checkpoint was not opened by runv")
        file, m = str(data[0]), data[1]
        pod_wide = isinstance(checkpoint, PodCheckpoint)
        entry = m.entry(container.config.metadata.name) if pod_wide else m.containers[0]
        if container.image_ref != entry.image_ref:
            raise errors.FailedPreconditionError(
                f"container {entry.name!r} was checkpointed on image {entry.image} ({entry.image_ref}), "
                f"not on {container.image_ref}: CRIU restores onto the same image only"
            )
        shared = self._shared
        pod = shared.pod(sandbox.id)
        what = "RestorePod" if isinstance(checkpoint, PodCheckpoint) else "CreateContainer from a checkpoint"
        self._ready(pod, what)
        stage = await asyncio.to_thread(self._stage)
        tag = "rst-" + os.path.basename(stage)
        try:
            await asyncio.to_thread(archive.extract, file, m, entry, stage)
            with open(os.path.join(stage, "deleted.files")) as fh:  # noqa: ASYNC230 - checked small file
                deleted = [str(p) for p in json.load(fh)]
            os.chmod(stage, 0o755)
            guest = await shared.hv.attach_share(pod.vm, tag, stage, readonly=True)
            try:
                has_diff = await asyncio.to_thread(os.path.exists, os.path.join(stage, "rootfs-diff.tar"))
                diff = os.path.join(guest, "rootfs-diff.tar")
                prepared = await shared.agent(pod).call(
                    agent_criu.RestorePrepareRequest(
                        id=container.id,
                        images=os.path.join(guest, "checkpoint"),
                        diff=diff if has_diff else "",
                        deleted=deleted,
                    ),
                    timeout=DUMP_TIMEOUT,
                )
                if prepared.placeholders:
                    log.warning(
                        "restore.mounts_not_given",
                        container_id=container.id,
                        mounts=prepared.placeholders,
                        hint="the checkpointed container had these mounts; its restore is given empty ones",
                    )
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.shield(shared.hv.detach_share(pod.vm, tag))
        except (OSError, ValueError) as exc:
            raise errors.FailedPreconditionError(
                f"container {container.id}: cannot stage its restore: {exc}"
            ) from None
        finally:
            await asyncio.shield(asyncio.to_thread(shutil.rmtree, stage, True))
