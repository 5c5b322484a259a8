"""CreateContainer from a checkpoint, as CRI-O (its ``container_restore.go``) and containerd 2.1
accept it.

The config's image is either a file (an absolute path, allowed where a checkpoint may be read:
:mod:`shim.cri.checkpoint_paths`; the kubelet's
``/var/lib/kubelet/checkpoints/checkpoint-<pod>_<namespace>-<container>-<time>.tar``, or what
``crictl checkpoint --export`` wrote), or an image the backend says was made from one (its
``io.kubernetes.cri-o.annotations.checkpoint.name`` annotation). The backend reads and verifies it
before anything is made (INVALID_ARGUMENT for an archive that is truncated, foreign or tampered;
docker and runv answer FAILED_PRECONDITION, naming CRIU; a handler without checkpoints,
UNIMPLEMENTED). The container is then made as any other, from the request's config with what it
leaves empty taken from the checkpointed one (:func:`restored_config`), and given the
checkpoint's state: its StartContainer resumes the checkpointed process.
"""

from __future__ import annotations

import asyncio

from backends.contract import Backend, ContainerCheckpoint
from cri_api import api_pb2 as pb
from shim.cri.checkpoint_paths import allowed_path, archive_to_read
from shim.cri.errors import UnimplementedError
from shim.cri.state import Shim


async def container_checkpoint_of(
    shim: Shim, handler: str, backend: Backend, cfg: pb.ContainerConfig
) -> ContainerCheckpoint | None:
    """The verified checkpoint the image of a CreateContainer's ``cfg`` names (see the module's
    doc), or None when it names a plain image."""
    image = cfg.image.image
    part = backend.checkpoint
    if image.startswith("/"):  # never an image reference: a file, as CRI-O and containerd read it
        path = allowed_path(shim, "config.image.image", image)
        await asyncio.to_thread(archive_to_read, "config.image.image", path)
        if part is None:
            raise UnimplementedError(
                f"runtime handler {handler!r} does not support checkpoints: it cannot create a "
                f"container from the checkpoint archive {path}"
            )
        return await part.open_container_checkpoint(path)
    if part is None or not part.checkpoint_image(image):
        return None
    return await part.open_container_checkpoint(image)


def restored_config(request: pb.ContainerConfig, checkpointed: pb.ContainerConfig) -> pb.ContainerConfig:
    """The config a container restored from a checkpoint is made with: the request's, with the
    checkpointed container's image (what the checkpoint ran, not the archive), its command, args,
    working directory and environment where the request gives none, and its labels and
    annotations under the request's (which win: the kubelet's names, hash and restart count).
    The request's metadata, mounts, devices, log path and Linux settings are the new pod's."""
    cfg = pb.ContainerConfig()
    cfg.CopyFrom(request)
    cfg.image.CopyFrom(checkpointed.image)
    if not cfg.command and not cfg.args:
        cfg.command[:] = checkpointed.command
        cfg.args[:] = checkpointed.args
    if not cfg.working_dir:
        cfg.working_dir = checkpointed.working_dir
    if not cfg.envs:
        cfg.envs.extend(checkpointed.envs)
    for field in ("labels", "annotations"):
        merged = {**getattr(checkpointed, field), **getattr(request, field)}
        getattr(cfg, field).clear()
        getattr(cfg, field).update(merged)
    return cfg
