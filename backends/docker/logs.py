"""A container's process as the shim follows it: the engine's log stream, and the exit."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from backends.contract import ExitInfo, ExitLatch, LogMarks, Output
from backends.contract.errors import CriError, NotFoundError

from .context import Shared
from .engine_api import engine_time, parse_time
from .state import ContainerState, LogFollow

_READS_AFTER_EXIT = 3  # refused log reads after the exit before the output is taken as ended
_RESUME_OVERLAP_NS = 2_000_000_000  # a resumed log read goes back this far (see DockerProcess.output)


class DockerProcess:
    """One running container's output (read from the engine's log) and its exit.

    The exit is set by the event watcher (an exit nobody asked for) or by a
    stop; setting it cuts the followed log stream short (:meth:`exited`).
    The output is sure to end after the exit (the last read does not follow).
    """

    output_ends = True

    def __init__(self, shared: Shared, st: ContainerState, tty: bool, after: LogMarks | None) -> None:
        self._shared = shared
        self._st = st
        self._tty = tty
        self._after = after
        self.exit = ExitLatch()

    def exited(self, info: ExitInfo) -> None:
        """How the container ended; its output is cut short (:meth:`stopped`)."""
        self.stopped()
        self.exit.set(info)

    def stopped(self) -> None:
        """The container has stopped: its output is complete on the engine's side.

        The engine ends a followed log stream some milliseconds after the
        container has stopped; rather than wait for that, the followed stream
        is cut and the rest is read without following (see :meth:`output`).
        With a TTY the records carry no time to resume from: the stream is
        left to end by itself.
        """
        follow = self._st.follow
        if follow is not None and not follow.tty:
            follow.finishing = True
            if follow.resp is not None:
                follow.resp.close()

    async def output(self) -> AsyncIterator[Output]:
        """The container's output until it has exited; resumed where a broken stream left off.

        A resumed read skips what was read already (:class:`LogResume`).
        Records are stamped with the engine's time (without a TTY), so that
        after a restart the CRI log itself says where to resume (``after``).
        With a TTY the log is one stream of bytes with no times: while every
        read began at its start, the last read (after the end) begins there
        too and skips the bytes already written.
        """
        st, tty, engine = self._st, self._tty, self._shared.engine
        resume = LogResume(self._after)
        follow = LogFollow(tty=tty, finishing=self.exit.info is not None and not tty)  # ended already
        st.follow = follow
        failed = 0  # reads refused since the exit
        whole = tty and resume.newest is None  # TTY: every read so far from the log's start
        written = 0  # TTY: bytes yielded, counted from the log's start
        try:
            while True:
                final = follow.finishing
                since = resume.since(tty)
                try:
                    resp = await engine.container_logs(
                        st.engine_id,
                        follow=not final,
                        timestamps=not tty,
                        since=None if since is None else engine_time(since),
                    )
                except NotFoundError:
                    return
                except CriError:
                    if self.exit.info is not None:
                        failed += 1
                        if failed >= _READS_AFTER_EXIT:
                            return  # the engine will not serve the rest: the exit is not held up
                    await asyncio.sleep(1)
                    continue
                follow.resp = None if final else resp
                resume.reread()
                # A TTY read from the log's start: the bytes written already come again.
                skip = written if tty and since is None else 0
                try:
                    async for stream, data in resp.frames(tty):
                        at = 0
                        if tty:
                            if skip:
                                if len(data) <= skip:
                                    skip -= len(data)
                                    continue
                                data, skip = data[skip:], 0
                            written += len(data)
                        else:
                            # "RFC3339Nano content"
                            stamp, _, data = data.partition(b" ")
                            try:
                                at = parse_time(stamp.decode())
                            except (ValueError, UnicodeDecodeError):
                                at = 0
                            if not resume.fresh(stream, at):
                                continue
                        yield Output(stream, data, at)
                finally:
                    follow.resp = None
                    resp.close()
                if final:
                    return
                if follow.finishing:
                    continue  # cut by exited(): the rest, without following
                if self.exit.info is not None:
                    if whole:
                        follow.finishing = True  # a TTY's last line may land after the end
                        continue
                    return  # the stream ended because the container did
                try:
                    info = await engine.inspect_container(st.engine_id)
                except NotFoundError:
                    return
                except CriError:
                    await asyncio.sleep(1)
                    continue
                if not info["State"].get("Running"):
                    if tty and not whole:
                        return  # read from a time on: where its bytes began is not known
                    # The engine ends a followed stream when the process ends, before a last
                    # unterminated line is in its log (seen: 30 of 80 quick exits); a read
                    # that does not follow, now, has it.
                    follow.finishing = True
                    continue
                if tty:
                    resume.newest = time.time_ns()
                    whole = False
        finally:
            if st.follow is follow:
                st.follow = None


class LogResume:
    """Which records of the engine's log a log pump has written, so that a re-read skips them.

    A re-read starts a little before the newest record written, because the
    engine's stdout and stderr copiers write to its log concurrently: a
    record may follow one of the other stream that is newer. Within one
    stream the times never go back (the pieces of a long line share one), so
    what a re-read repeats is known per stream: the records older than the
    last one written, and as many records of that very time as were written.
    """

    def __init__(self, marks: LogMarks | None = None) -> None:
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
