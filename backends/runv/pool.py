"""Warm VMs: a bounded pool of booted VMs whose agents answer, handed out on RunPodSandbox.

Booting a VM and its agent does not depend on the pod, so it can be done before
the pod is asked for (Kata calls this a VM factory). The pool keeps up to
``size`` VMs of one shape ready; RunPodSandbox takes one when the pod's sizing
is at least that shape (the backend hot-plugs the rest) and boots cold
otherwise, or when the pool is empty: it never waits for a refill.

Refilling boots one VM at a time, ``refill_interval`` apart, and pauses while
the node is busy: while a RunPodSandbox is in progress, or while the host's
CPUs were busier than ``max_cpu`` (a fraction of all of them, measured since
the previous look, a moment ago; 0: never pauses for CPU). A pool VM
belongs to no pod: no CRI list shows it, it counts against the hypervisor's
capacity like any VM (a cold boot that finds no room gives one back first), and
after a SIGKILL of the shim its ID is in no record, so the next start removes it
with the other leftovers.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

import structlog

from backends.contract.errors import ResourceExhaustedError
from backends.runv.config import POOL

log = structlog.get_logger("runv.pool")

T = TypeVar("T")

RETRY_MAX = 30.0  # seconds: the longest wait after boots that keep failing


@dataclasses.dataclass(frozen=True, slots=True)
class PoolConfig:
    size: int = 0  # VMs kept ready; 0: no pool
    vcpus: int = 0  # 0: the size of a pod without limits
    memory_mib: int = 0  # 0: the size of a pod without limits
    refill_interval: float = 0.05  # seconds between two boots of a refill
    max_cpu: float = 0.8  # share of all CPUs busy above which refilling pauses; 0: ignore the CPU

    @classmethod
    def from_table(cls, table: dict[str, Any] | None) -> PoolConfig:
        table = dict(table or {})
        unknown = set(table) - set(POOL)
        if unknown:  # config.check_config refuses these first; a direct caller gets the same
            raise ValueError(f"unknown pool keys {sorted(unknown)}")
        return cls(**table)


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
    ) -> None:
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
        self._task = asyncio.get_running_loop().create_task(self._refill(), name="runv-pool-refill")
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
            log.warning("pool.vm_lost", note="a ready VM died before it was handed out")
            self._spawn_discard(item)
        self._wanted.set()
        return None

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
                        log.info("pool.no_room", error=why, retry_in=wait)
                    else:
                        log.warning("pool.boot_failed", error=why, retry_in=wait)
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
