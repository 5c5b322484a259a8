"""An OCI image store independent of Docker.

Layout under ``root``::

    blobs/sha256/<hex>         manifests and configs (digest-verified)
    snapshots/<hex>/fs         one unpacked layer per diff ID, whiteouts in overlayfs form
    index.json                 images by ID (config digest) with their tags and repo digests

Containers get ``lowerdir=<top layer>:...:<bottom layer>`` over a private
upper directory: the layers are shared copy-on-write between containers.

A pull fetches the manifest and the config, then the layers it lacks, up to
``max_concurrent_downloads`` at once, each verified and unpacked as it streams
(:mod:`.layers`); the image enters the index only once every layer is in place. A failed
pull leaves no temporary file (those of a killed process are swept when the store opens)
and keeps the layers it verified, so that a retry fetches only the rest. Two pulls that
want the same layer or config (the same image, or images sharing layers) fetch it once.

The registry side is :mod:`backends.oci.registry`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import glob
import hashlib
import json
import os
import re
import shutil
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from backends import reference
from backends.contract.errors import InvalidArgumentError, ResourceExhaustedError
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

from .layers import UNPACK_PREFIX, Flights, Layer, PullCancelled, fetch_all, fetch_bytes, fetch_layer
from .unpack import unpack_fileobj, unpack_layer

__all__ = ["Credentials", "Image", "ImageStore", "PullError", "unpack_layer"]

# A layer declaring more than this is refused before anything is fetched (a sanity limit: a
# registry's word is not a reason to fill the disk).
MAX_LAYER_SIZE = 64 * 1024**3
MAX_CONFIG_SIZE = 16 * 1024 * 1024
# Pulls running at once (each in a thread of its own, its layers in threads of their own).
PULL_THREADS = 32


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


# --------------------------------------------------------------------------- the store


@dataclasses.dataclass(slots=True)
class _Running:
    """A pull in its thread, and the callers waiting for it (the last one gone cancels it)."""

    task: asyncio.Future[str]
    cancel: threading.Event
    waiters: int = 0


class ImageStore:
    def __init__(
        self, root: str, settings: PullSettings | None = None, *, max_layer_size: int = MAX_LAYER_SIZE
    ) -> None:
        self.root = root
        self.settings = settings or PullSettings()
        self.max_layer_size = max_layer_size
        self._blobs = os.path.join(root, "blobs", "sha256")
        self._snapshots = os.path.join(root, "snapshots")
        self._index_path = os.path.join(root, "index.json")
        self._lock = threading.Lock()  # index and snapshots: pulls run in worker threads
        self._pulls: dict[str, _Running] = {}
        self._flights = Flights()  # blobs being fetched, by digest
        self._pulling: collections.Counter[str] = collections.Counter()  # diff IDs pulls need
        self._threads = concurrent.futures.ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="pull")
        self._active = 0  # pull threads running, cancelled ones until they stopped
        os.makedirs(self._blobs, exist_ok=True)
        os.makedirs(self._snapshots, exist_ok=True)
        self._sweep()
        self.images: dict[str, Image] = self._load()

    def _sweep(self) -> None:
        """Remove what a process killed in the middle of a pull left: unpacking directories,
        temporary files of blobs and of the index."""
        for tmp in glob.glob(os.path.join(glob.escape(self._snapshots), UNPACK_PREFIX + "*")):
            shutil.rmtree(tmp, ignore_errors=True)
        for pattern in (os.path.join(self._blobs, ".*.tmp"), os.path.join(self.root, ".index.json.*.tmp")):
            for tmp in glob.glob(pattern):
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

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
            # Layers other images use, or a running pull (the one pulling them, or another).
            used = {d for i in self.images.values() for d in i.diff_ids} | set(self._pulling)
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
            snap = os.path.dirname(self.snapshot_dir(diff_id))
            if not os.path.isdir(snap):
                tmp = tempfile.mkdtemp(dir=self._snapshots, prefix=UNPACK_PREFIX)
                try:
                    buf.seek(0)
                    unpack_fileobj(buf, os.path.join(tmp, "fs"))
                    os.rename(tmp, snap)
                    tmp = ""
                finally:
                    if tmp:
                        shutil.rmtree(tmp, ignore_errors=True)
            buf.close()
            write_atomic(os.path.join(self._blobs, hex_of(image_id)), raw)
            self._register(Image(image_id, [ref.tagged], [], 0, [diff_id], image_config))
        return image_id

    # ---- pull
    async def pull(self, ref: str, creds: Credentials | None = None) -> str:
        """Pull ``ref``; concurrent pulls of one reference share the work (the first caller's
        credentials). Cancelled when every caller waiting for it was."""
        try:
            parsed = reference.parse(ref)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        key = str(parsed)
        running = self._pulls.get(key)
        if running is None:
            cancel = threading.Event()
            call = contextvars.copy_context().run
            task = asyncio.get_running_loop().run_in_executor(
                self._threads, call, self._pull, parsed, creds, cancel
            )
            running = self._pulls[key] = _Running(task, cancel)
            task.add_done_callback(lambda done: self._pull_done(key, running, done))
        running.waiters += 1
        try:
            return await asyncio.shield(running.task)
        finally:
            running.waiters -= 1
            if not running.waiters and not running.task.done():
                running.cancel.set()  # the thread stops at its next chunk and cleans up
                if self._pulls.get(key) is running:
                    del self._pulls[key]  # a new pull of it starts afresh

    def _pull_done(self, key: str, running: _Running, task: asyncio.Future[str]) -> None:
        if self._pulls.get(key) is running:
            del self._pulls[key]
        if not task.cancelled():
            task.exception()  # retrieved: the waiters re-raise it, or all of them are gone

    def pulling(self) -> int:
        """Pull threads still running (a cancelled pull's until it cleaned up)."""
        with self._lock:
            return self._active

    def _client(self, ref: reference.Reference, creds: Credentials | None) -> RegistryClient:
        return RegistryClient(ref, creds, self.settings)

    def _pull(self, ref: reference.Reference, creds: Credentials | None, cancel: threading.Event) -> str:
        with self._lock:
            self._active += 1
        try:
            return self._pull_image(ref, creds, cancel)
        finally:
            with self._lock:
                self._active -= 1

    def _pull_image(
        self, ref: reference.Reference, creds: Credentials | None, cancel: threading.Event
    ) -> str:
        reg = self._client(ref, creds)
        try:
            raw, digest, doc = self._manifest(reg, ref)
            config_digest, config_size, layer_descs = _manifest_parts(doc)
            cfg = self._config(reg, config_digest, config_size, cancel)
            diff_ids = _diff_ids(cfg)
            if len(layer_descs) != len(diff_ids):
                raise PullError(
                    f"the manifest lists {len(layer_descs)} layers, the config {len(diff_ids)} diff IDs"
                )
            layers = [Layer(d, size, diff) for (d, size), diff in zip(layer_descs, diff_ids, strict=True)]
            with self._needing(diff_ids):
                missing = [layer for layer in layers if not os.path.isdir(self._snapshot_of(layer))]
                self._check_sizes(missing)

                def one(layer: Layer) -> None:
                    self._flights.run(layer.digest, lambda: self._layer(reg, layer, cancel), cancel)

                fetch_all(missing, one, self.settings.max_concurrent_downloads, cancel)
                if cancel.is_set():  # the layers came, but nobody wants the image now
                    raise PullCancelled("cancelled")
                write_atomic(os.path.join(self._blobs, hex_of(digest)), raw)
                with self._lock:
                    gone = [d for d in diff_ids if not os.path.isdir(self.snapshot_dir(d))]
                    if gone:
                        raise PullError(f"layer {gone[0]} went away during the pull")
                    self._register(
                        Image(
                            id=config_digest,
                            repo_tags=[ref.tagged] if ref.tag else [],
                            repo_digests=[ref.digested(digest)],
                            size=sum(layer.size for layer in layers),
                            diff_ids=diff_ids,
                            config=_run_config(cfg),
                        )
                    )
        except PullCancelled:
            raise
        except PullError as exc:
            raise InvalidArgumentError(f"pull {ref}: {exc}") from None
        return config_digest

    def _manifest(self, reg: RegistryClient, ref: reference.Reference) -> tuple[bytes, str, dict[str, Any]]:
        """The image manifest (raw, digest, parsed), through an index when the registry gives one."""
        raw, media, digest = reg.manifest(ref.digest or ref.tag)
        doc = _json(raw, "the manifest")
        if media in (MEDIA_OCI_INDEX, MEDIA_DOCKER_LIST) or "manifests" in doc:
            chosen = _pick_platform(doc.get("manifests"))
            raw, media, digest = reg.manifest(chosen)
            doc = _json(raw, f"the manifest {chosen}")
        if ref.digest and digest != ref.digest and not ref.tag:
            # A digest reference may name the index; the repo digest is the one asked for.
            digest = ref.digest
        return raw, digest, doc

    def _config(self, reg: RegistryClient, digest: str, size: int, cancel: threading.Event) -> dict[str, Any]:
        path = os.path.join(self._blobs, hex_of(digest))

        def fetch() -> None:
            if not os.path.exists(path):
                data = fetch_bytes(reg.open_blob, digest, size, f"config {digest}", cancel)
                _json(data, "the config")  # a config that does not parse is not stored
                write_atomic(path, data)

        if not os.path.exists(path):
            if size > MAX_CONFIG_SIZE:
                raise PullError(f"the config declares {size} bytes (at most {MAX_CONFIG_SIZE})")
            self._flights.run(digest, fetch, cancel)
        with open(path, "rb") as fh:
            return _json(fh.read(), "the config")

    def _snapshot_of(self, layer: Layer) -> str:
        return os.path.dirname(self.snapshot_dir(layer.diff_id))

    def _layer(self, reg: RegistryClient, layer: Layer, cancel: threading.Event) -> None:
        if not os.path.isdir(self._snapshot_of(layer)):  # another blob of the same diff ID came first
            fetch_layer(reg.open_blob, layer, self._snapshot_of(layer), cancel)

    def _check_sizes(self, missing: list[Layer]) -> None:
        for layer in missing:
            if layer.size > self.max_layer_size:
                raise PullError(
                    f"layer {layer.digest} declares {layer.size} bytes, more than the limit of "
                    f"{self.max_layer_size}"
                )
        need = sum(layer.size for layer in missing)
        fs = os.statvfs(self._snapshots)
        free = fs.f_bavail * fs.f_frsize
        if need > free:
            raise ResourceExhaustedError(
                f"its layers declare {need} bytes and {free} are free in {self._snapshots}"
            )

    @contextlib.contextmanager
    def _needing(self, diff_ids: list[str]) -> Iterator[None]:
        """Keep ``remove`` off these layers while the pull runs (it may share them with an
        image being removed)."""
        with self._lock:
            self._pulling.update(diff_ids)
        try:
            yield
        finally:
            with self._lock:
                self._pulling.subtract(diff_ids)
                self._pulling += collections.Counter()  # drops the zeros


def _json(raw: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise PullError(f"{what} does not parse: {exc}") from None
    if not isinstance(doc, dict):
        raise PullError(f"{what} is not a JSON object")
    return doc


def _descriptor(desc: Any, what: str) -> tuple[str, int]:
    """(digest, size) of a manifest's descriptor."""
    if not isinstance(desc, dict):
        raise PullError(f"the manifest's {what} is not an object")
    digest, size = desc.get("digest"), desc.get("size")
    if not isinstance(digest, str):
        raise PullError(f"the manifest's {what} has no digest")
    hex_of(digest)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise PullError(f"the manifest's {what} has no valid size")
    return digest, size


def _manifest_parts(doc: dict[str, Any]) -> tuple[str, int, list[tuple[str, int]]]:
    config_digest, config_size = _descriptor(doc.get("config"), "config")
    layers = doc.get("layers")
    if not isinstance(layers, list):
        raise PullError("the manifest has no list of layers")
    return config_digest, config_size, [_descriptor(d, f"layer {i}") for i, d in enumerate(layers)]


def _diff_ids(cfg: dict[str, Any]) -> list[str]:
    rootfs = cfg.get("rootfs")
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(diff_ids, list) or not all(isinstance(d, str) for d in diff_ids):
        raise PullError("the config has no rootfs.diff_ids list")
    for d in diff_ids:
        hex_of(d)
    return diff_ids


def _run_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config's "config" object (Env, Cmd, User, ...)."""
    run = cfg.get("config")
    return dict(run) if isinstance(run, dict) else {}


def _pick_platform(manifests: Any) -> str:
    for m in manifests if isinstance(manifests, list) else []:
        p = m.get("platform") if isinstance(m, dict) else None
        if isinstance(p, dict) and p.get("os") == "linux" and p.get("architecture") == "amd64":
            digest = m.get("digest")
            if isinstance(digest, str):
                hex_of(digest)
                return digest
    raise PullError("no linux/amd64 manifest in the index")
