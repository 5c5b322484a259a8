"""Warm items: a bounded pool of things made before they are asked for, handed out at once.

Some of what starting a pod costs does not depend on the pod: booting a VM and
its agent (runv), creating and starting a pause container whose settings the
pod does not change (docker). A backend can do that ahead of time. ``Pool``
keeps up to ``size`` ready items; ``take`` hands one out at once or says there
is none: a pod never waits for a refill, it starts cold.

Refilling makes one item at a time, ``refill_interval`` apart, and pauses
while ``busy()`` says the node is busy (each backend asks: a RunPodSandbox in
progress, the host's CPUs above a share measured by ``CpuMeter``). Items are
released with ``discard``; ``usable`` tells whether a ready one still is (an
item that died in the pool is discarded, not handed out). What the items are,
and how they become a pod, is the backend's.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

import structlog

from backends.contract.errors import ResourceExhaustedError

log = structlog.get_logger("pool")

T = TypeVar("T")

RETRY_MAX = 30.0  # seconds: the longest wait after makes that keep failing


@dataclasses.dataclass(frozen=True, slots=True)
class PoolFigures:
    """What a pool holds and has done, for the metrics."""

    size: int  # items it keeps ready
    ready: int  # items ready now
    handed_out: int  # items pods took since the start


class Pool(Generic[T]):
    """Ready items made by ``boot``, released by ``discard``; ``usable`` says whether one still is."""

    def __init__(
        self,
        size: int,
        boot: Callable[[], Awaitable[T]],
        discard: Callable[[T], Coroutine[Any, Any, None]],
        usable: Callable[[T], bool],
        busy: Callable[[], bool],
        refill_interval: float = 0.05,
        name: str = "pool",
    ) -> None:
        self.name = name
        self.size = size
        self._boot = boot
        self._discard = discard
        self._usable = usable
        self._busy = busy
        self.refill_interval = refill_interval
        self.ready: collections.deque[T] = collections.deque()
        self.booting = 0
        self.handed_out = 0
        self.boot_failures = 0
        self._wanted = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def start(self) -> None:
        if self.size <= 0 or self._task is not None:
            return
        self._task = asyncio.get_running_loop().create_task(self._refill(), name=f"{self.name}-pool-refill")
        self._wanted.set()

    def take(self) -> T | None:
        """A ready item, at once, or None; the refill is told to make up for it."""
        self.start()
        while self.ready:
            item = self.ready.popleft()
            if self._usable(item):
                self.handed_out += 1
                self._wanted.set()
                return item
            log.warning("pool.item_lost", pool=self.name, note="a ready item died before it was handed out")
            self._spawn_discard(item)
        self._wanted.set()
        return None

    def figures(self) -> PoolFigures:
        return PoolFigures(self.size, len(self.ready), self.handed_out)

    def flush(self) -> None:
        """Discard every ready item (pods no longer ask for what they are); the refill makes new ones."""
        while self.ready:
            self._spawn_discard(self.ready.popleft())
        self._wanted.set()

    async def give_back_one(self) -> bool:
        """Release one ready item (a cold boot needs its room); whether there was one."""
        if not self.ready:
            return False
        await self._discard(self.ready.pop())
        return True

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        while self.ready:
            await self._discard(self.ready.popleft())

    def _spawn_discard(self, item: T) -> None:
        task = asyncio.get_running_loop().create_task(self._discard(item))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _refill(self) -> None:
        while not self._closed:
            await self._wanted.wait()
            self._wanted.clear()
            while not self._closed and len(self.ready) + self.booting < self.size:
                if self._busy():
                    await asyncio.sleep(max(self.refill_interval, 0.05))
                    continue
                self.booting += 1
                try:
                    item = await self._boot()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self.boot_failures += 1
                    wait = min(RETRY_MAX, 0.5 * 2 ** min(self.boot_failures, 8))
                    why = str(exc) or type(exc).__name__
                    if isinstance(exc, ResourceExhaustedError):  # pods use the node: fine
                        log.info("pool.no_room", pool=self.name, error=why, retry_in=wait)
                    else:
                        log.warning("pool.boot_failed", pool=self.name, error=why, retry_in=wait)
                    await asyncio.sleep(wait)
                    continue
                finally:
                    self.booting -= 1
                self.boot_failures = 0
                if self._closed:
                    await self._discard(item)
                    return
                self.ready.append(item)
                await asyncio.sleep(self.refill_interval)


class CpuMeter:
    """How busy the host's CPUs were since the previous look (/proc/stat)."""

    def __init__(self) -> None:
        self._last: tuple[int, int] | None = None
        self._busy = 0.0

    @staticmethod
    def _read() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as fh:
                fields = [int(v) for v in fh.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return idle, sum(fields)

    def over(self, limit: float) -> bool:
        """Whether the CPUs were busier than ``limit`` (a share of all); never when ``limit`` is 0.
        The refill rule of every pool: it also waits while any RunPodSandbox is in progress."""
        return limit > 0 and self.busy() > limit

    def busy(self) -> float:
        """The busy share of all CPUs since the previous call (0.0 on the first)."""
        now = self._read()
        if now is None:
            return 0.0
        if self._last is not None:
            d_idle, d_total = now[0] - self._last[0], now[1] - self._last[1]
            if d_total < 5:  # under a few ticks: too short to tell, keep the last verdict
                return self._busy
            self._busy = 1.0 - d_idle / d_total
        self._last = now
        return self._busy
