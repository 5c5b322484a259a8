"""The Docker Engine operations the backend uses, as one typed protocol.

Two implementations: :class:`.engine.EngineClient` (HTTP on the event loop,
kept-alive connections, deadlines, errors mapped to CRI conditions) and
:class:`.fake_engine.FakeEngine` (in memory, recording, scripted failures),
so that the backend's logic is tested without a dockerd and the real-engine
tests prove the fake honest.

Every method raises the conditions of :mod:`backends.contract.errors`
(NotFoundError for a missing object, UnavailableError for an engine that
cannot be reached, ...), never a transport error. The engine's times are read
and written here too (``parse_time``, ``engine_time``).
"""

from __future__ import annotations

import calendar
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


def engine_time(ns: int) -> str:
    """A time (ns since the epoch) as the engine's ``since`` parameter takes it, exactly.

    A float of seconds keeps only about a quarter of a microsecond: resuming a
    log at such a time repeats or skips lines written within it.
    """
    return f"{ns // 1_000_000_000}.{ns % 1_000_000_000:09d}"


def parse_time(value: str | None) -> int:
    """Engine RFC 3339 time (nanosecond precision, UTC) -> ns since the epoch; 0 for the zero time."""
    if not value or value.startswith("0001-"):
        return 0
    value = value.rstrip("Z")
    for sign in ("+", "-"):
        idx = value.rfind(sign)
        if idx > 10:
            value = value[:idx]  # the engine reports UTC; a "+00:00" suffix carries nothing
    main, _, frac = value.partition(".")
    secs = calendar.timegm(time.strptime(main, "%Y-%m-%dT%H:%M:%S"))
    return secs * 1_000_000_000 + int((frac + "000000000")[:9] or 0)


class EngineStream(Protocol):
    """An open engine response read as it comes: logs, events, pull progress, a hijacked exec/attach."""

    def frames(self, tty: bool) -> AsyncIterator[tuple[str, bytes]]:
        """(stream name, bytes) pieces of a container's output: raw with a TTY, else 8-byte framed."""

    async def read_line(self) -> bytes:
        """One line (with its newline), or what is left; b"" at the end."""

    def json_lines(self) -> AsyncIterator[dict[str, Any]]:
        """The stream's JSON objects, one a line (events)."""

    async def send(self, data: bytes) -> None:
        """Write to the process's stdin (a hijacked exec/attach)."""

    def close_input(self) -> None:
        """Half-close: the process sees end of input; its output still flows back."""

    def close(self) -> None: ...


class EngineAPI(Protocol):
    """One method per engine operation of the backend."""

    call_timeout: float

    # ---- the engine
    async def ping(self, deadline: float | None = None) -> None: ...

    async def info(self, deadline: float | None = None) -> dict[str, Any]: ...

    async def df(self) -> dict[str, Any]: ...

    async def events(self, filters: dict[str, list[str]], since: str | None) -> EngineStream:
        """The event stream from ``since`` (engine time, see ``engine_time``), following."""

    # ---- containers
    async def create_container(self, name: str, config: dict[str, Any]) -> str:
        """Create and return the engine ID; AlreadyExistsError when the name is taken."""

    async def start_container(self, engine_id: str) -> None:
        """Start (success when it runs already)."""

    async def stop_container(self, engine_id: str, timeout: int) -> None:
        """TERM, ``timeout`` seconds, then KILL (success when it is stopped already)."""

    async def remove_container(self, engine_id: str, force: bool = False) -> None:
        """Remove with its anonymous volumes; without ``force`` a running one is refused (409)."""

    async def rename_container(self, engine_id: str, name: str) -> None:
        """Give it another name; AlreadyExistsError when the name is taken."""

    async def inspect_container(self, engine_id: str) -> dict[str, Any]: ...

    async def list_containers(self, filters: dict[str, list[str]]) -> list[dict[str, Any]]:
        """All containers (running or not) matching the engine filters."""

    async def update_container(self, engine_id: str, resources: dict[str, Any]) -> None:
        """New limits (the HostConfig keys of ``convert.resources``; empty values left alone)."""

    async def resize_container(self, engine_id: str, height: int, width: int) -> None: ...

    async def attach_container(self, engine_id: str, stdin: bool, stdout: bool, stderr: bool) -> EngineStream:
        """A hijacked connection to the running process's streams."""

    async def container_logs(
        self, engine_id: str, follow: bool, timestamps: bool, since: str | None
    ) -> EngineStream: ...

    # ---- exec
    async def exec_create(
        self, engine_id: str, cmd: list[str], stdin: bool, tty: bool, stderr: bool
    ) -> str: ...

    async def exec_start(self, exec_id: str, tty: bool) -> EngineStream: ...

    async def exec_inspect(self, exec_id: str) -> dict[str, Any]: ...

    async def exec_resize(self, exec_id: str, height: int, width: int) -> None: ...

    # ---- images
    async def image_inspect(self, ref: str) -> dict[str, Any]: ...

    async def image_list(self) -> list[dict[str, Any]]: ...

    async def image_pull(
        self, image: str, tag: str, auth: str | None, answer_timeout: float | None
    ) -> EngineStream:
        """The pull's progress stream (JSON lines); ``auth`` is the X-Registry-Auth value."""

    async def image_remove(self, image_id: str, force: bool = True) -> None: ...

    # ---- the worker pool for blocking host work (files, cgroups, /proc)
    async def run(self, fn: Callable[[], T]) -> T: ...

    async def close(self) -> None: ...
