"""Scripted servers: what a fake container answers on a port, for port-forward.

A container declares them in its annotation ``fake.cri-shim.io/serve``
(JSON): ``{"8080": {"/": "hello\\n", "/healthz": "ok"}, "6379": "+PONG\\r\\n"}``.
A port mapped to an object is an HTTP server: each request's path gets its
body with 200, any other path 404, keep-alive honoured. A port mapped to a
string answers every connection with that text and closes it. A container's
servers bind their ports of the pod (:mod:`backends.fake.ports`) while it
runs, as the shell's ``httpd`` does; a port already bound by another of the
pod's servers stays with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from backends.contract import ContainerRecord, errors
from backends.fake.shell import http
from backends.fake.shell.caller import Connection

SERVE_ANNOTATION = "fake.cri-shim.io/serve"

Server = str | dict[str, str]


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


async def serve(server: Server, stream: Connection) -> None:
    """Answer one forwarded connection as ``server`` says."""
    if isinstance(server, str):
        await stream.write(server.encode())
        return
    requests = http.Requests(stream)
    while (request := await requests.next_or_refuse()) is not None:
        body = server.get(request.path)
        status, payload = (200, body) if body is not None else (404, "404 page not found\n")
        data, close = http.response(request, status, http.TEXT, payload.encode())
        await stream.write(data)
        if close:
            return
