"""The fake's checkpoints: CheckpointContainer, CheckpointPod and RestorePod on its simulated containers.

A checkpoint is one tar archive, small and self-describing:

- ``manifest.json``: the format's name, the kind (``container`` or ``pod``), the pod's
  config (a pod checkpoint), and per container its name, ID, config, image and state (when it
  started, how long its program had run), and the size and SHA-256 of every other member;
- ``manifest.sha256``: the SHA-256 of ``manifest.json``;
- ``containers/<name>/files.json``: the container's own files (not its volumes: those are
  the node's, which the kubelet restores), base64 by path.

CheckpointContainer writes it at ``location``; CheckpointPod writes ``pod.tar`` in its output
directory. Each is written to a temporary file beside its place and renamed there after
``checkpoint_seconds`` (the time a dump takes; 0), so no half-written archive is ever seen, and
nothing is left when the write fails or the call is cancelled (its timeout, its deadline).

A CreateContainer whose image is a container checkpoint (``open_container_checkpoint``) reads the
archive at that path, or the files of an image with the CRI-O checkpoint annotation (the
archive's members, as ``buildah add IMAGE ARCHIVE /`` leaves them), verified as below but every
fault INVALID_ARGUMENT (a bad image); the container then made is given its files and resumes its
program, as a restored pod's containers are.

Reading verifies everything before anything is made: a file that is not a tar archive, or is
truncated, or has no manifest of this format, is InvalidArgument; a member whose checksum or size
is not the manifest's, or that the manifest does not list, or a manifest whose own checksum
differs, is FailedPrecondition (tampered or corrupted). Restore-time configs must name the
checkpoint's containers, with its images and commands (FailedPrecondition otherwise).

The fake runs no processes, so a consistent cut is simple: every selected container is captured
in one step of the event loop, during which none of them runs (the pause); they run on after it.
A restored container's own files are the checkpoint's; on its StartContainer a scripted program
resumes where it was (the output it had written is not written again, its exit comes when it
would have); a command of the built-in shell starts again (the fake keeps no shell state).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import posixpath
import secrets
import tarfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from backends.contract import ContainerCheckpoint, ContainerRecord, PodCheckpoint, SandboxRecord, errors
from backends.fake.images import FakeImages
from backends.fake.lifecycle import FakeLifecycle
from cri_api import api_pb2 as pb

FORMAT = "cri-shim-fake-checkpoint/1"
POD_ARCHIVE = "pod.tar"
MANIFEST = "manifest.json"
MANIFEST_SUM = "manifest.sha256"
MAX_ARCHIVE = 64 * 1024 * 1024  # far beyond what a fake container holds
# The annotation of an image made from a container checkpoint (CRI-O's name; containerd reads it too).
CHECKPOINT_ANNOTATION = "io.kubernetes.cri-o.annotations.checkpoint.name"


@dataclasses.dataclass(frozen=True, slots=True)
class Captured:
    """One container as a checkpoint holds it."""

    name: str
    id: str
    config: pb.ContainerConfig
    image_ref: str
    started_at: int
    elapsed: float  # seconds its program had run
    files: dict[str, bytes]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _archive(kind: str, pod: pb.PodSandboxConfig | None, captured: Sequence[Captured]) -> bytes:
    """The tar archive of ``captured`` (see the module's doc)."""
    members: dict[str, bytes] = {}
    entries = []
    for c in captured:
        files_member = f"containers/{c.name}/files.json"
        members[files_member] = json.dumps({p: _b64(d) for p, d in sorted(c.files.items())}).encode()
        entries.append(
            {
                "name": c.name,
                "id": c.id,
                "config": _b64(c.config.SerializeToString()),
                "image_ref": c.image_ref,
                "state": "CONTAINER_RUNNING",
                "started_at": c.started_at,
                "elapsed": c.elapsed,
                "files": files_member,
            }
        )
    manifest = {
        "format": FORMAT,
        "kind": kind,
        "pod": _b64(pod.SerializeToString()) if pod is not None else None,
        "containers": entries,
        "members": {name: {"size": len(d), "sha256": _sha(d)} for name, d in members.items()},
    }
    manifest_bytes = json.dumps(manifest, indent=1, sort_keys=True).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        everything = {
            MANIFEST: manifest_bytes,
            MANIFEST_SUM: _sha(manifest_bytes).encode() + b"\n",
            **members,
        }
        for name, data in everything.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o600
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


async def _write_beside(path: str, data: bytes, seconds: float = 0.0) -> None:
    """``data`` as the file ``path``, through a temporary file in its directory renamed onto it
    after ``seconds`` (the time a dump takes). Cancelled (a deadline) or failed at any point, the
    temporary file is removed and nothing is at ``path`` that was not there before."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")

    def write() -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    writing = asyncio.ensure_future(asyncio.to_thread(write))
    try:
        try:
            await asyncio.shield(writing)
        except asyncio.CancelledError:
            # The thread cannot be stopped: the temporary file goes once it is done with it.
            with contextlib.suppress(BaseException):
                await writing
            raise
        if seconds:
            await asyncio.sleep(seconds)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _members(path: str) -> dict[str, bytes]:
    """Every member of the archive at ``path`` by name; InvalidArgument for what is no tar archive
    of regular files (or is truncated)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise errors.InvalidArgumentError(f"checkpoint archive {path} does not exist") from None
    if not os.path.isfile(path) or os.path.islink(path):
        raise errors.InvalidArgumentError(f"checkpoint archive {path} is not a regular file")
    if st.st_size > MAX_ARCHIVE:
        raise errors.InvalidArgumentError(f"checkpoint archive {path} is larger than {MAX_ARCHIVE} bytes")
    out: dict[str, bytes] = {}
    try:
        with tarfile.open(path, mode="r:") as tar:
            for info in tar:
                name = info.name
                if not info.isreg() or name.startswith("/") or ".." in name.split("/"):
                    raise errors.InvalidArgumentError(
                        f"checkpoint archive {path}: member {name!r} is not a plain file of the archive"
                    )
                if name in out:
                    raise errors.FailedPreconditionError(f"checkpoint archive {path}: member {name!r} twice")
                f = tar.extractfile(info)
                assert f is not None
                data = f.read()
                if len(data) != info.size:
                    raise EOFError(f"member {name!r} is short")
                out[name] = data
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise errors.InvalidArgumentError(
            f"checkpoint archive {path} is not a readable tar archive (truncated or foreign): {exc}"
        ) from None
    return out


def _read(path: str, kind: str) -> tuple[pb.PodSandboxConfig | None, list[Captured]]:
    """The verified contents of the archive at ``path``, which must be of ``kind``."""
    return _verify(_members(path), path, kind)


def _verify(
    members: dict[str, bytes], path: str, kind: str
) -> tuple[pb.PodSandboxConfig | None, list[Captured]]:
    """The verified contents of a checkpoint of ``kind`` whose members are ``members`` (read from
    ``path``: an archive, or an image made from one)."""
    members = dict(members)
    manifest_bytes = members.pop(MANIFEST, None)
    recorded_sum = members.pop(MANIFEST_SUM, None)
    if manifest_bytes is None or recorded_sum is None:
        raise errors.InvalidArgumentError(
            f"{path} is not a checkpoint of the fake runtime: it has no {MANIFEST} and {MANIFEST_SUM}"
        )
    if recorded_sum.strip().decode(errors="replace") != _sha(manifest_bytes):
        raise errors.FailedPreconditionError(
            f"checkpoint {path}: {MANIFEST} does not match its checksum (tampered or corrupted)"
        )
    try:
        manifest = json.loads(manifest_bytes)
    except ValueError as exc:
        raise errors.InvalidArgumentError(f"checkpoint {path}: {MANIFEST} is not JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise errors.InvalidArgumentError(f"{path} is not a checkpoint of the fake runtime (format {got!r})")
    if manifest.get("kind") != kind:
        raise errors.InvalidArgumentError(f"{path} is a {manifest.get('kind')} checkpoint, not a {kind} one")
    try:
        listed: dict[str, Any] = dict(manifest["members"])
        extra = sorted(set(members) - set(listed))
        missing = sorted(set(listed) - set(members))
        if extra or missing:
            raise errors.FailedPreconditionError(
                f"checkpoint {path}: members not as its manifest lists them "
                f"(unlisted {extra}, missing {missing}): tampered or corrupted"
            )
        for name, want in listed.items():
            data = members[name]
            if len(data) != int(want["size"]) or _sha(data) != want["sha256"]:
                raise errors.FailedPreconditionError(
                    f"checkpoint {path}: checksum mismatch of member {name!r} (tampered or corrupted)"
                )
        pod = pb.PodSandboxConfig.FromString(base64.b64decode(manifest["pod"])) if manifest["pod"] else None
        captured = []
        for entry in manifest["containers"]:
            files = json.loads(members[entry["files"]])
            captured.append(
                Captured(
                    name=str(entry["name"]),
                    id=str(entry["id"]),
                    config=pb.ContainerConfig.FromString(base64.b64decode(entry["config"])),
                    image_ref=str(entry["image_ref"]),
                    started_at=int(entry["started_at"]),
                    elapsed=max(0.0, float(entry["elapsed"])),
                    files={str(p): base64.b64decode(d) for p, d in dict(files).items()},
                )
            )
    except errors.CriError:
        raise
    except Exception as exc:  # a manifest of the right format and checksum, but not of its shape
        raise errors.InvalidArgumentError(f"checkpoint {path}: malformed manifest: {exc!r}") from None
    if not captured:
        raise errors.InvalidArgumentError(f"checkpoint {path} holds no container")
    return pod, captured


def _no_options(options: Mapping[str, str]) -> None:
    for key in sorted(options):
        raise errors.InvalidArgumentError(f"option {key!r} is not one the fake runtime knows (it takes none)")


class FakeCheckpoint:
    """The Checkpoint part of the fake, on its lifecycle's containers; a checkpoint takes
    ``seconds`` to write (the option ``checkpoint_seconds``, 0: at once)."""

    def __init__(self, lifecycle: FakeLifecycle, images: FakeImages, seconds: float = 0.0) -> None:
        self.lifecycle = lifecycle
        self.images = images
        self.seconds = seconds

    def _capture(self, c: ContainerRecord) -> Captured:
        run = self.lifecycle.running.get(c.id)
        if run is None:
            raise errors.FailedPreconditionError(f"container {c.id} is not running in the fake runtime")
        memory = self.lifecycle.files_of(c).memory
        return Captured(
            name=c.config.metadata.name,
            id=c.id,
            config=c.config,
            image_ref=c.image_ref,
            started_at=c.status.started_at,
            elapsed=time.monotonic() - run.started_mono,
            files=dict(memory.files),
        )

    async def checkpoint_container(self, container: ContainerRecord, location: str, timeout: int) -> None:
        # Captured at once, written over ``seconds``: the container runs on meanwhile (the
        # kubelet's checkpoints leave it running); the shim bounds the call by ``timeout``.
        data = _archive("container", None, [self._capture(container)])
        await _write_beside(location, data, self.seconds)

    async def checkpoint_pod(
        self,
        sandbox: SandboxRecord,
        containers: Sequence[ContainerRecord],
        output_dir: str,
        options: Mapping[str, str],
    ) -> None:
        _no_options(options)
        # One step of the event loop: every container is captured with none of them running
        # in between (the pause), and they run on after it (the resume).
        captured = [self._capture(c) for c in containers]
        data = _archive("pod", sandbox.config, captured)
        await _write_beside(os.path.join(output_dir, POD_ARCHIVE), data, self.seconds)

    async def open_pod_checkpoint(
        self, path: str, options: Mapping[str, str], configs: Sequence[pb.ContainerConfig]
    ) -> PodCheckpoint:
        _no_options(options)
        _, captured = await asyncio.to_thread(_read, os.path.join(path, POD_ARCHIVE), "pod")
        by_name = {c.name: c for c in captured}
        for cfg in configs:
            was = by_name.get(cfg.metadata.name)
            if was is None:
                continue  # the shim says which names are missing or extra
            image = self.images.find(cfg.image.image)
            if image is None or image.id != was.image_ref:
                raise errors.FailedPreconditionError(
                    f"container {cfg.metadata.name!r}: image {cfg.image.image!r} is not the checkpointed "
                    f"one ({was.image_ref})"
                )
            if (list(cfg.command), list(cfg.args)) != (list(was.config.command), list(was.config.args)):
                raise errors.FailedPreconditionError(
                    f"container {cfg.metadata.name!r}: command and args differ from the checkpointed ones"
                )
        return PodCheckpoint(tuple(c.name for c in captured), by_name)

    # ------------------------------------------------------------------ CreateContainer from a checkpoint
    def checkpoint_image(self, image: str) -> bool:
        return self.images.find(image) is not None and CHECKPOINT_ANNOTATION in self.images.annotations_for(
            image
        )

    async def open_container_checkpoint(self, source: str) -> ContainerCheckpoint:
        if source.startswith("/"):
            members = await asyncio.to_thread(_members, source)
            where = f"checkpoint archive {source}"
        else:
            # An image made from an archive (as `buildah add IMAGE ARCHIVE /` makes one): the
            # archive's members are the image's files.
            members = {p.lstrip("/"): d for p, d in self.images.files_for(source).items()}
            where = f"checkpoint image {source}"
        try:
            _, captured = _verify(members, where, "container")
        except errors.FailedPreconditionError as exc:
            # Tampered or corrupted: as bad an image as a truncated one, for CreateContainer.
            raise errors.InvalidArgumentError(str(exc)) from None
        if len(captured) != 1:
            raise errors.InvalidArgumentError(f"{where} holds {len(captured)} containers, not one")
        return ContainerCheckpoint(captured[0].config, captured[0])

    async def restore_container(
        self,
        container: ContainerRecord,
        sandbox: SandboxRecord,
        checkpoint: PodCheckpoint | ContainerCheckpoint,
    ) -> None:
        if isinstance(checkpoint, ContainerCheckpoint):
            was: object = checkpoint.data
        else:
            by_name = checkpoint.data
            assert isinstance(by_name, dict)
            was = by_name.get(container.config.metadata.name)
        if not isinstance(was, Captured):
            raise errors.InvalidArgumentError(
                f"the checkpoint has no container {container.config.metadata.name!r}"
            )
        memory = self.lifecycle.files_of(container).memory
        try:
            for path, data in sorted(was.files.items()):
                memory.mkdir(posixpath.dirname(path), parents=True)
                memory.write(path, data)
        except OSError as exc:
            raise errors.FailedPreconditionError(
                f"container {container.config.metadata.name!r}: its checkpointed files cannot be "
                f"restored with this config: {exc}"
            ) from None
        self.lifecycle.resumed[container.id] = was.elapsed
