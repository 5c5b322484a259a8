"""Cheap gRPC callers for the throughput benches: unary calls as raw HTTP/2 frames on a unix socket.

A grpcio client in Python spends 200-300 us of CPU on each call (measured by
polled_bench.py), more than either runtime it drives: on a 2-core machine the
callers, not the runtime, then bound the calls a second. These callers cost a
few microseconds a call, about what a Go client (a kubelet) costs, so that the
runtime's own cost shows:

- one connection per :class:`Caller`, and ``depth`` calls in flight on it at
  once, as a kubelet's goroutines share its one gRPC connection;
- each request is a HEADERS frame whose block touches no HPACK table (static
  indexes and literals without indexing, made once per method) and a DATA frame
  with the serialized request, both with END_STREAM as gRPC asks;
- the answers' header blocks are decoded (the runtime may index into its table,
  as grpc-go does) with shim/transport/native/hpack_in.py's decoder; a call
  counts as done when its trailers say grpc-status 0, as failed otherwise or on
  RST_STREAM;
- our receive windows are opened wide at the start and the connection's given
  back each MiB; the runtime's windows for our requests are kept to.

Only what a bench needs: no TLS, no CONTINUATION on our side, no compression.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Sequence

from shim.transport.native.frames import (
    ACK,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    WINDOW_UPDATE,
    encode_frame,
    hpack_int,
)
from shim.transport.native.hpack_in import BlockDecoder

WINDOW = 1 << 30  # what we open for the runtime's answers, per stream and for the connection
REFILL = 1 << 20  # answer bytes read before the connection's window is given back
_HEAD = struct.Struct(">I")


def _literal(index: int, value: bytes) -> bytes:
    """A literal header without indexing whose name is static-table entry ``index``."""
    return hpack_int(index, 4) + hpack_int(len(value), 7) + value


def request_block(path: str, authority: str = "localhost") -> bytes:
    """The HEADERS block of a gRPC call to ``path`` (e.g. /runtime.v1.RuntimeService/Version)."""
    return (
        b"\x83"  # :method POST (static 3)
        + b"\x86"  # :scheme http (static 6)
        + _literal(4, path.encode())  # :path
        + _literal(1, authority.encode())  # :authority
        + _literal(31, b"application/grpc")  # content-type
        + b"\x00"
        + hpack_int(2, 7)
        + b"te"
        + hpack_int(8, 7)
        + b"trailers"
    )


def _frame_head(length: int, kind: int, flags: int, sid: int) -> bytes:
    return bytes((length >> 16, (length >> 8) & 0xFF, length & 0xFF, kind, flags)) + _HEAD.pack(sid)


class CallerError(Exception):
    """The runtime broke the connection (GOAWAY, EOF) or sent something we cannot read."""


class Caller:
    """One connection with up to ``depth`` calls of ``path`` in flight, the requests taken in turn from ``bodies``."""

    def __init__(self, sock_path: str, path: str, bodies: Sequence[bytes], depth: int) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(sock_path)
        self.block = request_block(path)
        # Each request's DATA payload: the gRPC message prefix and the message.
        self.payloads = [b"\x00" + len(b).to_bytes(4, "big") + b for b in bodies]
        self.depth = depth
        self.decoder = BlockDecoder(1 << 20)
        self.next_sid = 1
        self.in_flight: set[int] = set()
        self.send_window = 65535  # the runtime's connection window for our DATA
        self.stream_window = 65535  # its initial window for each stream, from its SETTINGS
        self.unacked = 0
        self.done = 0
        self.errors = 0
        self.buf = bytearray()
        self.k = 0
        settings = struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, WINDOW)
        self.sock.sendall(
            PREFACE
            + encode_frame(SETTINGS, 0, 0, settings)
            + encode_frame(WINDOW_UPDATE, 0, 0, (WINDOW - 65535).to_bytes(4, "big"))
        )

    def close(self) -> None:
        self.sock.close()

    def _requests(self) -> bytes:
        """Requests to fill the calls in flight up to ``depth`` (as far as the runtime's windows let)."""
        out = []
        block = self.block
        while len(self.in_flight) < self.depth:
            payload = self.payloads[self.k % len(self.payloads)]
            if len(payload) > self.send_window or len(payload) > self.stream_window:
                break  # wait for the runtime's WINDOW_UPDATE
            self.k += 1
            sid = self.next_sid
            self.next_sid += 2
            self.send_window -= len(payload)
            self.in_flight.add(sid)
            out.append(_frame_head(len(block), HEADERS, END_HEADERS, sid))
            out.append(block)
            out.append(_frame_head(len(payload), DATA, END_STREAM, sid))
            out.append(payload)
        return b"".join(out)

    def run(self, stop: threading.Event) -> None:
        """Calls until ``stop`` is set; those still in flight then are left (the socket is closed after)."""
        try:
            self._loop(stop)
        except OSError:
            if not stop.is_set():
                raise  # else: the socket was shut down by throughput() at the end

    def _loop(self, stop: threading.Event) -> None:
        sock = self.sock
        sock.sendall(self._requests())
        while not stop.is_set():
            data = sock.recv(1 << 18)
            if not data:
                if stop.is_set():
                    return
                raise CallerError("the runtime closed the connection")
            self.buf += data
            out = self._frames()
            more = self._requests()
            if out or more:
                sock.sendall(out + more)

    def _frames(self) -> bytes:
        """Reads the whole frames in the buffer; what they ask us to send back."""
        buf = self.buf
        pos = 0
        out = b""
        n = len(buf)
        while n - pos >= 9:
            length = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
            end = pos + 9 + length
            if end > n:
                break
            kind = buf[pos + 3]
            flags = buf[pos + 4]
            sid = _HEAD.unpack_from(buf, pos + 5)[0] & 0x7FFFFFFF
            if kind == DATA:
                self.unacked += length
                if self.unacked >= REFILL:
                    out += encode_frame(WINDOW_UPDATE, 0, 0, self.unacked.to_bytes(4, "big"))
                    self.unacked = 0
            elif kind == HEADERS:
                if not flags & END_HEADERS:
                    raise CallerError("the runtime sent CONTINUATION frames; these callers do not read them")
                payload = bytes(buf[pos + 9 : end])
                if flags & 0x8:  # PADDED
                    payload = payload[1 : len(payload) - payload[0]]
                if flags & 0x20:  # PRIORITY
                    payload = payload[5:]
                headers = self.decoder.decode(payload)
                if flags & END_STREAM:
                    ok = (b"grpc-status", b"0") in headers
                    self._ended(sid, ok)
            elif kind == RST_STREAM:
                self._ended(sid, False)
            elif kind == WINDOW_UPDATE:
                inc = _HEAD.unpack_from(buf, pos + 9)[0] & 0x7FFFFFFF
                if sid == 0:
                    self.send_window += inc
            elif kind == SETTINGS:
                if not flags & ACK:
                    for i in range(pos + 9, end, 6):
                        key, value = struct.unpack_from(">HI", buf, i)
                        if key == SETTINGS_INITIAL_WINDOW_SIZE:
                            self.stream_window = value
                    out += encode_frame(SETTINGS, ACK, 0)
            elif kind == PING:
                if not flags & ACK:
                    out += encode_frame(PING, ACK, 0, bytes(buf[pos + 9 : end]))
            elif kind == GOAWAY:
                raise CallerError("the runtime sent GOAWAY")
            pos = end
        del buf[:pos]
        return out

    def _ended(self, sid: int, ok: bool) -> None:
        if sid in self.in_flight:
            self.in_flight.discard(sid)
            if ok:
                self.done += 1
            else:
                self.errors += 1


def throughput(
    sock_path: str, path: str, bodies: Sequence[bytes], conns: int, depth: int, seconds: float
) -> tuple[float, int, int]:
    """Calls/s over ``seconds`` of ``conns`` connections with ``depth`` calls in flight each (a thread
    per connection), failed calls, and the calls counted; connections made before the clock starts."""
    callers = [Caller(sock_path, path, bodies, depth) for _ in range(conns)]
    stop = threading.Event()
    failures: list[BaseException] = []

    def run(c: Caller) -> None:
        try:
            c.run(stop)
        except BaseException as exc:  # reported by the caller of throughput()
            failures.append(exc)
            stop.set()

    threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in callers]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    try:
        time.sleep(seconds)
    finally:
        stop.set()
        elapsed = time.perf_counter() - t0
        done = sum(c.done for c in callers)
        errors = sum(c.errors for c in callers)
        for c in callers:
            c.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
        for t in threads:
            t.join(30)
        for c in callers:
            c.close()
    if failures:
        raise CallerError(f"{len(failures)} of {conns} connections failed: {failures[0]}")
    return done / elapsed, errors, done
