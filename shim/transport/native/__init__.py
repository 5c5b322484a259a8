"""A gRPC server on the event loop itself: HTTP/2 over a unix socket, no threads.

``[server] transport = "native"`` (the default of ``cri-shim serve`` and ``hollow``) serves
the CRI with this package instead of grpcio. Each grpcio call crosses threads
several times (grpc's event engine, its completion-queue poller, the event
loop); on a small VM that is about a millisecond of CPU per call, mostly
context switches. Here a call is parsed, answered and written from the
socket's read callback: a fake node's List call costs tens of microseconds,
and a hundred hollow nodes polled once a second stay within a few percent of
one core (bench/hollow_bench.py prints both transports side by side).

What it implements, from RFC 9113 (HTTP/2), RFC 7541 (HPACK: its own decoder,
with the ``hpack`` package's static table and Huffman decoding) and gRPC's
"PROTOCOL-HTTP2" document:

- the connection preface, SETTINGS (and their ACK), PING, GOAWAY,
  RST_STREAM, WINDOW_UPDATE, PRIORITY (ignored), CONTINUATION;
- flow control both ways: the peer's windows bound what is sent (a reply
  larger than the window waits for WINDOW_UPDATE), and what is received is
  given back as it is read (a stream's at half its window, the connection's a
  MiB at a time);
- gRPC unary and server-streaming calls: length-prefixed messages,
  ``grpc-timeout`` deadlines, ``grpc-status`` / percent-encoded
  ``grpc-message`` trailers, Trailers-Only answers for errors;
- the CRI services (through :class:`shim.cri.servicer.CriServicer`, the same
  code as the grpcio transport) and ``grpc.health.v1.Health/Check``.

Compressed messages are refused (UNIMPLEMENTED); nothing in the CRI sends
them. A peer that breaks the protocol gets GOAWAY with the error code and the
connection is closed; the process and other connections carry on.

Its modules: ``frames`` (the wire: frame header, codes, the HPACK we write),
``hpack_in`` (the request header blocks we read),
``connection`` (one client's HTTP/2: streams, SETTINGS, flow control),
``stream`` (one request stream's state),
``calls`` (gRPC on a stream: messages, status, deadlines, the servicer) and
``server`` (the listening socket, the connections, stopping).
"""

from shim.transport.native.calls import percent, timeout
from shim.transport.native.frames import PREFACE, encode_frame, literal_header, next_frame
from shim.transport.native.server import NativeServer, listen_socket

__all__ = [
    "PREFACE",
    "NativeServer",
    "encode_frame",
    "listen_socket",
    "literal_header",
    "next_frame",
    "percent",
    "timeout",
]
