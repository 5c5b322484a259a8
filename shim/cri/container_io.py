"""Container IO: every container's output into its CRI log, and its exit reported once, after the drain.

A backend hands the shim a :class:`~backends.contract.ContainerProcess` for
each container it starts (or finds running after a restart). :class:`ContainerIO`
copies that process's output into the container's CRI log file, and when the
process has ended it waits, a bounded time, until the output is all written
before the exit is reported: a client that sees EXITED and reads the log
finds everything. A stop on request waits for the same drain. This is the one
place that knows this for every backend.

Each record is one line: ``RFC3339Nano-timestamp STREAM TAG content``, where
STREAM is ``stdout`` or ``stderr`` and TAG is ``F`` for a full line or ``P``
for a partial one (a line longer than the record limit, or output that ended
without a newline). The kubelet and ``crictl logs`` parse exactly this.
"""

from __future__ import annotations

import asyncio
import calendar
import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

import structlog

from backends.contract import ContainerProcess, ExitInfo, LogMarks, Output, ProcessPipe
from backends.contract.process import output_ends

log = structlog.get_logger("io")

MAX_RECORD = 16 * 1024  # content bytes per record before a line is split
# After a process's end, its exit is reported once its output has ended, or when no more of it
# has arrived for DRAIN_WAIT s (not for a process whose output is sure to end: under load an
# engine may answer the read of a container's last lines seconds after its exit), or after
# DRAIN_MAX s in all: the engine serves a flood of 200,000 lines in over 10 s on a slow node,
# steadily; a short output takes milliseconds.
DRAIN_WAIT = 3.0
DRAIN_MAX = 120.0

_STREAMS = {"stdout": b"stdout", "stderr": b"stderr"}


def rfc3339_nano(ns: int) -> bytes:
    secs, frac = divmod(ns, 1_000_000_000)
    base = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs))
    return f"{base}.{frac:09d}Z".encode()


def parse_rfc3339_nano(value: bytes) -> int:
    """The time of a record as :func:`rfc3339_nano` wrote it; ValueError otherwise."""
    text = value.decode("ascii").removesuffix("Z")
    main, _, frac = text.partition(".")
    if not frac.isdigit() or len(frac) > 9:
        raise ValueError(f"not a record time: {value!r}")
    secs = calendar.timegm(time.strptime(main, "%Y-%m-%dT%H:%M:%S"))
    return secs * 1_000_000_000 + int(frac.ljust(9, "0"))


class CriLogWriter:
    """Writes one container's output to its CRI log file.

    Thread-safe: backends may feed it from a worker thread. ``reopen`` closes
    the file and opens the path again, so a rotated file (renamed by the
    kubelet) is replaced by a fresh one.
    """

    def __init__(self, path: str, clock_ns: object = None) -> None:
        self.path = path
        self._clock = clock_ns if callable(clock_ns) else time.time_ns
        self._lock = threading.Lock()
        self._pending: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self._file: int | None = None
        self._closed = False
        self.bytes_dropped = 0  # output that could not be written (a full disk), in all
        self._episode = 0  # ... since writing last failed
        self._failing: OSError | None = None
        self._next_try = 0.0
        self._open()

    def _open(self) -> None:
        """Open (or create) the file; on a full disk it stays closed and a later write tries again."""
        self._next_try = time.monotonic() + 1.0
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self._file = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        except OSError as exc:
            self._file = None
            if self._failing is None:
                self._failing = exc
                log.warning("io.log_open_failed", path=self.path, error=exc.strerror or str(exc))

    def _emit(self, stream: str, content: bytes, tag: bytes, at: int = 0) -> None:
        if self._file is None and not self._closed and time.monotonic() >= self._next_try:
            self._open()
        if self._file is None:
            self._dropped(len(content) + 40, OSError(errno.EBADF, "log file not open"))
            return
        line = b"%s %s %s %s\n" % (rfc3339_nano(at or self._clock()), _STREAMS[stream], tag, content)
        try:
            written = os.write(self._file, line)
        except OSError as exc:
            # A full disk must not stop the container or the shim: the record is dropped,
            # counted and said once per episode; the kubelet sees the gap in the log.
            self._dropped(len(line), exc)
            return
        if written < len(line):  # the disk filled up within the record: the rest is dropped
            self._dropped(len(line) - written, OSError(errno.ENOSPC, "short write"))
        elif self._failing is not None:
            log.info("io.log_write_resumed", path=self.path, bytes_dropped=self._episode)
            self._failing, self._episode = None, 0

    def _dropped(self, size: int, exc: OSError) -> None:
        self.bytes_dropped += size
        self._episode += size
        if self._failing is None:
            self._failing = exc
            log.warning("io.log_write_failed", path=self.path, error=exc.strerror or str(exc))

    def write(self, stream: str, data: bytes, at: int = 0) -> None:
        """Append output; complete lines become records stamped ``at`` (default: now)."""
        if stream not in _STREAMS:
            raise ValueError(f"unknown stream {stream!r}")
        with self._lock:
            if self._closed:
                return
            buf = self._pending[stream]
            buf += data
            start = 0
            while True:
                nl = buf.find(b"\n", start)
                if nl < 0:
                    break
                line = bytes(buf[start:nl])
                start = nl + 1
                while len(line) > MAX_RECORD:
                    self._emit(stream, line[:MAX_RECORD], b"P", at)
                    line = line[MAX_RECORD:]
                self._emit(stream, line, b"F", at)
            del buf[:start]
            while len(buf) > MAX_RECORD:
                self._emit(stream, bytes(buf[:MAX_RECORD]), b"P", at)
                del buf[:MAX_RECORD]

    def flush_partial(self) -> None:
        """Write out unterminated output as partial records."""
        with self._lock:
            for stream, buf in self._pending.items():
                if buf:
                    self._emit(stream, bytes(buf), b"P")
                    buf.clear()

    def reopen(self) -> None:
        """Close and open the path again (after the kubelet renamed it); OSError if it cannot be
        created (a full disk): the writer then keeps trying on its own."""
        with self._lock:
            if self._file is not None:
                os.close(self._file)
                self._file = None
            if not self._closed:
                self._open()
                if self._file is None:
                    raise self._failing or OSError(errno.EIO, "cannot open the log file")

    def close(self, flush: bool = True) -> None:
        """Close for good; ``flush=False`` (the shim shutting down) leaves an unterminated last
        line out: a runtime that replays output (runv) sends it again after the restart, and a
        partial record written now would be followed by that line whole."""
        if flush:
            self.flush_partial()
        with self._lock:
            self._closed = True
            if self._file is not None:
                os.close(self._file)
                self._file = None


def touch_log(path: str) -> None:
    """Create an empty log file (and its directory) if there is none: a container that never ran."""
    if not path:
        return
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o640))


def last_log_marks(path: str) -> LogMarks | None:
    """Where a CRI log ends, per stream: (time of its last record, records at that time).

    Read from the last 64 KiB; handed to a backend re-attaching a running
    container after a restart, so that output already in the log is not
    written twice. A stream with no record there gets the time of the first
    record read and a count of 0: it wrote nothing since. A file with no
    record that the kubelet has just rotated: the marks of the newest rotated
    file (``PATH.TIMESTAMP``; older ones are compressed). A file with no
    record and none rotated: (0, 0) for both streams, everything is missing.
    None when there is no file (no log, or it cannot be read).
    """
    if not path:
        return None
    marks = _file_marks(path)
    if marks is not None:
        return marks
    if not os.path.exists(path):
        return None
    rotated = _newest_rotated(path)
    if rotated:
        marks = _file_marks(rotated)
        if marks is not None:
            return marks
    return {stream: (0, 0) for stream in _STREAMS}


def _newest_rotated(path: str) -> str:
    """The kubelet's newest rotated file of a log (``PATH.YYYYMMDD-HHMMSS``, not compressed)."""
    directory, name = os.path.split(path)
    try:
        names = os.listdir(directory or ".")
    except OSError:
        return ""
    rotated = sorted(n for n in names if n.startswith(name + ".") and not n.endswith((".gz", ".tmp")))
    return os.path.join(directory, rotated[-1]) if rotated else ""


def _file_marks(path: str) -> LogMarks | None:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536))
            tail = f.read()
    except OSError:
        return None
    marks: LogMarks = {}
    done: set[str] = set()
    first = 0
    for line in reversed(tail.splitlines()):
        parts = line.split(b" ", 2)
        if len(parts) < 2:
            continue
        try:
            at = parse_rfc3339_nano(parts[0])
            stream = parts[1].decode()
        except (ValueError, UnicodeDecodeError):
            continue
        if stream not in _STREAMS:
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
    for stream in _STREAMS:
        marks.setdefault(stream, (first, 0))
    return marks


class LogWriter(Protocol):
    """Where a followed process's output goes: a :class:`CriLogWriter`, or memory in tests."""

    def write(self, stream: str, data: bytes, at: int = 0) -> None: ...

    def flush_partial(self) -> None: ...

    def close(self, flush: bool = True) -> None: ...


class _Followed:
    """One container's process as the shim follows it (small: there may be 30,000 of them)."""

    __slots__ = (
        "cid",
        "drained",
        "ends",
        "io",
        "output_done",
        "process",
        "progress",
        "pump",
        "reported",
        "timer",
        "until",
        "writer",
    )

    def __init__(
        self, io: ContainerIO, cid: str, process: ContainerProcess, writer: LogWriter | None
    ) -> None:
        self.io = io
        self.cid = cid
        self.process = process
        self.writer = writer
        self.pump: asyncio.Task[None] | None = None  # reads a pulled output; None for a pipe
        self.output_done = False
        self.drained: asyncio.Event | None = None  # made for whoever waits in drain()
        self.timer: asyncio.TimerHandle | None = None  # gives up on the drain
        self.reported = False
        self.progress = 0  # outputs written so far: a drain waits on while this moves
        self.until = 0.0  # monotonic time at which a drain gives up whatever happens
        self.ends = output_ends(process)  # silence is not the end: wait for the end itself

    def write(self, out: Output) -> None:
        self.progress += 1
        if self.writer is not None:
            self.writer.write(out.stream, out.data, out.at)

    def still_draining(self, seen: int) -> bool:
        """Whether to wait on: output is still arriving (``seen``: progress at the last look)."""
        if not self.until:
            self.until = time.monotonic() + self.io.drain_max
        moving = self.ends or self.progress != seen
        return not self.output_done and moving and time.monotonic() < self.until

    def output_ended(self) -> None:
        self.output_done = True
        if self.writer is not None:
            self.writer.flush_partial()
        if self.drained is not None:
            self.drained.set()
        if self.process.exit.info is not None:
            self.report()

    def exit_known(self, _info: ExitInfo) -> None:
        if self.output_done:
            self.report()
        elif self.timer is None and not self.reported:
            self._look_again(-1)

    def _look_again(self, seen: int) -> None:
        if self.reported:
            return
        if seen != -1 and not self.still_draining(seen):
            self.timer = None
            self.report()
            return
        self.timer = asyncio.get_running_loop().call_later(
            self.io.drain_wait, self._look_again, self.progress
        )

    def report(self) -> None:
        if self.reported:
            return
        self.reported = True
        if self.timer is not None:
            self.timer.cancel()
        info = self.process.exit.info
        if info is not None:
            self.io.on_exit(self.cid, info)


class ContainerIO:
    """The output and the exit of every running container, for every backend.

    ``on_exit(container_id, info)`` is called once per followed process,
    when its exit is known and its output has ended (or stalled for
    :data:`DRAIN_WAIT`, or :data:`DRAIN_MAX` has passed); it is the shim's record of the exit, which
    ignores an exit already recorded (a stop on request records its own,
    after :meth:`drain`).

    A :class:`~backends.contract.ProcessPipe` is followed by callbacks, with
    no task: a container that writes nothing costs a few small objects. Any
    other process's output is read by one task.
    """

    def __init__(
        self,
        on_exit: Callable[[str, ExitInfo], None],
        drain_wait: float = DRAIN_WAIT,
        drain_max: float = DRAIN_MAX,
    ) -> None:
        self.on_exit = on_exit
        self.drain_wait = drain_wait
        self.drain_max = drain_max
        self._followed: dict[str, _Followed] = {}
        self._dropped_before = 0  # by the writers of containers no longer followed

    @property
    def log_bytes_dropped(self) -> int:
        """Output that could not be written to a CRI log (a full disk), since the start."""
        live = sum(getattr(f.writer, "bytes_dropped", 0) for f in self._followed.values())
        return self._dropped_before + live

    def __contains__(self, container_id: str) -> bool:
        return container_id in self._followed

    def follow(self, container_id: str, process: ContainerProcess, writer: LogWriter | None) -> None:
        """Copy the process's output into ``writer`` (None: read and dropped) and report its exit."""
        self.close(container_id)
        f = _Followed(self, container_id, process, writer)
        self._followed[container_id] = f
        if isinstance(process, ProcessPipe):
            process.connect(f.write, f.output_ended)
        else:
            f.pump = asyncio.get_running_loop().create_task(self._pump(f))
        process.exit.on_set(f.exit_known)

    async def _pump(self, f: _Followed) -> None:
        try:
            async for out in f.process.output():
                f.write(out)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # The runtime's side broke (not ours): the log has a gap; the exit still comes.
            log.warning("io.output_failed", container_id=f.cid, error=str(exc) or type(exc).__name__)
        f.output_ended()

    async def drain(self, container_id: str) -> None:
        """Wait (bounded) until the output of a process that has ended is all in its log."""
        f = self._followed.get(container_id)
        if f is None or f.output_done:
            return
        if f.drained is None:
            f.drained = asyncio.Event()
        while True:
            seen = f.progress
            try:
                await asyncio.wait_for(f.drained.wait(), self.drain_wait)
                return
            except TimeoutError:
                if not f.still_draining(seen):
                    return

    def writer(self, container_id: str) -> LogWriter | None:
        """The writer of a followed container (ReopenContainerLog); None if not followed."""
        f = self._followed.get(container_id)
        return f.writer if f is not None else None

    def close(self, container_id: str, flush: bool = True) -> None:
        """Stop following a container (its exit is recorded, or it is removed); flush its log
        (not when the shim shuts down: see :meth:`CriLogWriter.close`)."""
        f = self._followed.pop(container_id, None)
        if f is None:
            return
        f.reported = True
        if f.timer is not None:
            f.timer.cancel()
        if isinstance(f.process, ProcessPipe):
            f.process.disconnect()
        if f.pump is not None and not f.pump.done() and f.pump is not _current_task():
            f.pump.cancel()
        if f.drained is not None:
            f.drained.set()
        if f.writer is not None:
            f.writer.close(flush)
            self._dropped_before += getattr(f.writer, "bytes_dropped", 0)

    async def aclose(self) -> None:
        """Stop following everything (shutdown): the runtimes keep their containers."""
        tasks = [f.pump for f in self._followed.values() if f.pump is not None]
        for cid in list(self._followed):
            self.close(cid, flush=False)
        await asyncio.gather(*tasks, return_exceptions=True)


def _current_task() -> asyncio.Task[object] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no loop: called from a thread
        return None
