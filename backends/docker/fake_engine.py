"""A recording fake of the Docker Engine API (:class:`.engine_api.EngineAPI`), in memory.

Containers and images with their state transitions (created -> running ->
exited, OOM kills), an event stream (container deaths; image pulls, tags,
untags and deletes as dockerd reports them), container output, a call log,
and scripted failures per operation (FIFO: "fail twice, then succeed"). It lives
beside the protocol, not in the tests, so that mypy checks it against the
protocol on every run and so that benches and other tests can use it too.
"""

from __future__ import annotations

import asyncio
import calendar
import dataclasses
import itertools
import random
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from backends.contract.errors import (
    AlreadyExistsError,
    CriError,
    FailedPreconditionError,
    NotFoundError,
    UnavailableError,
)

from .engine_api import EngineAPI

T = TypeVar("T")


def _rfc3339(ns: int) -> str:
    secs, frac = divmod(ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs)) + f".{frac:09d}Z"


def _seconds(rfc3339: str) -> int:
    return calendar.timegm(time.strptime(rfc3339[:19], "%Y-%m-%dT%H:%M:%S"))


@dataclasses.dataclass
class FakeContainer:
    id: str
    name: str
    config: dict[str, Any]
    running: bool = False
    pid: int = 0
    exit_code: int = 0
    oom_killed: bool = False
    started_at: int = 0
    finished_at: int = 0
    output: list[tuple[int, str, bytes]] = dataclasses.field(default_factory=list)  # (at, stream, data)

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.config.get("Labels") or {})

    def inspect(self) -> dict[str, Any]:
        return {
            "Id": self.id,
            "Name": "/" + self.name,
            "State": {
                "Running": self.running,
                "Pid": self.pid if self.running else 0,
                "ExitCode": self.exit_code,
                "OOMKilled": self.oom_killed,
                "StartedAt": _rfc3339(self.started_at) if self.started_at else "0001-01-01T00:00:00Z",
                "FinishedAt": _rfc3339(self.finished_at) if self.finished_at else "0001-01-01T00:00:00Z",
                "Error": "",
            },
            "Config": {
                "Tty": bool(self.config.get("Tty")),
                "Labels": self.labels,
                "StopSignal": str(self.config.get("StopSignal") or ""),
            },
            "HostConfig": dict(self.config.get("HostConfig") or {}),
            "NetworkSettings": {"Networks": {"bridge": {"IPAddress": "10.88.0.2"}}},
            "ResolvConfPath": "",
            "GraphDriver": {"Data": {}},
        }


class FakeStream:
    """An engine stream fed by the fake: frames or JSON lines, until closed or ended."""

    def __init__(self) -> None:
        self._items: asyncio.Queue[Any] = asyncio.Queue()
        self.closed = False
        self.sent = bytearray()

    def put(self, item: Any) -> None:
        self._items.put_nowait(item)

    def end(self) -> None:
        self._items.put_nowait(None)

    async def _next(self) -> Any:
        if self.closed:
            return None
        return await self._items.get()

    async def frames(self, tty: bool) -> AsyncIterator[tuple[str, bytes]]:
        while (item := await self._next()) is not None:
            yield item

    async def read_line(self) -> bytes:
        item = await self._next()
        return b"" if item is None else bytes(item)

    async def json_lines(self) -> AsyncIterator[dict[str, Any]]:
        while (item := await self._next()) is not None:
            yield item

    async def send(self, data: bytes) -> None:
        self.sent += data

    def close_input(self) -> None:
        pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.end()


class FakeEngine:
    """In-memory engine. ``calls`` records (operation, first argument); ``fail`` scripts errors."""

    call_timeout = 5.0

    def __init__(self) -> None:
        self.containers: dict[str, FakeContainer] = {}
        self.images: dict[str, dict[str, Any]] = {}  # image ID -> inspect answer
        self.calls: list[tuple[str, Any]] = []
        self.down = False  # the engine cannot be reached: every call is UNAVAILABLE
        # Operations whose answer, once made, waits for the test's go-ahead (set the event): image_list.
        self.gates: dict[str, asyncio.Event] = {}
        self.event_delay = 0.0  # s between an image change and its event reaching the streams
        self.info_answer: dict[str, Any] = {"CgroupDriver": "cgroupfs", "DockerRootDir": "/nonexistent"}
        self._failures: dict[str, list[CriError]] = {}
        self._watchers: list[FakeStream] = []
        self._pids = itertools.count(40_000)
        self._followers: dict[str, list[FakeStream]] = {}

    # ---------------------------------------------------------------- scripting

    def fail(self, operation: str, *errors: CriError) -> None:
        """The next calls of ``operation`` raise these, in order; then it works again."""
        self._failures.setdefault(operation, []).extend(errors)

    def count(self, operation: str) -> int:
        return sum(1 for op, _ in self.calls if op == operation)

    def add_image(self, *refs: str, user: str = "", stop_signal: str = "") -> str:
        """A new image under ``refs``, as a pull on the host makes one: the refs move to it
        from any other image, and each is announced by a pull event."""
        image_id = "sha256:" + secrets.token_hex(32)
        for ref in refs:
            self._untag(ref)
        self.images[image_id] = {
            "Id": image_id,
            "RepoTags": list(refs),
            "RepoDigests": [],
            "Created": _rfc3339(time.time_ns()),
            "Size": 1000,
            "Config": {"User": user, "StopSignal": stop_signal},
        }
        for ref in refs:
            self._emit_image("pull", ref, ref)
        return image_id

    def tag_image(self, image_id: str, ref: str) -> None:
        """``docker tag``: ``ref`` moves to the image (no event for the one it leaves)."""
        self._untag(ref)
        self.images[image_id]["RepoTags"].append(ref)
        self._emit_image("tag", image_id, ref)

    def rmi(self, ref: str) -> None:
        """``docker rmi ref``: untag, and delete the image with its last tag."""
        info = self._image(ref)
        if ref in info["RepoTags"] and len(info["RepoTags"]) > 1:
            info["RepoTags"].remove(ref)
            self._emit_image("untag", info["Id"], info["Id"])
        else:
            self._delete(info["Id"])

    def by_cri_id(self, cri_id: str) -> FakeContainer | None:
        return next((c for c in self.containers.values() if c.labels.get("io.cri-shim.id") == cri_id), None)

    def write(self, engine_id: str, stream: str, data: bytes) -> None:
        """The container prints ``data``."""
        c = self.containers[engine_id]
        at = time.time_ns()
        c.output.append((at, stream, data))
        for s in self._followers.get(engine_id, []):
            s.put((stream, self._stamp(at, data, s)))

    def exit(self, engine_id: str, code: int, oom: bool = False, oom_event_first: bool = True) -> None:
        """The container's process ends on its own (an OOM kill: code 137 and an oom event)."""
        c = self.containers[engine_id]
        if oom and oom_event_first:
            self._emit(c, "oom")
        self._end(c, code, oom_flag=oom and oom_event_first)
        if oom and not oom_event_first:
            self._emit(c, "oom")  # the flag lost the race; the event did not

    def following(self, engine_id: str) -> bool:
        """Whether someone follows the container's log stream."""
        return bool(self._followers.get(engine_id))

    def exit_with_late_output(self, engine_id: str, code: int, data: bytes, die_after: float) -> None:
        """As the engine does with a last unterminated line: the followed log streams end when
        the process does, the line lands in the log after that, and the die event comes
        ``die_after`` s later."""
        c = self.containers[engine_id]
        c.running, c.exit_code = False, code
        c.finished_at = time.time_ns()
        for s in self._followers.pop(c.id, []):
            s.end()
        c.output.append((time.time_ns(), "stdout", data))
        asyncio.get_running_loop().call_later(die_after, self._emit, c, "die")

    # ---------------------------------------------------------------- internals

    def _enter(self, operation: str, arg: Any = None) -> None:
        self.calls.append((operation, arg))
        if self.down:
            raise UnavailableError("docker engine unreachable: fake engine is down")
        queue = self._failures.get(operation)
        if queue:
            raise queue.pop(0)

    def _get(self, ref: str) -> FakeContainer:
        c = self.containers.get(ref) or next((c for c in self.containers.values() if c.name == ref), None)
        if c is None:
            raise NotFoundError(f"No such container: {ref}")
        return c

    def _image(self, ref: str) -> dict[str, Any]:
        for image_id, info in self.images.items():
            if ref == image_id or ref in info["RepoTags"]:
                return info
        raise NotFoundError(f"No such image: {ref}")

    def _untag(self, ref: str) -> None:
        for info in self.images.values():
            if ref in info["RepoTags"]:
                info["RepoTags"].remove(ref)

    def _delete(self, image_id: str) -> None:
        info = self.images.pop(image_id)
        for _tag in info["RepoTags"]:
            self._emit_image("untag", image_id, image_id)
        self._emit_image("delete", image_id, image_id)

    def _emit_image(self, action: str, actor: str, name: str) -> None:
        ev = {
            "Type": "image",
            "Action": action,
            "id": actor,
            "timeNano": time.time_ns(),
            "Actor": {"ID": actor, "Attributes": {"name": name}},
        }
        for w in list(self._watchers):
            if self.event_delay:
                asyncio.get_running_loop().call_later(self.event_delay, w.put, ev)
            else:
                w.put(ev)

    def break_events(self) -> None:
        """The event streams end (dockerd restarting, a proxy cut): watchers must connect again."""
        for w in self._watchers:
            w.close()
        self._watchers.clear()

    def _emit(self, c: FakeContainer, action: str) -> None:
        ev = {
            "Type": "container",
            "Action": action,
            "id": c.id,
            "timeNano": time.time_ns(),
            "Actor": {"ID": c.id, "Attributes": c.labels},
        }
        for w in list(self._watchers):
            w.put(ev)

    def _end(self, c: FakeContainer, code: int, oom_flag: bool = False) -> None:
        if not c.running:
            return
        c.running, c.exit_code, c.oom_killed = False, code, oom_flag
        c.finished_at = time.time_ns()
        for s in self._followers.pop(c.id, []):
            s.end()
        self._emit(c, "die")

    @staticmethod
    def _stamp(at: int, data: bytes, s: FakeStream) -> bytes:
        return (_rfc3339(at).encode() + b" " + data) if getattr(s, "timestamps", False) else data

    # ---------------------------------------------------------------- EngineAPI

    async def ping(self, deadline: float | None = None) -> None:
        self._enter("ping")

    async def info(self, deadline: float | None = None) -> dict[str, Any]:
        self._enter("info")
        return dict(self.info_answer)

    async def df(self) -> dict[str, Any]:
        self._enter("df")
        return {
            "LayersSize": sum(int(i["Size"]) for i in self.images.values()),
            "Containers": [{"Id": c.id, "SizeRw": 100} for c in self.containers.values()],  # 100 bytes each
        }

    async def events(self, filters: dict[str, list[str]], since: str | None) -> FakeStream:
        self._enter("events", since)
        s = FakeStream()
        self._watchers.append(s)
        return s

    async def create_container(self, name: str, config: dict[str, Any]) -> str:
        self._enter("create_container", name)
        if any(c.name == name for c in self.containers.values()):
            raise AlreadyExistsError(f'Conflict. The container name "/{name}" is already in use')
        self._image(str(config.get("Image") or ""))
        c = FakeContainer(secrets.token_hex(32), name, config)
        self.containers[c.id] = c
        return c.id

    async def start_container(self, engine_id: str) -> None:
        self._enter("start_container", engine_id)
        c = self._get(engine_id)
        if not c.running:
            c.running, c.pid, c.started_at = True, next(self._pids), time.time_ns()
            c.finished_at, c.exit_code, c.oom_killed = 0, 0, False

    async def stop_container(self, engine_id: str, timeout: int) -> None:
        self._enter("stop_container", engine_id)
        self._end(self._get(engine_id), 143 if timeout > 0 else 137)

    async def remove_container(self, engine_id: str, force: bool = False) -> None:
        self._enter("remove_container", engine_id)
        c = self._get(engine_id)
        if c.running and not force:
            raise FailedPreconditionError(f"cannot remove container {c.name}: it is running")
        self._end(c, 137)
        del self.containers[c.id]

    async def rename_container(self, engine_id: str, name: str) -> None:
        self._enter("rename_container", (engine_id, name))
        c = self._get(engine_id)
        if any(o.name == name and o is not c for o in self.containers.values()):
            raise AlreadyExistsError(f'Conflict. The container name "/{name}" is already in use')
        c.name = name

    async def inspect_container(self, engine_id: str) -> dict[str, Any]:
        self._enter("inspect_container", engine_id)
        return self._get(engine_id).inspect()

    async def list_containers(self, filters: dict[str, list[str]]) -> list[dict[str, Any]]:
        self._enter("list_containers", filters)
        rows = []
        for c in self.containers.values():
            labels = c.labels
            wanted = filters.get("label", [])
            if all(
                labels.get(k) == v if sep else k in labels for k, sep, v in (f.partition("=") for f in wanted)
            ):
                rows.append({"Id": c.id, "Names": ["/" + c.name], "Labels": labels})
        return rows

    async def update_container(self, engine_id: str, resources: dict[str, Any]) -> None:
        self._enter("update_container", engine_id)
        self._get(engine_id).config.setdefault("HostConfig", {}).update(
            {k: v for k, v in resources.items() if v}
        )

    async def resize_container(self, engine_id: str, height: int, width: int) -> None:
        self._enter("resize_container", engine_id)

    async def attach_container(self, engine_id: str, stdin: bool, stdout: bool, stderr: bool) -> FakeStream:
        self._enter("attach_container", engine_id)
        s = FakeStream()
        self._followers.setdefault(self._get(engine_id).id, []).append(s)
        return s

    async def container_logs(
        self, engine_id: str, follow: bool, timestamps: bool, since: str | None
    ) -> FakeStream:
        self._enter("container_logs", engine_id)
        c = self._get(engine_id)
        s = FakeStream()
        s.timestamps = timestamps  # type: ignore[attr-defined]
        start = 0
        if since is not None:
            secs, _, frac = since.partition(".")
            start = int(secs) * 1_000_000_000 + int((frac + "000000000")[:9])
        for at, stream, data in c.output:
            if at >= start:
                s.put((stream, self._stamp(at, data, s)))
        if follow and c.running:
            self._followers.setdefault(c.id, []).append(s)
        else:
            s.end()
        return s

    async def exec_create(self, engine_id: str, cmd: list[str], stdin: bool, tty: bool, stderr: bool) -> str:
        self._enter("exec_create", cmd)
        if not self._get(engine_id).running:
            raise FailedPreconditionError(f"container {engine_id} is not running")
        return "exec-" + secrets.token_hex(8)

    async def exec_start(self, exec_id: str, tty: bool) -> FakeStream:
        self._enter("exec_start", exec_id)
        s = FakeStream()
        s.put(("stdout", b"ok\n"))
        s.end()
        return s

    async def exec_inspect(self, exec_id: str) -> dict[str, Any]:
        self._enter("exec_inspect", exec_id)
        return {"Running": False, "ExitCode": 0, "Pid": 0}

    async def exec_resize(self, exec_id: str, height: int, width: int) -> None:
        self._enter("exec_resize", exec_id)

    async def image_inspect(self, ref: str) -> dict[str, Any]:
        self._enter("image_inspect", ref)
        info = self._image(ref)
        return info | {"RepoTags": list(info["RepoTags"]), "RepoDigests": list(info["RepoDigests"])}

    async def image_list(self) -> list[dict[str, Any]]:
        self._enter("image_list")
        rows = []
        # The engine's order: the newest first, and images of the same second in an order
        # that changes from call to call (dockerd sorts them out of a Go map).
        shuffled = list(self.images.values())
        random.shuffle(shuffled)
        for info in sorted(shuffled, key=lambda i: -_seconds(i["Created"])):
            tags, digests = list(info["RepoTags"]), list(info["RepoDigests"])
            if not tags and not digests:
                tags, digests = ["<none>:<none>"], ["<none>@<none>"]
            row = {"Id": info["Id"], "RepoTags": tags or None, "RepoDigests": digests or None}
            rows.append(row | {"Created": _seconds(info["Created"]), "Size": info["Size"]})
        gate = self.gates.get("image_list")
        if gate is not None:
            await gate.wait()
        return rows

    async def image_pull(
        self, image: str, tag: str, auth: str | None, answer_timeout: float | None
    ) -> FakeStream:
        ref = f"{image}:{tag}" if tag else image
        self._enter("image_pull", ref)
        s = FakeStream()
        try:
            self._image(ref)
            self._emit_image("pull", ref, ref)  # up to date: announced all the same
        except NotFoundError:
            self.add_image(ref)
        s.put(b'{"status":"Pull complete"}\n')
        s.end()
        return s

    async def image_remove(self, image_id: str, force: bool = True) -> None:
        self._enter("image_remove", image_id)
        self._delete(self._image(image_id)["Id"])

    async def run(self, fn: Callable[[], T]) -> T:
        return fn()

    async def close(self) -> None:
        for w in self._watchers:
            w.close()


def _conforms(engine: FakeEngine) -> EngineAPI:
    return engine  # mypy proves the fake implements the whole protocol
