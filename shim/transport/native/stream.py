"""One HTTP/2 request stream's state: what the peer sent, what the answer still waits to send, its call."""

from __future__ import annotations

import asyncio
from collections import deque

from shim.transport.native.frames import Chunk


class Stream:
    """One request stream: what the peer sent, what the answer still waits to send, the call on it."""

    __slots__ = (
        "body",
        "deadline",
        "drained",
        "ended",
        "headers_sent",
        "method",
        "outq",
        "received",
        "sid",
        "task",
        "timed_out",
        "timer",
        "trailers",
        "unacked",
        "window",
    )

    def __init__(self, sid: int, method: str, window: int) -> None:
        self.sid = sid
        self.method = method
        self.window = window  # what we may still send on it
        self.body = bytearray()
        self.received = 0
        self.unacked = 0
        self.ended = False  # the peer's half is closed
        self.headers_sent = False
        self.outq: deque[Chunk] = deque()  # DATA payloads waiting for window
        self.trailers: bytes | None = None  # sent once outq is empty
        self.drained: asyncio.Event | None = None
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.deadline = 0.0
        self.timed_out = False
