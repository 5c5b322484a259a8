"""An OCI image store independent of Docker.

Layout under ``root``::

    blobs/sha256/<hex>         content store: manifests, configs, compressed layers (digest-verified)
    snapshots/<hex>/fs         one unpacked layer per diff ID, whiteouts in overlayfs form
    index.json                 images by ID (config digest) with their tags and repo digests

Containers get ``lowerdir=<top layer>:...:<bottom layer>`` over a private
upper directory: the layers are shared copy-on-write between containers.

The registry side is :mod:`backends.oci.registry`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gzip
import hashlib
import json
import os
import re
import shutil
import stat
import tarfile
import tempfile
import threading
from typing import IO, Any, cast

from backends import reference
from backends.contract.errors import InvalidArgumentError
from backends.linux.files import write_atomic
from backends.oci.registry import (
    MEDIA_DOCKER_LIST,
    MEDIA_OCI_INDEX,
    Credentials,
    PullError,
    RegistryClient,
    hex_of,
)
from backends.oci.settings import PullSettings

__all__ = ["Credentials", "Image", "ImageStore", "PullError", "unpack_layer"]

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"


@dataclasses.dataclass(slots=True)
class Image:
    id: str  # sha256:<config digest>
    repo_tags: list[str]
    repo_digests: list[str]
    size: int
    diff_ids: list[str]  # bottom to top
    config: dict[str, Any]  # the image config's "config" object (Env, Cmd, ...)
    pinned: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- layers


class _HashingReader:
    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.hash = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.hash.update(data)
        return data


def _decompressor(path: str) -> IO[bytes]:
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic[:2] == b"\x1f\x8b":
        return cast(IO[bytes], gzip.open(path, "rb"))
    if magic == b"\x28\xb5\x2f\xfd":
        try:
            import zstandard  # type: ignore[import-not-found]  # optional
        except ImportError:
            raise PullError("zstd layer and no zstandard module installed") from None
        stream: IO[bytes] = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"))
        return stream
    return open(path, "rb")


def _inside(root: str, path: str) -> bool:
    real = os.path.realpath(path)
    return real == root or real.startswith(root + os.sep)


def unpack_layer(blob: str, dest: str) -> str:
    """Unpack a layer tar into ``dest`` in overlayfs form; return its diff ID."""
    root = os.path.realpath(dest)
    with _decompressor(blob) as raw:
        reader = _HashingReader(raw)
        with tarfile.open(fileobj=reader, mode="r|") as tar:  # type: ignore[call-overload]
            for member in tar:
                name = os.path.normpath(member.name.lstrip("/"))
                if name in (".", "") or name.startswith("../") or name == "..":
                    continue
                parent = os.path.join(root, os.path.dirname(name))
                if not _inside(root, parent):
                    raise PullError(f"layer entry {member.name!r} escapes the rootfs")
                base = os.path.basename(name)
                if base == OPAQUE:
                    os.makedirs(parent, exist_ok=True)
                    os.setxattr(parent, "trusted.overlay.opaque", b"y")
                    continue
                if base.startswith(WHITEOUT):
                    target = os.path.join(parent, base[len(WHITEOUT) :])
                    os.makedirs(parent, exist_ok=True)
                    if os.path.lexists(target):
                        _remove(target)
                    os.mknod(target, stat.S_IFCHR | 0o000, os.makedev(0, 0))
                    continue
                target = os.path.join(root, name)
                if os.path.lexists(target) and not (member.isdir() and os.path.isdir(target)):
                    _remove(target)
                if member.islnk():
                    link = os.path.join(root, os.path.normpath(member.linkname.lstrip("/")))
                    if not _inside(root, os.path.dirname(link)):
                        raise PullError(f"hard link {member.name!r} escapes the rootfs")
                    member = member.replace(linkname=os.path.relpath(link, root), deep=False)
                member = member.replace(name=name, deep=False)
                tar.extract(member, root, set_attrs=True, numeric_owner=True, filter="fully_trusted")
            # Drain trailing padding so the diff ID covers the whole stream.
            while reader.read(1024 * 1024):
                pass
    return "sha256:" + reader.hash.hexdigest()


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


# --------------------------------------------------------------------------- the store


class ImageStore:
    def __init__(self, root: str, settings: PullSettings | None = None) -> None:
        self.root = root
        self.settings = settings or PullSettings()
        self._blobs = os.path.join(root, "blobs", "sha256")
        self._snapshots = os.path.join(root, "snapshots")
        self._index_path = os.path.join(root, "index.json")
        self._lock = threading.Lock()  # index and snapshots: pulls run in worker threads
        self._pulls: dict[str, asyncio.Future[str]] = {}
        os.makedirs(self._blobs, exist_ok=True)
        os.makedirs(self._snapshots, exist_ok=True)
        self.images: dict[str, Image] = self._load()

    # ---- index
    def _load(self) -> dict[str, Image]:
        try:
            with open(self._index_path) as fh:
                raw = json.load(fh)
        except FileNotFoundError:
            return {}
        return {k: Image(**v) for k, v in raw.get("images", {}).items()}

    def _save(self) -> None:
        data = {"images": {k: v.to_dict() for k, v in self.images.items()}}
        write_atomic(self._index_path, json.dumps(data, indent=1).encode())

    def resolve(self, ref: str) -> Image | None:
        """By ID, unique ID prefix, tag or repo digest."""
        if ref in self.images:
            return self.images[ref]
        hexpart = ref.removeprefix("sha256:")
        if re.fullmatch(r"[0-9a-f]{6,64}", hexpart):
            hits = [img for k, img in self.images.items() if k.removeprefix("sha256:").startswith(hexpart)]
            if len(hits) == 1:
                return hits[0]
        try:
            parsed = reference.parse(ref)
        except ValueError:
            return None
        for img in self.images.values():
            if parsed.digest and parsed.digested(parsed.digest) in img.repo_digests:
                return img
            if not parsed.digest and parsed.tagged in img.repo_tags:
                return img
        return None

    def all(self) -> list[Image]:
        return list(self.images.values())

    def lowers(self, image: Image) -> list[str]:
        """overlayfs lowerdir list of an image, topmost first."""
        return [self.snapshot_dir(d) for d in reversed(image.diff_ids)]

    def snapshot_dir(self, diff_id: str) -> str:
        return os.path.join(self._snapshots, hex_of(diff_id), "fs")

    def remove(self, ref: str) -> None:
        with self._lock:
            img = self.resolve(ref)
            if img is None:
                return
            del self.images[img.id]
            self._save()
            used = {d for i in self.images.values() for d in i.diff_ids}
            for diff in img.diff_ids:
                if diff not in used:
                    shutil.rmtree(os.path.dirname(self.snapshot_dir(diff)), ignore_errors=True)

    def _register(self, img: Image) -> None:
        """Add an image; its tags move away from any older image (which stays, untagged)."""
        for other in self.images.values():
            if other.id != img.id:
                other.repo_tags = [t for t in other.repo_tags if t not in img.repo_tags]
        old = self.images.get(img.id)
        if old is not None:
            img.repo_tags = sorted(set(old.repo_tags) | set(img.repo_tags))
            img.repo_digests = sorted(set(old.repo_digests) | set(img.repo_digests))
        self.images[img.id] = img
        self._save()

    # ---- import (tests, side-loading)
    def import_dir(self, name: str, path: str, config: dict[str, Any] | None = None) -> str:
        """Make an image of a directory tree: one layer, a synthetic config digest."""
        ref = reference.parse(name)
        with tarfile.open(fileobj=(buf := tempfile.TemporaryFile()), mode="w") as tar:
            tar.add(path, arcname=".")
        buf.seek(0)
        layer = hashlib.sha256()
        while chunk := buf.read(1024 * 1024):
            layer.update(chunk)
        diff_id = "sha256:" + layer.hexdigest()
        image_config: dict[str, Any] = dict(config or {})
        cfg: dict[str, Any] = {
            "architecture": "amd64",
            "os": "linux",
            "config": image_config,
            "rootfs": {"diff_ids": [diff_id]},
        }
        raw = json.dumps(cfg, sort_keys=True).encode()
        image_id = "sha256:" + hashlib.sha256(raw).hexdigest()
        with self._lock:
            snap = self.snapshot_dir(diff_id)
            if not os.path.isdir(snap):
                tmp = tempfile.mkdtemp(dir=self._snapshots, prefix=".unpack-")
                buf.seek(0)
                blob = os.path.join(tmp, "layer.tar")
                with open(blob, "wb") as fh:
                    shutil.copyfileobj(buf, fh)
                unpack_layer(blob, os.path.join(tmp, "fs"))
                os.unlink(blob)
                os.rename(tmp, os.path.dirname(snap))
            buf.close()
            write_atomic(os.path.join(self._blobs, hex_of(image_id)), raw)
            self._register(Image(image_id, [ref.tagged], [], 0, [diff_id], image_config))
        return image_id

    # ---- pull
    async def pull(self, ref: str, creds: Credentials | None = None) -> str:
        """Pull ``ref``; concurrent pulls of one reference share the work."""
        try:
            parsed = reference.parse(ref)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        key = str(parsed)
        running = self._pulls.get(key)
        if running is not None:
            return await asyncio.shield(running)
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._pulls[key] = fut
        try:
            image_id = await asyncio.to_thread(self._pull, parsed, creds)
            fut.set_result(image_id)
            return image_id
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: the waiters re-raise it
            raise
        finally:
            del self._pulls[key]

    def _pull(self, ref: reference.Reference, creds: Credentials | None) -> str:
        reg = RegistryClient(ref, creds, self.settings)
        try:
            raw, media, digest = reg.manifest(ref.digest or ref.tag)
            doc = json.loads(raw)
            if media in (MEDIA_OCI_INDEX, MEDIA_DOCKER_LIST) or "manifests" in doc:
                chosen = _pick_platform(doc.get("manifests") or [])
                raw, media, digest = reg.manifest(chosen)
                doc = json.loads(raw)
            if ref.digest and digest != ref.digest and not ref.tag:
                # A digest reference may name the index; the repo digest is the one asked for.
                digest = ref.digest
            config_digest = str(doc["config"]["digest"])
            cfg_path = os.path.join(self._blobs, hex_of(config_digest))
            if not os.path.exists(cfg_path):
                reg.blob(config_digest, cfg_path)
            with open(cfg_path, "rb") as fh:
                cfg = json.loads(fh.read())
            diff_ids = [str(d) for d in (cfg.get("rootfs") or {}).get("diff_ids") or []]
            layers = doc.get("layers") or []
            if len(layers) != len(diff_ids):
                raise PullError("manifest and config disagree on the layer count")
            size = 0
            for layer, diff_id in zip(layers, diff_ids, strict=True):
                size += int(layer.get("size", 0))
                self._fetch_layer(reg, str(layer["digest"]), diff_id)
            write_atomic(os.path.join(self._blobs, hex_of(digest)), raw)
        except PullError as exc:
            raise InvalidArgumentError(f"pull {ref}: {exc}") from None
        except (KeyError, ValueError, TypeError) as exc:
            raise InvalidArgumentError(f"pull {ref}: malformed manifest or config: {exc}") from None
        with self._lock:
            self._register(
                Image(
                    id=config_digest,
                    repo_tags=[ref.tagged] if ref.tag else [],
                    repo_digests=[ref.digested(digest)],
                    size=size,
                    diff_ids=diff_ids,
                    config=dict(cfg.get("config") or {}),
                )
            )
        return config_digest

    def _fetch_layer(self, reg: RegistryClient, digest: str, diff_id: str) -> None:
        snap = self.snapshot_dir(diff_id)
        if os.path.isdir(snap):
            return
        blob = os.path.join(self._blobs, hex_of(digest))
        if not os.path.exists(blob):
            reg.blob(digest, blob)
        tmp = tempfile.mkdtemp(dir=self._snapshots, prefix=".unpack-")
        try:
            got = unpack_layer(blob, os.path.join(tmp, "fs"))
            if got != diff_id:
                raise PullError(f"layer {digest}: diff ID {got} does not match the config's {diff_id}")
            with self._lock:
                if not os.path.isdir(snap):
                    os.rename(tmp, os.path.dirname(snap))
                    tmp = ""
        finally:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
        # The unpacked snapshot is what containers use; the compressed copy only costs disk.
        with contextlib.suppress(OSError):
            os.unlink(blob)


def _pick_platform(manifests: list[dict[str, Any]]) -> str:
    for m in manifests:
        p = m.get("platform") or {}
        if p.get("os") == "linux" and p.get("architecture") == "amd64":
            return str(m["digest"])
    raise PullError("no linux/amd64 manifest in the index")
