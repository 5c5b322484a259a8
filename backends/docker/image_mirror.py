"""The engine's images, mirrored in memory and kept current by its event stream.

ListImages is polled (the kubelet's image GC and node status). Through the engine
each call is a ``/images/json``, for which the engine sizes every image (tens of
milliseconds at a hundred images), plus an inspect per new image for its user.
Here the list is read when the event stream connects and again after each change
the stream announces, and calls are answered from memory:

- Only while the stream is connected and a read begun since has landed; else
  :meth:`ImageMirror.current` says None and the caller asks the engine. A mirror
  that may have missed an event is never served.
- An event marks the mirror behind and starts a read. A caller that comes after
  the event waits for a read begun after it, so every answer holds every change
  heard of. The events of a burst (a prune) share reads.
- The backend's own pulls and removals are applied at once (read-your-writes), and
  again on top of a read that was under way across them.
- Changes the engine announces with no event (an untagged classic build) are
  caught by a read every ``_RESYNC`` seconds, which no caller waits for.

The reference -> image ID memo of CreateContainer is kept here too, on the same terms.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import structlog

from backends.contract import ImageInfo, image_user
from backends.contract.errors import CriError, NotFoundError

from .engine_api import EngineAPI, parse_time

log = structlog.get_logger(__name__)

_RESYNC = 60.0  # s
_RETRY = 1.0  # s between reads the engine did not answer
_IDS_MAX = 4096


@dataclasses.dataclass(frozen=True)
class _Image:
    created: int  # s: the engine lists the newest first
    info: ImageInfo

    def order(self) -> tuple[int, str]:
        # Newest first as the engine lists them; the engine orders images created in the
        # same second differently from call to call, so ties go by ID: one answer, not many.
        return (-self.created, self.info.id)


class ImageMirror:
    def __init__(self, engine: EngineAPI, pause_image: str) -> None:
        self._engine = engine
        self._pause_image = pause_image
        self._images: dict[str, _Image] = {}  # by ID, newest first (``_Image.order``)
        self._pause_id = ""
        self._users: dict[str, tuple[int | None, str]] = {}  # image ID -> (uid, name); IDs are immutable
        self._stop_signals: dict[str, str] = {}  # image ID -> its config's StopSignal ("" for none)
        self.ids: dict[str, str] = {}  # reference -> image ID, while the stream is connected
        self.generation = 0  # of ``ids``: an answer from across a change is not kept
        self._live = False  # the event stream is connected
        self._synced = False  # and a read since has landed
        self._heard = 0  # changes announced (and connections made)
        self._applied = 0  # how many of them the mirror holds
        self._resync_due = False
        self._patches: list[Callable[[], None]] | None = None  # own writes during the read under way
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._waiters: list[asyncio.Future[bool]] = []

    @property
    def synced(self) -> bool:
        return self._synced

    # ---------------------------------------------------------------- the event stream's side

    def connected(self) -> None:
        self._live = True
        self.changed()

    def changed(self) -> None:
        """The stream announced a change (or connected): read the list again."""
        self._heard += 1
        self._forget_ids()
        self._start()

    def disconnected(self) -> None:
        self._live = self._synced = False
        self._forget_ids()
        self._patches = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._wake(False)

    def _start(self) -> None:
        if self._live and self._task is None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._task = asyncio.get_running_loop().create_task(self._follow())

    def _resync(self) -> None:
        self._timer = None
        self._resync_due = True
        self._start()

    async def _follow(self) -> None:
        try:
            while self._live and (self._applied < self._heard or self._resync_due):
                self._resync_due = False
                upto = self._heard
                self._patches = []
                try:
                    images, pause_id = await self._read()
                except CriError as exc:
                    self._patches = None
                    self._synced = False  # until a read lands: callers ask the engine meanwhile
                    log.info("image list not read: ListImages asks the engine", error=exc.message)
                    self._wake(False)
                    await asyncio.sleep(_RETRY)
                    continue
                patches, self._patches = self._patches, None
                self._images, self._pause_id = images, pause_id
                self._users = {i: u for i, u in self._users.items() if i in images}
                self._stop_signals = {i: v for i, v in self._stop_signals.items() if i in images}
                for patch in patches:
                    patch()
                self._applied = upto
                self._synced = True
                self._wake(True)
            if self._live:
                self._timer = asyncio.get_running_loop().call_later(_RESYNC, self._resync)
        finally:
            if self._task is asyncio.current_task():
                self._task = None

    def _wake(self, landed: bool) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(landed)
        self._waiters.clear()

    # ---------------------------------------------------------------- answers

    async def current(self) -> list[ImageInfo] | None:
        """The images, as the engine lists them, with every change heard of so far;
        None when the mirror cannot say (stream down, not read since, a read failed)."""
        want = self._heard
        while self._synced and self._applied < want and self._task is not None:
            waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            if not await waiter:
                return None
        if not self._synced or self._applied < want:
            return None
        return [image.info for image in self._images.values()]

    def current_now(self) -> list[ImageInfo] | None:
        """What ``current`` answers when it need not wait: None while a heard change is not
        applied yet, or the mirror cannot say."""
        if not self._synced or self._applied < self._heard:
            return None
        return [image.info for image in self._images.values()]

    async def from_engine(self) -> list[ImageInfo]:
        """The images as the engine lists them now (what ``current`` cannot say)."""
        images, _pause_id = await self._read()
        return [image.info for image in images.values()]

    async def _read(self) -> tuple[dict[str, _Image], str]:
        """The engine's list now, and the pause image's ID."""
        rows, pause_id = await asyncio.gather(self._engine.image_list(), self._inspect_pause())
        unknown = [r["Id"] for r in rows if r["Id"] not in self._users]
        for inspected in await asyncio.gather(
            *(self._engine.image_inspect(i) for i in unknown), return_exceptions=True
        ):
            if isinstance(inspected, dict):
                self._remember_user(inspected)
        read = []
        for r in rows:
            image_id = str(r["Id"])
            tags, digests = r.get("RepoTags") or [], r.get("RepoDigests") or []
            info = self._info(image_id, tags, digests, int(r.get("Size") or 0), pause_id)
            read.append(_Image(int(r.get("Created") or 0), info))
        return {i.info.id: i for i in sorted(read, key=_Image.order)}, pause_id

    async def pause_id(self) -> str:
        """The pause image's ID ("" when it is absent)."""
        if self._synced and self._applied == self._heard:
            return self._pause_id
        return await self._inspect_pause()

    def info_of(self, inspected: dict[str, Any], pause_id: str) -> ImageInfo:
        """An image as an inspect answer describes it."""
        self._remember_user(inspected)
        image_id = str(inspected["Id"])
        tags, digests = inspected.get("RepoTags") or [], inspected.get("RepoDigests") or []
        return self._info(image_id, tags, digests, int(inspected.get("Size") or 0), pause_id)

    async def _inspect_pause(self) -> str:
        try:
            return str((await self._engine.image_inspect(self._pause_image))["Id"])
        except NotFoundError:
            return ""

    def _remember_user(self, inspected: dict[str, Any]) -> None:
        config = inspected.get("Config") or {}
        image_id = str(inspected["Id"])
        self._users[image_id] = image_user(str(config.get("User") or ""))
        self._stop_signals[image_id] = str(config.get("StopSignal") or "")

    def stop_signal(self, image_id: str) -> str | None:
        """The image's STOPSIGNAL as its config writes it ("" for none); None if not inspected yet."""
        return self._stop_signals.get(image_id)

    def _info(
        self, image_id: str, tags: list[str], digests: list[str], size: int, pause_id: str
    ) -> ImageInfo:
        uid, username = self._users.get(image_id, (None, ""))
        # The engine lists an image with neither as "<none>:<none>", "<none>@<none>".
        return ImageInfo(
            id=image_id,
            repo_tags=tuple(t for t in tags if t != "<none>:<none>"),
            repo_digests=tuple(d for d in digests if d != "<none>@<none>"),
            size=size,
            uid=uid,
            username=username,
            pinned=bool(pause_id) and image_id == pause_id,
        )

    # ---------------------------------------------------------------- the backend's own writes

    def pulled(self, ref: str, inspected: dict[str, Any]) -> None:
        """``ref`` was pulled; ``inspected`` is the image's inspect answer after the pull."""
        info = self.info_of(inspected, "")
        created = parse_time(str(inspected.get("Created") or "")) // 1_000_000_000
        self._write(functools.partial(self._put, _Image(created, info), ref == self._pause_image))

    def removed(self, image_id: str) -> None:
        self._write(functools.partial(self._drop, image_id))

    def _write(self, patch: Callable[[], None]) -> None:
        self._forget_ids()
        patch()
        if self._patches is not None:
            self._patches.append(patch)

    def _put(self, image: _Image, is_pause: bool) -> None:
        # A tag names one image: the engine moved it here from any other.
        moved = set(image.info.repo_tags)
        for image_id, other in self._images.items():
            if image_id != image.info.id and moved.intersection(other.info.repo_tags):
                tags = tuple(t for t in other.info.repo_tags if t not in moved)
                self._images[image_id] = _Image(
                    other.created, dataclasses.replace(other.info, repo_tags=tags)
                )
        self._images[image.info.id] = image
        ordered = sorted(self._images.values(), key=_Image.order)
        self._images = {i.info.id: i for i in ordered}
        self._pin(image.info.id if is_pause else self._pause_id)

    def _drop(self, image_id: str) -> None:
        self._images.pop(image_id, None)
        if image_id == self._pause_id:
            self._pause_id = ""

    def _pin(self, pause_id: str) -> None:
        self._pause_id = pause_id
        for image_id, image in self._images.items():
            pinned = bool(pause_id) and image_id == pause_id
            if image.info.pinned != pinned:
                self._images[image_id] = _Image(image.created, dataclasses.replace(image.info, pinned=pinned))

    # ---------------------------------------------------------------- reference -> ID memo

    def remember(self, ref: str, image_id: str, generation: int) -> None:
        if self._live and generation == self.generation and len(self.ids) < _IDS_MAX:
            self.ids[ref] = image_id

    def _forget_ids(self) -> None:
        self.ids.clear()
        self.generation += 1
