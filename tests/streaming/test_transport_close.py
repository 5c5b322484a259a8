"""Closing a streaming connection never resets it under what the peer has yet to read."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

from shim.streaming.transport import close_writer

PAYLOAD = b"output and exit status " * 400_000  # more than the kernel buffers hold in flight


async def test_the_peer_reads_everything_though_it_sent_more() -> None:
    """What the kubelet's proxy did: stdin still arriving after the exec ended and the shim
    closed. A close with unread input is answered with a reset, which can cut off what the
    peer has not received yet; the lingering close shuts down our side, reads what comes,
    and the peer gets all the output and a clean end."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(5)  # the client's first bytes; what it sends next is never read
        writer.write(PAYLOAD)
        await close_writer(writer, timeout=2.0, reader=reader, linger=2.0)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        got = await asyncio.to_thread(_slow_client, port)
    finally:
        server.close()
        await server.wait_closed()
    assert got == PAYLOAD


def _slow_client(port: int) -> bytes:
    """A peer that reads late, as a proxy busy elsewhere does: it keeps sending meanwhile."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"hello" + b"stdin the server will not read")
        time.sleep(0.3)  # the server has written and closed by now; nothing read here yet
        with contextlib.suppress(OSError):
            sock.sendall(b"more stdin after the close")  # a plain close answers with a reset
        time.sleep(0.3)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError:
            return b"<reset> after " + str(len(got)).encode()
        return got
