"""Container log files in the CRI format.

Each record is one line: ``RFC3339Nano-timestamp STREAM TAG content``, where
STREAM is ``stdout`` or ``stderr`` and TAG is ``F`` for a full line or ``P``
for a partial one (a line longer than the record limit, or output that ended
without a newline). The kubelet and ``crictl logs`` parse exactly this.
"""

from __future__ import annotations

import os
import threading
import time

MAX_RECORD = 16 * 1024  # content bytes per record before a line is split

_STREAMS = {"stdout": b"stdout", "stderr": b"stderr"}


def rfc3339_nano(ns: int) -> bytes:
    secs, frac = divmod(ns, 1_000_000_000)
    base = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs))
    return f"{base}.{frac:09d}Z".encode()


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
        self._open()

    def _open(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._file = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)

    def _emit(self, stream: str, content: bytes, tag: bytes, at: int = 0) -> None:
        if self._file is None:
            return
        line = b"%s %s %s %s\n" % (rfc3339_nano(at or self._clock()), _STREAMS[stream], tag, content)
        try:
            os.write(self._file, line)
        except OSError:
            # A full disk must not kill the container's output pump; the
            # kubelet sees the gap in the log.
            pass

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
        with self._lock:
            if self._file is not None:
                os.close(self._file)
                self._file = None
            if not self._closed:
                self._open()

    def close(self) -> None:
        self.flush_partial()
        with self._lock:
            self._closed = True
            if self._file is not None:
                os.close(self._file)
                self._file = None
