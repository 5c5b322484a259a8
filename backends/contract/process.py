"""A started container as the shim sees it: its output, and how it ended.

A backend's ``start_container`` (and ``reattach`` after a restart) hands the
shim a :class:`ContainerProcess`. The shim alone turns it into CRI facts: it
copies the output into the CRI log, and when the process has ended it waits
(a bounded time) for the output to be complete before it reports the exit,
once. A backend never writes a log file and never decides when an exit is
seen; it only says what the container wrote and how it ended.

:class:`ExitLatch` and :class:`ProcessPipe` are the two pieces a backend
needs to build one: the first for an exit set once by whichever path learns
it first (the runtime's event, a stop, a crash), the second for output that
arrives by push (an agent stream, a timer) rather than by a read loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from backends.contract.values import ExitInfo

STREAMS = ("stdout", "stderr")

# Per stream: (time of the last record in the CRI log, records written at that time).
LogMarks = dict[str, tuple[int, int]]


@dataclasses.dataclass(frozen=True, slots=True)
class Output:
    """Bytes a container wrote on one stream; ``at``: when (ns since the epoch), 0 if unknown."""

    stream: str  # "stdout" or "stderr"; under a TTY everything is "stdout"
    data: bytes
    at: int = 0


class ExitLatch:
    """The one exit of a container: the first ``set`` wins; waiters and callbacks get it.

    Callbacks run on the event loop after ``set`` returns (never inside it),
    so whoever sets the exit finishes its own bookkeeping first.
    """

    __slots__ = ("_callbacks", "_event", "info")

    def __init__(self) -> None:
        # Made when first needed: a fake node holds tens of thousands of these.
        self._event: asyncio.Event | None = None
        self._callbacks: list[Callable[[ExitInfo], None]] | None = None
        self.info: ExitInfo | None = None

    def set(self, info: ExitInfo) -> bool:
        """Record the exit; False (and nothing changes) when one was recorded already."""
        if self.info is not None:
            return False
        self.info = info
        if self._event is not None:
            self._event.set()
        callbacks, self._callbacks = self._callbacks, None
        if callbacks:
            loop = asyncio.get_running_loop()
            for cb in callbacks:
                loop.call_soon(cb, info)
        return True

    def on_set(self, callback: Callable[[ExitInfo], None]) -> None:
        """Call ``callback(info)`` once the exit is known (soon, if it is already)."""
        if self.info is not None:
            asyncio.get_running_loop().call_soon(callback, self.info)
        elif self._callbacks is None:
            self._callbacks = [callback]
        else:
            self._callbacks.append(callback)

    async def wait(self) -> ExitInfo:
        if self.info is None:
            if self._event is None:
                self._event = asyncio.Event()
            await self._event.wait()
        assert self.info is not None
        return self.info


class ContainerProcess(Protocol):
    """A running container's output stream and its end."""

    @property
    def exit(self) -> ExitLatch:
        """Set once with how the container ended, however that happened: on its own,
        stopped, killed with its pod or its VM."""

    def output(self) -> AsyncIterator[Output]:
        """What the container writes, from its start (or, re-attached, after ``LogMarks``).

        Iterated once, by the shim. It ends when the container's output is
        complete, which is after its exit; the shim stops waiting for that a
        bounded time after the exit is set: once nothing has come for a while
        (``DRAIN_WAIT``), unless the process says its output is sure to end
        (``output_ends``, below), and after ``DRAIN_MAX`` in any case.
        """


def output_ends(process: object) -> bool:
    """Whether a process's output is sure to end on its own soon after its exit (a class
    attribute ``output_ends = True``: a runtime's read that it closes when the output is all
    out, such as an engine's log read). The shim then waits for that end, however long the
    runtime is silent before it under load, rather than taking silence for the end."""
    return bool(getattr(process, "output_ends", False))


class ProcessPipe:
    r"""A :class:`ContainerProcess` whose output is pushed to it by the backend.

    ``put`` never blocks: a backend's reader is never held up by a slow log
    disk. ``end`` closes the output; ``exit`` records the end of the process
    (it does not end the output: a backend that knows both ends calls both).

    A consumer either iterates ``output`` or, with no task of its own,
    ``connect``\ s callbacks that ``put`` and ``end`` call directly (what the
    shim does: a container that writes nothing costs no task).
    """

    __slots__ = ("_ended", "_on_end", "_on_output", "_pending", "_queue", "exit")

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Output | None] | None = None
        self._pending: list[Output] | None = None  # what came before a consumer (made when needed)
        self._ended = False
        self._on_output: Callable[[Output], None] | None = None
        self._on_end: Callable[[], None] | None = None
        self.exit = ExitLatch()

    def put(self, stream: str, data: bytes, at: int = 0) -> None:
        if self._ended or not data:
            return
        out = Output(stream, data, at)
        if self._on_output is not None:
            self._on_output(out)
        elif self._queue is not None:
            self._queue.put_nowait(out)
        elif self._pending is None:
            self._pending = [out]
        else:
            self._pending.append(out)

    def end(self) -> None:
        """No more output; idempotent."""
        if self._ended:
            return
        self._ended = True
        if self._on_end is not None:
            self._on_end()
        elif self._queue is not None:
            self._queue.put_nowait(None)

    @property
    def ended(self) -> bool:
        return self._ended

    def connect(self, on_output: Callable[[Output], None], on_end: Callable[[], None]) -> None:
        """Deliver the output by calls: what came already at once, the rest as it comes."""
        pending, self._pending = self._pending or [], None
        for out in pending:
            on_output(out)
        if self._ended:
            on_end()
            return
        self._on_output, self._on_end = on_output, on_end

    def disconnect(self) -> None:
        """The consumer is gone: later output is dropped."""
        self._on_output = self._on_end = None
        self._ended = True

    async def output(self) -> AsyncIterator[Output]:
        queue = self._queue = asyncio.Queue()
        pending, self._pending = self._pending or [], None
        for out in pending:
            yield out
        if self._ended and queue.empty():
            return
        while True:
            item = await queue.get()
            if item is None:
                return
            yield item


@dataclasses.dataclass(frozen=True, slots=True)
class Started:
    """What ``start_container`` returns: when the container started (ns) and its process."""

    started_at: int
    process: ContainerProcess
