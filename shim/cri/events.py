"""GetContainerEvents: every event goes to every subscriber.

Each subscriber has its own bounded queue. Publishing never waits: when a
subscriber's queue is full, the oldest events are dropped for that one
subscriber (and counted), so a slow reader can neither block the RPCs that
publish nor the other readers. The kubelet's evented PLEG relists when it
misses events, so dropping is safe; blocking is not.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import structlog

from cri_api import api_pb2 as pb

log = structlog.get_logger("events")

QUEUE_SIZE = 1024


class Subscriber:
    def __init__(self, size: int) -> None:
        self.queue: asyncio.Queue[pb.ContainerEventResponse] = asyncio.Queue(size)
        self.dropped = 0


class EventHub:
    def __init__(self, queue_size: int = QUEUE_SIZE) -> None:
        self._subscribers: set[Subscriber] = set()
        self._queue_size = queue_size

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    def publish(self, event: pb.ContainerEventResponse) -> None:
        for sub in self._subscribers:
            q = sub.queue
            if q.full():
                q.get_nowait()
                sub.dropped += 1
                if sub.dropped == 1 or sub.dropped % 1000 == 0:
                    log.warning("events.subscriber_slow", dropped=sub.dropped)
            q.put_nowait(event)

    async def subscribe(self) -> AsyncIterator[pb.ContainerEventResponse]:
        sub = Subscriber(self._queue_size)
        self._subscribers.add(sub)
        try:
            while True:
                yield await sub.queue.get()
        finally:
            self._subscribers.discard(sub)
