"""Scripted servers: what a fake container answers on a port, for port-forward.

A container declares them in its annotation ``fake.cri-shim.io/serve``
(JSON): ``{"8080": {"/": "hello\\n", "/healthz": "ok"}, "6379": "+PONG\\r\\n"}``.
A port mapped to an object is an HTTP server: each request's path gets its
body with 200, any other path 404, keep-alive honoured. A port mapped to a
string answers every connection with that text and closes it. A port no
container of the pod serves echoes what it is sent (or answers with the
handler's ``port_responses`` for that port).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from backends.contract import ContainerRecord, PortStream, errors

SERVE_ANNOTATION = "fake.cri-shim.io/serve"

Server = str | dict[str, str]
_MAX_HEAD = 64 * 1024


def parse_serve(c: ContainerRecord) -> dict[int, Server]:
    """The container's scripted servers by port; InvalidArgumentError for a malformed annotation."""
    raw = c.config.annotations.get(SERVE_ANNOTATION)
    if raw is None:
        return {}
    where = f"annotation {SERVE_ANNOTATION}"
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise errors.InvalidArgumentError(f"{where}: not valid JSON: {exc}") from None
    if not isinstance(data, Mapping):
        raise errors.InvalidArgumentError(f"{where}: expected an object of ports")
    out: dict[int, Server] = {}
    for port, spec in data.items():
        if not str(port).isdigit() or not 0 < int(port) <= 65535:
            raise errors.InvalidArgumentError(f"{where}: {port!r} is not a port")
        if isinstance(spec, str):
            out[int(port)] = spec
        elif isinstance(spec, Mapping) and all(isinstance(v, str) for v in spec.values()):
            out[int(port)] = {str(k): v for k, v in spec.items()}
        else:
            raise errors.InvalidArgumentError(f"{where}: port {port}: a text or an object of path to body")
    return out


async def serve(server: Server, stream: PortStream) -> None:
    """Answer one forwarded connection as ``server`` says."""
    if isinstance(server, str):
        await stream.write(server.encode())
        return
    buf = b""
    while True:
        while b"\r\n\r\n" not in buf:
            data = await stream.read()
            if not data or len(buf) > _MAX_HEAD:
                return
            buf += data
        head, _, buf = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        path = parts[1].split("?", 1)[0] if len(parts) >= 2 else "/"
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0") or 0)
        while len(buf) < length:  # a request body is read and dropped
            data = await stream.read()
            if not data:
                return
            buf += data
        buf = buf[length:]
        body = server.get(path)
        status = "200 OK" if body is not None else "404 Not Found"
        payload = (body if body is not None else "404 page not found\n").encode()
        close = headers.get("connection", "").lower() == "close" or parts[-1:] == ["HTTP/1.0"]
        head_lines = [
            f"HTTP/1.1 {status}",
            "Content-Type: text/plain; charset=utf-8",
            f"Content-Length: {len(payload)}",
        ]
        if close:
            head_lines.append("Connection: close")
        await stream.write(("\r\n".join(head_lines) + "\r\n\r\n").encode() + payload)
        if close:
            return
