"""Images through the engine: pull (shared, with auth and a no-progress timeout), list (from
the mirror of :mod:`.image_mirror`), status, remove."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import time

import structlog

from backends.contract import ImageInfo
from backends.contract.errors import (
    CriError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
)
from backends.contract.pinning import PinnedImages
from backends.reference import DEFAULT_DOMAIN, BadReference, Reference, parse
from cri_api import api_pb2 as pb

from .engine_api import EngineAPI
from .image_fs import StoreUsage
from .image_mirror import ImageMirror

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


class EngineImages:
    def __init__(
        self,
        engine: EngineAPI,
        pause_image: str,
        no_progress_timeout: float,
        pinned: PinnedImages | None = None,
    ) -> None:
        self._engine = engine
        self.pause_image = pause_image
        self._no_progress_timeout = no_progress_timeout
        # The pause image is pinned by the mirror (by its ID); these by their tags and digests.
        self._pinned = pinned or PinnedImages()
        self._pulls: dict[str, asyncio.Task[str]] = {}
        self._remove_lock = asyncio.Lock()
        self.mirror = ImageMirror(engine, pause_image)  # fed by the backend's event watcher

    async def resolve(self, ref: str) -> str:
        """The ID of a local image by reference (name, tag, digest or ID); NotFoundError if absent."""
        mirror = self.mirror
        cached = mirror.ids.get(ref)
        if cached:
            return cached
        generation = mirror.generation
        info = await self._engine.image_inspect(ref)
        image_id = str(info["Id"])
        # An image event during the inspect may concern this very reference:
        # then the answer is not kept.
        mirror.remember(ref, image_id, generation)
        return image_id

    async def stop_signal(self, image_id: str) -> str:
        """The image's STOPSIGNAL as its config writes it ("" for none): remembered per image ID
        (IDs are immutable), so a container's create costs no engine call for it."""
        known = self.mirror.stop_signal(image_id)
        if known is not None:
            return known
        inspected = await self._engine.image_inspect(image_id)
        self.mirror.info_of(inspected, "")  # remembers it
        return str((inspected.get("Config") or {}).get("StopSignal") or "")

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
        self.mirror.pulled(ref, info)
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

    def list_now(self) -> list[ImageInfo] | None:
        images = self.mirror.current_now()
        return None if images is None else _pin(self._pinned, images)

    async def list(self) -> list[ImageInfo]:
        images = await self.mirror.current()
        return _pin(self._pinned, images if images is not None else await self.mirror.from_engine())

    async def status(self, ref: str) -> ImageInfo | None:
        if not ref:
            return None
        try:
            info = await self._engine.image_inspect(ref)
        except NotFoundError:
            return None
        return _pin(self._pinned, [self.mirror.info_of(info, await self.mirror.pause_id())])[0]

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
                self.mirror.removed(str(info["Id"]))
                return
            raise
        self.mirror.removed(str(info["Id"]))


class DockerImages:
    """The Images part: the engine's images by the CRI's image specs, and the image store's
    filesystem figures (:mod:`.image_fs`)."""

    def __init__(self, images: EngineImages, usage: StoreUsage) -> None:
        self.engine_images = images
        self.usage = usage

    async def pull_image(
        self, image: pb.ImageSpec, auth: pb.AuthConfig | None, sandbox_config: pb.PodSandboxConfig | None
    ) -> str:
        return await self.engine_images.pull(image.image, auth)

    async def list_images(self) -> list[ImageInfo]:
        return await self.engine_images.list()

    def list_images_now(self) -> list[ImageInfo] | None:
        return self.engine_images.list_now()

    async def image_status(self, image: pb.ImageSpec) -> ImageInfo | None:
        return await self.engine_images.status(image.image)

    async def remove_image(self, image: pb.ImageSpec) -> None:
        await self.engine_images.remove(image.image)

    async def image_fs_info(self) -> pb.ImageFsInfoResponse:
        return await self.usage.fs_info()

    def image_fs_info_now(self) -> pb.ImageFsInfoResponse | None:
        return self.usage.fs_info_now()


def _pin(pins: PinnedImages, images: list[ImageInfo]) -> list[ImageInfo]:
    """``images`` with those the ``pinned`` patterns match pinned."""
    if not pins:
        return images
    return [
        dataclasses.replace(i, pinned=True)
        if not i.pinned and pins.matches(i.repo_tags, i.repo_digests)
        else i
        for i in images
    ]


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
