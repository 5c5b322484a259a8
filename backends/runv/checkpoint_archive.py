"""The archive of a runv checkpoint: one tar file, checksummed, read and verified in one pass.

Members, in this order:

- ``manifest.json``: the format (:data:`FORMAT`), the kind (``container``: CheckpointContainer's
  archive; ``pod``: CheckpointPod's ``pod.tar``), the pod's config (a pod checkpoint), per
  container its name, ID, config, image and image ID, and the size and SHA-256 of every other
  member;
- ``manifest.sha256``: the SHA-256 of ``manifest.json``;
- per container, under ``containers/<name>/``: ``checkpoint/`` (CRIU's images, as ``runc
  checkpoint`` wrote them in the guest), ``rootfs-diff.tar`` (the files of its writable layer:
  what it wrote in its root) and ``deleted.files`` (a JSON list of the paths of its image it
  removed, and of directories it made opaque: removed, then written again from the diff).

Reading (:func:`verify`) streams the archive once: a file that is no tar archive, truncated,
or without the manifest first is InvalidArgument; a member whose size or checksum is not the
manifest's, that the manifest does not list, or a manifest whose checksum
differs, is FailedPrecondition (tampered or corrupted); one that lacks members of its manifest
(cut short at a member's end), InvalidArgument. :func:`extract` reads it again and
writes one container's members, each checked against the verified manifest as it is written.
Nothing here is a path of the host but the archive and the directories the caller gives.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import stat
import tarfile
import time
from collections.abc import Iterator, Sequence
from typing import IO, Any

from backends.contract import errors
from cri_api import api_pb2 as pb

FORMAT = "cri-shim-runv-checkpoint/1"
POD_ARCHIVE = "pod.tar"
MANIFEST = "manifest.json"
MANIFEST_SUM = "manifest.sha256"
MANIFEST_MAX = 16 << 20
CHUNK = 1 << 20
OPAQUE_XATTR = "trusted.overlay.opaque"


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One container of a checkpoint."""

    name: str
    id: str
    config: pb.ContainerConfig
    image: str  # the name it was created from
    image_ref: str  # the image's ID

    def prefix(self) -> str:
        return f"containers/{self.name}/"


@dataclasses.dataclass(frozen=True, slots=True)
class Manifest:
    kind: str
    pod: pb.PodSandboxConfig | None
    containers: tuple[Entry, ...]
    members: dict[str, tuple[int, str]]  # name -> (size, sha256)

    def entry(self, name: str) -> Entry:
        for e in self.containers:
            if e.name == name:
                return e
        raise errors.FailedPreconditionError(f"the checkpoint holds no container named {name!r}")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _sha_file(path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


# --------------------------------------------------------------------------- writing


def rootfs_diff(upper: str, out_tar: str) -> list[str]:
    """The writable layer ``upper`` (an overlay's upper directory) as the tar ``out_tar`` of
    what it added or changed; returned: what it removed (whiteouts) and the directories it made
    opaque, as paths relative to the root."""
    removed: list[str] = []
    with tarfile.open(out_tar, "w", format=tarfile.PAX_FORMAT) as tar:
        for d, dirs, files in os.walk(upper):
            dirs.sort()
            for name in sorted(dirs) + sorted(files):
                path = os.path.join(d, name)
                rel = os.path.relpath(path, upper)
                st = os.lstat(path)
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                    removed.append(rel)  # a whiteout
                    continue
                if stat.S_ISDIR(st.st_mode) and _opaque(path):
                    removed.append(rel)
                if stat.S_ISSOCK(st.st_mode):
                    continue  # a socket's file is not content
                tar.add(path, arcname=rel, recursive=False)
    return removed


def _opaque(path: str) -> bool:
    with contextlib.suppress(OSError):
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    return False


@dataclasses.dataclass(frozen=True, slots=True)
class Captured:
    """A container as it goes into an archive: its entry and the host directory of its members
    (``checkpoint/``, ``rootfs-diff.tar``, ``deleted.files``)."""

    entry: Entry
    dir: str


def _files(root: str) -> Iterator[tuple[str, str]]:
    for d, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(d, name)
            yield os.path.relpath(path, root), path


def write(path: str, kind: str, pod: pb.PodSandboxConfig | None, captured: Sequence[Captured]) -> None:
    """The archive of ``captured`` as the new file ``path`` (which must not exist)."""
    members: dict[str, str] = {}
    for c in captured:
        for rel, host in _files(c.dir):
            members[c.entry.prefix() + rel] = host
    sums = {name: _sha_file(host) for name, host in members.items()}
    manifest = {
        "format": FORMAT,
        "kind": kind,
        "pod": _b64(pod.SerializeToString()) if pod is not None else None,
        "containers": [
            {
                "name": c.entry.name,
                "id": c.entry.id,
                "config": _b64(c.entry.config.SerializeToString()),
                "image": c.entry.image,
                "image_ref": c.entry.image_ref,
            }
            for c in captured
        ],
        "members": {name: {"size": size, "sha256": sha} for name, (size, sha) in sums.items()},
    }
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as fh, tarfile.open(fileobj=fh, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, blob in (
            (MANIFEST, data),
            (MANIFEST_SUM, hashlib.sha256(data).hexdigest().encode() + b"\n"),
        ):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(blob), 0o600, int(time.time())
            tar.addfile(info, io.BytesIO(blob))
        for name, host in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = sums[name][0], 0o600, int(time.time())
            with open(host, "rb") as src:
                tar.addfile(info, src)
        tar.close()
        fh.flush()
        os.fsync(fh.fileno())


# --------------------------------------------------------------------------- reading


def _open(path: str) -> tarfile.TarFile:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise errors.InvalidArgumentError(f"checkpoint archive {path} does not exist") from None
    if not stat.S_ISREG(st.st_mode):
        raise errors.InvalidArgumentError(f"checkpoint archive {path} is not a regular file")
    try:
        return tarfile.open(path, mode="r|")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise errors.InvalidArgumentError(
            f"checkpoint archive {path} is not a readable tar archive (truncated or foreign): {exc}"
        ) from None


def _read_member(tar: tarfile.TarFile, info: tarfile.TarInfo, out: IO[bytes] | None) -> tuple[int, str]:
    src = tar.extractfile(info)
    if src is None:
        raise EOFError(f"member {info.name!r} has no data")
    h = hashlib.sha256()
    size = 0
    while chunk := src.read(CHUNK):
        h.update(chunk)
        size += len(chunk)
        if out is not None:
            out.write(chunk)
    if size != info.size:
        raise EOFError(f"member {info.name!r} is short")
    return size, h.hexdigest()


def _manifest(path: str, tar: tarfile.TarFile) -> Manifest:
    first = tar.next()
    if first is None or first.name != MANIFEST or not first.isreg() or first.size > MANIFEST_MAX:
        raise errors.InvalidArgumentError(
            f"checkpoint archive {path} does not begin with a {MANIFEST}: not a runv checkpoint"
        )
    buf = io.BytesIO()
    _read_member(tar, first, buf)
    data = buf.getvalue()
    second = tar.next()
    if second is None or second.name != MANIFEST_SUM or not second.isreg() or second.size > 200:
        raise errors.InvalidArgumentError(
            f"checkpoint archive {path} has no {MANIFEST_SUM} after its manifest"
        )
    buf = io.BytesIO()
    _read_member(tar, second, buf)
    if buf.getvalue().strip().decode(errors="replace") != hashlib.sha256(data).hexdigest():
        raise errors.FailedPreconditionError(
            f"checkpoint archive {path}: its manifest does not match its checksum (tampered or corrupted)"
        )
    try:
        raw: Any = json.loads(data)
        if raw.get("format") != FORMAT:
            raise errors.InvalidArgumentError(
                f"checkpoint archive {path} is of format {raw.get('format')!r}, not {FORMAT!r}"
            )
        pod = None
        if raw.get("pod"):
            pod = pb.PodSandboxConfig()
            pod.ParseFromString(base64.b64decode(raw["pod"], validate=True))
        entries = []
        for c in raw["containers"]:
            cfg = pb.ContainerConfig()
            cfg.ParseFromString(base64.b64decode(c["config"], validate=True))
            name = str(c["name"])
            if not name or "/" in name or name in (".", ".."):
                raise ValueError(f"container name {name!r}")
            entries.append(Entry(name, str(c["id"]), cfg, str(c["image"]), str(c["image_ref"])))
        members = {str(k): (int(v["size"]), str(v["sha256"])) for k, v in raw["members"].items()}
        kind = str(raw["kind"])
    except errors.InvalidArgumentError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise errors.InvalidArgumentError(f"checkpoint archive {path}: malformed manifest: {exc!r}") from None
    if not entries:
        raise errors.InvalidArgumentError(f"checkpoint archive {path} holds no container")
    return Manifest(kind, pod, tuple(entries), members)


def _check(path: str, m: Manifest, name: str, got: tuple[int, str], seen: set[str]) -> None:
    want = m.members.get(name)
    if want is None:
        raise errors.FailedPreconditionError(
            f"checkpoint archive {path}: member {name!r} is not in its manifest (tampered)"
        )
    if name in seen:
        raise errors.FailedPreconditionError(f"checkpoint archive {path}: member {name!r} twice")
    seen.add(name)
    if got != want:
        raise errors.FailedPreconditionError(
            f"checkpoint archive {path}: member {name!r} does not match its checksum (tampered or corrupted)"
        )


def verify(path: str, kind: str) -> Manifest:
    """The manifest of the archive at ``path``, every member checked (see the module's doc)."""
    with contextlib.closing(_open(path)) as tar:
        try:
            m = _manifest(path, tar)
            if m.kind != kind:
                raise errors.InvalidArgumentError(
                    f"checkpoint archive {path} is a {m.kind} checkpoint, not a {kind} one"
                )
            seen: set[str] = set()
            while (info := tar.next()) is not None:  # on from the manifest (a stream: no going back)
                if not info.isreg():
                    raise errors.FailedPreconditionError(
                        f"checkpoint archive {path}: member {info.name!r} is not a plain file"
                    )
                _check(path, m, info.name, _read_member(tar, info, None), seen)
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise errors.InvalidArgumentError(
                f"checkpoint archive {path} is not a readable tar archive (truncated or foreign): {exc}"
            ) from None
    missing = sorted(set(m.members) - seen)
    if missing:
        raise errors.InvalidArgumentError(
            f"checkpoint archive {path} lacks {len(missing)} member(s) of its manifest ({missing[0]!r}...): "
            "truncated or incomplete"
        )
    return m


def extract(path: str, m: Manifest, entry: Entry, dest: str) -> None:
    """The members of ``entry`` into the directory ``dest``, each checked against ``m`` (the
    archive verified before: a member changed since is FailedPrecondition)."""
    prefix = entry.prefix()
    wanted = {n for n in m.members if n.startswith(prefix)}
    seen: set[str] = set()
    with contextlib.closing(_open(path)) as tar:
        try:
            for info in tar:
                if info.name not in wanted:
                    continue
                rel = os.path.normpath(info.name[len(prefix) :])
                if rel.startswith("..") or os.path.isabs(rel) or not info.isreg():
                    raise errors.FailedPreconditionError(f"checkpoint archive {path}: member {info.name!r}")
                target = os.path.join(dest, rel)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "xb") as out:
                    got = _read_member(tar, info, out)
                _check(path, m, info.name, got, seen)
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise errors.FailedPreconditionError(
                f"checkpoint archive {path} changed since it was read: {exc}"
            ) from None
    if seen != wanted:
        raise errors.FailedPreconditionError(f"checkpoint archive {path} changed since it was read")
