"""Images through the engine: pull (shared, with auth and a no-progress timeout), list, status, remove."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
from typing import Any

import structlog

from backends.contract import ImageInfo, image_user
from backends.contract.errors import (
    CriError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
)
from backends.linux.usage import UsageCache
from backends.reference import DEFAULT_DOMAIN, BadReference, Reference, parse
from cri_api import api_pb2 as pb

from .engine_api import EngineAPI

log = structlog.get_logger(__name__)

_PROGRESS_LOG_EVERY = 10.0  # s


def _parse(ref: str) -> Reference:
    try:
        return parse(ref)
    except BadReference as exc:
        raise InvalidArgumentError(str(exc)) from None


def split_reference(ref: str) -> tuple[str, str]:
    """(fromImage, tag) for POST /images/create: by digest when there is one (not every tag)."""
    r = _parse(ref)
    if r.digest:
        return r.digested(r.digest), ""
    return r.repository, r.tag


def registry_of(ref: str) -> str:
    domain = _parse(ref).domain
    return "https://index.docker.io/v1/" if domain == DEFAULT_DOMAIN else domain


def registry_auth(auth: pb.AuthConfig | None, ref: str) -> str | None:
    """The X-Registry-Auth header value (base64url JSON), or None for anonymous pulls."""
    if auth is None or not (auth.username or auth.auth or auth.identity_token or auth.registry_token):
        return None
    username, password = auth.username, auth.password
    if auth.auth and not username:
        try:
            username, _, password = base64.b64decode(auth.auth).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            username = password = ""
    body: dict[str, str] = {"serveraddress": auth.server_address or registry_of(ref)}
    if username:
        body["username"] = username
        body["password"] = password
    if auth.identity_token:
        body["identitytoken"] = auth.identity_token
    if auth.registry_token:
        body["registrytoken"] = auth.registry_token
    return base64.urlsafe_b64encode(json.dumps(body).encode()).decode()


class Images:
    def __init__(self, engine: EngineAPI, pause_image: str, no_progress_timeout: float) -> None:
        self._engine = engine
        self.pause_image = pause_image
        self._no_progress_timeout = no_progress_timeout
        self._pulls: dict[str, asyncio.Task[str]] = {}
        self._users: dict[str, tuple[int | None, str]] = {}  # image ID -> (uid, name); IDs are immutable
        self._pause_id = ""
        self._df: tuple[float, dict[str, Any]] | None = None
        self._root_usage: UsageCache | None = None  # of the graph driver's directory
        self._remove_lock = asyncio.Lock()
        # Reference -> image ID, saving an inspect per CreateContainer. Only
        # used while the backend's event stream is connected: any image event
        # (tag, untag, pull, delete) empties it.
        self._ids: dict[str, str] = {}
        self._ids_trusted = False
        self._ids_generation = 0

    def trust_cache(self, trusted: bool) -> None:
        self._ids.clear()
        self._ids_trusted = trusted
        self._ids_generation += 1

    async def resolve(self, ref: str) -> str:
        """The ID of a local image by reference (name, tag, digest or ID); NotFoundError if absent."""
        cached = self._ids.get(ref)
        if cached:
            return cached
        generation = self._ids_generation
        info = await self._engine.image_inspect(ref)
        image_id = str(info["Id"])
        # An image event during the inspect may concern this very reference:
        # then the answer is not cached.
        if self._ids_trusted and generation == self._ids_generation and len(self._ids) < 4096:
            self._ids[ref] = image_id
        return image_id

    # ---------------------------------------------------------------- pull

    async def pull(self, ref: str, auth: pb.AuthConfig | None) -> str:
        """Pull ``ref`` and return its image ID; concurrent pulls of one reference share one pull."""
        key = ref + "\0" + (registry_auth(auth, ref) or "")
        task = self._pulls.get(key)
        if task is None:
            task = asyncio.create_task(self._pull(ref, auth))
            self._pulls[key] = task
            task.add_done_callback(lambda _t: self._pulls.pop(key, None))
        return await asyncio.shield(task)

    async def _pull(self, ref: str, auth: pb.AuthConfig | None) -> str:
        image, tag = split_reference(ref)
        started = time.monotonic()
        if not ref.strip():
            raise InvalidArgumentError("an image reference is required")
        try:
            # The engine answers once the registry does (TLS fallbacks, auth):
            # a wait for the answer is a wait without progress too.
            resp = await self._engine.image_pull(
                image, tag, registry_auth(auth, ref), answer_timeout=self._no_progress_timeout or None
            )
        except InternalError as exc:
            # The engine answers 500 for every registry-side failure.
            raise _pull_error(ref, exc.message) from exc
        except DeadlineExceededError as exc:
            raise DeadlineExceededError(
                f"pull of {ref}: no progress for {self._no_progress_timeout:.0f}s (no answer yet)"
            ) from exc
        last_log = started
        layers: dict[str, str] = {}
        try:
            while True:
                try:
                    async with asyncio.timeout(self._no_progress_timeout or None):
                        line = await resp.read_line()
                except TimeoutError as exc:
                    raise DeadlineExceededError(
                        f"pull of {ref}: no progress for {self._no_progress_timeout:.0f}s"
                    ) from exc
                if not line:
                    break
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if "error" in msg:
                    raise _pull_error(ref, str(msg.get("error")))
                if "id" in msg and "status" in msg:
                    layers[msg["id"]] = msg["status"]
                now = time.monotonic()
                if now - last_log >= _PROGRESS_LOG_EVERY:
                    last_log = now
                    log.info("image pull progress", image=ref, layers=layers, elapsed=round(now - started, 1))
        finally:
            resp.close()
        info = await self._engine.image_inspect(ref)
        log.info("image pulled", image=ref, id=info["Id"], seconds=round(time.monotonic() - started, 2))
        return str(info["Id"])

    async def ensure(self, ref: str) -> str:
        """The ID of ``ref``, pulled first when it is missing."""
        try:
            info = await self._engine.image_inspect(ref)
            return str(info["Id"])
        except NotFoundError:
            return await self.pull(ref, None)

    # ---------------------------------------------------------------- queries

    async def _pause_image_id(self) -> str:
        if not self._pause_id:
            try:
                info = await self._engine.image_inspect(self.pause_image)
                self._pause_id = str(info["Id"])
            except NotFoundError:
                return ""
        return self._pause_id

    def _info(
        self, image_id: str, tags: list[str], digests: list[str], size: int, pause_id: str
    ) -> ImageInfo:
        uid, username = self._users.get(image_id, (None, ""))
        return ImageInfo(
            id=image_id,
            repo_tags=tuple(tags),
            repo_digests=tuple(digests),
            size=size,
            uid=uid,
            username=username,
            pinned=bool(pause_id) and image_id == pause_id,
        )

    def _remember_user(self, info: dict[str, Any]) -> None:
        self._users[str(info["Id"])] = image_user(str((info.get("Config") or {}).get("User") or ""))

    async def list(self) -> list[ImageInfo]:
        rows: list[dict[str, Any]] = await self._engine.image_list()
        unknown = [r["Id"] for r in rows if r["Id"] not in self._users]
        for info in await asyncio.gather(
            *(self._engine.image_inspect(i) for i in unknown),
            return_exceptions=True,
        ):
            if isinstance(info, dict):
                self._remember_user(info)
        pause_id = await self._pause_image_id()
        return [
            self._info(
                r["Id"], r.get("RepoTags") or [], r.get("RepoDigests") or [], r.get("Size", 0), pause_id
            )
            for r in rows
        ]

    async def status(self, ref: str) -> ImageInfo | None:
        if not ref:
            return None
        try:
            info = await self._engine.image_inspect(ref)
        except NotFoundError:
            return None
        self._remember_user(info)
        return self._info(
            str(info["Id"]),
            info.get("RepoTags") or [],
            info.get("RepoDigests") or [],
            int(info.get("Size") or 0),
            await self._pause_image_id(),
        )

    async def remove(self, ref: str) -> None:
        # One removal at a time: the engine untags before it deletes, so a
        # concurrent caller could see the tag gone and answer "removed" while
        # the image still exists by ID.
        async with self._remove_lock:
            await self._remove(ref)

    async def _remove(self, ref: str) -> None:
        try:
            info = await self._engine.image_inspect(ref)
        except NotFoundError:
            return
        try:
            # force: remove every tag of the image at once, as the CRI asks.
            await self._engine.image_remove(info["Id"], force=True)
        except NotFoundError:
            return
        except CriError:
            # Concurrent removals of one image: the engine fails all but one
            # ("unrecognized image ID", conflicts). Gone is what was asked.
            try:
                await self._engine.image_inspect(info["Id"])
            except NotFoundError:
                return
            raise
        if info["Id"] == self._pause_id:
            self._pause_id = ""

    async def fs_info(self) -> pb.ImageFsInfoResponse:
        """Usage of the engine's graph-driver directory, where its image layers and the
        containers' writable layers live (one store, as with every graph driver).

        The kubelet takes the capacity from the filesystem holding the
        mountpoint and the usage from here: what the store holds (a walk of
        that one filesystem in a thread, at most 30 s old), not the whole disk.
        A remote engine (its root not visible here) falls back to /system/df,
        cached for 10 s.
        """
        if self._root_usage is None:
            info = await self._engine.info()
            root = str(info.get("DockerRootDir") or "/var/lib/docker")
            driver = str(info.get("Driver") or "")
            mount = f"{root}/{driver}" if driver else root
            visible = await self._engine.run(lambda: os.path.isdir(mount))
            self._root_usage = UsageCache(mount if visible else "")
        ts = time.time_ns()
        cache = self._root_usage
        inodes: int | None = None
        if cache.path:
            used, inodes = await cache.get()
        else:
            used = await self._df_usage()
        usage = pb.FilesystemUsage(
            timestamp=ts,
            fs_id=pb.FilesystemIdentifier(mountpoint=cache.path or "/var/lib/docker"),
            used_bytes=pb.UInt64Value(value=used),
        )
        if inodes is not None:
            usage.inodes_used.value = inodes
        return pb.ImageFsInfoResponse(image_filesystems=[usage], container_filesystems=[usage])

    async def _df_usage(self) -> int:
        now = time.monotonic()
        if self._df is None or now - self._df[0] > 10:
            df = await self._engine.df()
            self._df = (now, df)
        df = self._df[1]
        writable = sum(int(c.get("SizeRw") or 0) for c in df.get("Containers") or [])
        return int(df.get("LayersSize") or 0) + writable


def _pull_error(ref: str, message: str) -> CriError:
    """A registry-side pull failure as a CRI condition.

    UNAVAILABLE is kept for the engine itself being down: an unreachable
    registry is a precondition of this pull, not of the runtime.
    """
    low = message.lower()
    if any(s in low for s in ("invalid reference", "must not be more than", "no host in request url")):
        return InvalidArgumentError(f"pull {ref}: {message}")
    if any(
        s in low
        for s in (
            "not found",
            "manifest unknown",
            "does not exist",
            "pull access denied",
            "unauthorized",
            "no such host",
        )
    ):
        return NotFoundError(f"pull {ref}: {message}")
    if any(
        s in low for s in ("connection refused", "timeout", "tls", "x509", "dial tcp", "connection reset")
    ):
        return FailedPreconditionError(f"pull {ref}: registry unreachable: {message}")
    return InternalError(f"pull {ref}: {message}")
