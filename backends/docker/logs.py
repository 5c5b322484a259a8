"""Container output into the CRI log: the log pump, and where a restarted pump resumes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

from backends.contract import LogSink
from backends.contract.errors import CriError, NotFoundError

from .context import Shared, engine_time, parse_time
from .state import ContainerState, LogFollow

# s at most for a follower to write the last output before an exit is reported: the engine
# serves a burst of 40,000 lines in over 2 s on a slow node, and a short output takes ms.
_LOG_DRAIN_WAIT = 10.0
_RESUME_OVERLAP_NS = 2_000_000_000  # a resumed log read goes back this far (see LogPump._pump)
Marks = dict[str, tuple[int, int]]  # per stream: time of the last record written, records at that time


class LogPump:
    """One output pump per running container, kept in its :class:`ContainerState`."""

    def __init__(self, shared: Shared) -> None:
        self._shared = shared

    def follow(self, st: ContainerState, tty: bool, sink: LogSink, marks: Marks | None) -> None:
        old = st.follower
        if old is not None:
            old.cancel()
        st.follower = asyncio.create_task(self._pump(st, tty, sink, marks))

    async def _pump(self, st: ContainerState, tty: bool, sink: LogSink, marks: Marks | None) -> None:
        """Copy the container's output into its sink until it exits; resume if the stream breaks.

        The engine ends a followed log stream some milliseconds after the
        container has stopped. When the container is known to have stopped,
        :meth:`drain` cuts the followed stream and the rest is read
        without following: by then the engine has written all of the output.

        A resumed read skips what was written already (:class:`LogResume`).
        Records are stamped with the engine's time (without a TTY), so that
        after a restart the log itself says where to resume (``marks``).
        """
        resume = LogResume(marks)
        follow = LogFollow(tty=tty)
        st.follow = follow
        try:
            while True:
                final = follow.finishing
                since = resume.since(tty)
                try:
                    resp = await self._shared.engine.container_logs(
                        st.engine_id,
                        follow=not final,
                        timestamps=not tty,
                        since=None if since is None else engine_time(since),
                    )
                except NotFoundError:
                    return
                except CriError:
                    await asyncio.sleep(1)
                    continue
                follow.resp = None if final else resp
                resume.reread()
                try:
                    async for stream, data in resp.frames(tty):
                        at = 0
                        if not tty:
                            # "RFC3339Nano content"
                            stamp, _, data = data.partition(b" ")
                            try:
                                at = parse_time(stamp.decode())
                            except (ValueError, UnicodeDecodeError):
                                at = 0
                            if not resume.fresh(stream, at):
                                continue
                        sink.write(stream, data, at)
                finally:
                    follow.resp = None
                    resp.close()
                if final:
                    return
                if follow.finishing:
                    continue  # cut by _drain_logs: the rest, without following
                if st.stopping:
                    return  # stopped by us: the stream ended because the container did
                try:
                    info = await self._shared.engine.inspect_container(st.engine_id)
                except NotFoundError:
                    return
                except CriError:
                    await asyncio.sleep(1)
                    continue
                if not info["State"].get("Running"):
                    return
                if tty:
                    resume.newest = time.time_ns()
        finally:
            if st.follow is follow:
                st.follow = None
            with contextlib.suppress(Exception):
                sink.close()

    async def drain(self, st: ContainerState, stopped: bool) -> None:
        """Wait (a bounded time) until the container's output is all in its log.

        ``stopped``: the engine reports the container not running, so its
        output is complete on the engine's side and the followed stream can be
        cut short (see :meth:`_pump`).
        """
        f = st.follower
        if f is None:
            return
        follow = st.follow
        # With a TTY the records carry no time to resume from: wait for the end.
        if stopped and follow is not None and not follow.tty:
            follow.finishing = True
            if follow.resp is not None:
                follow.resp.close()
        with contextlib.suppress(TimeoutError, asyncio.CancelledError, Exception):
            async with asyncio.timeout(_LOG_DRAIN_WAIT):
                await asyncio.shield(f)


class LogResume:
    """Which records of the engine's log a log pump has written, so that a re-read skips them.

    A re-read starts a little before the newest record written, because the
    engine's stdout and stderr copiers write to its log concurrently: a
    record may follow one of the other stream that is newer. Within one
    stream the times never go back (the pieces of a long line share one), so
    what a re-read repeats is known per stream: the records older than the
    last one written, and as many records of that very time as were written.
    """

    def __init__(self, marks: Marks | None = None) -> None:
        marks = marks or {}
        # Per stream: [time of the last record written, records written at that time].
        self.marks = {name: list(marks.get(name, (0, 0))) for name in ("stdout", "stderr")}
        self.newest: int | None = max((at for at, _n in marks.values()), default=None)
        self._repeats = {name: 0 for name in self.marks}

    def since(self, tty: bool) -> int | None:
        """Where a (re)read starts; None: from the beginning."""
        if self.newest is None:
            return None
        # With a TTY the records carry no time: from just after the newest.
        return self.newest + 1 if tty else max(0, self.newest - _RESUME_OVERLAP_NS)

    def reread(self) -> None:
        """A read starts over: the records at each stream's mark come again."""
        self._repeats = {name: n for name, (_at, n) in self.marks.items()}

    def fresh(self, stream: str, at: int) -> bool:
        """Whether a record of ``stream`` at ``at`` (0: unknown) is new, and if so, count it."""
        if not at:
            return True
        mark = self.marks[stream]
        if at < mark[0]:
            return False
        if at == mark[0]:
            if self._repeats[stream] > 0:
                self._repeats[stream] -= 1
                return False
            mark[1] += 1
            return True
        mark[0], mark[1] = at, 1
        self._repeats[stream] = 0
        self.newest = max(self.newest or 0, at)
        return True


def last_log_marks(path: str) -> Marks | None:
    """Where a CRI log file ends, per stream: (time of its last record, records at that time).

    Read from the last 64 KiB. A stream with no record there gets the time
    of the first record read and a count of 0: it wrote nothing since.
    None without any record.
    """
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536))
            tail = f.read()
    except OSError:
        return None
    marks: dict[str, tuple[int, int]] = {}
    done: set[str] = set()
    first = 0
    for line in reversed(tail.splitlines()):
        parts = line.split(b" ", 2)
        if len(parts) < 2:
            continue
        try:
            at = parse_time(parts[0].decode())
            stream = parts[1].decode()
        except (ValueError, UnicodeDecodeError):
            continue
        if stream not in ("stdout", "stderr"):
            continue
        first = at
        if stream in done:
            continue
        mark = marks.get(stream)
        if mark is None:
            marks[stream] = (at, 1)
        elif mark[0] == at:
            marks[stream] = (at, mark[1] + 1)
        else:
            done.add(stream)
    if not marks:
        return None
    for stream in ("stdout", "stderr"):
        marks.setdefault(stream, (first, 0))
    return marks
