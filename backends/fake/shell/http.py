"""HTTP/1.0 and 1.1, the server's side, over a :class:`~backends.fake.shell.caller.Connection`:
requests read one after another (kept alive, pipelined), responses written with their length.

Why here: the shell's ``httpd`` and the fake's scripted servers (:mod:`backends.fake.servers`)
both answer HTTP on a forwarded port; one reader keeps their keep-alive and framing the same.
Request bodies are read by their Content-Length and dropped (no server here takes uploads); a
chunked one is refused with 501.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

from backends.fake.shell.caller import Connection

TEXT = "text/plain; charset=utf-8"
MAX_HEAD = 64 * 1024  # a request line and headers longer than this are refused (431)

_END_OF_HEAD = re.compile(rb"\r?\n\r?\n")
_VERSION = re.compile(r"HTTP/1\.[01]")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")

REASONS = {
    200: "OK",
    201: "Created",
    301: "Moved Permanently",
    302: "Found",
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    412: "Precondition Failed",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
}


class BadRequest(Exception):
    """A request this server cannot read: answered with ``status``, then the connection closes."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    method: str
    target: str  # as sent: path, query and all
    version: str  # HTTP/1.0 or HTTP/1.1
    headers: Mapping[str, str]  # names in lower case; a repeated header's values joined by ", "

    @property
    def path(self) -> str:
        """The target's path, still percent-encoded, without its query."""
        return self.target.split("?", 1)[0].split("#", 1)[0]

    @property
    def keep_alive(self) -> bool:
        """Whether the client keeps the connection after this request's answer (RFC 9112 §9.3)."""
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        if self.version == "HTTP/1.1":
            return "close" not in tokens
        return "keep-alive" in tokens


class Requests:
    """The requests of one connection, in order."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._buf = b""

    async def next(self) -> Request | None:
        """The next request; None when the client closed between requests (or inside one);
        BadRequest for what is not an HTTP/1.x request."""
        while True:
            self._buf = self._buf.lstrip(b"\r\n")  # RFC 9112 §2.2: empty lines before a request
            end = _END_OF_HEAD.search(self._buf)
            if end is not None:
                break
            if len(self._buf) > MAX_HEAD:
                raise BadRequest(431, "request head too long")
            data = await self._conn.read()
            if not data:
                return None
            self._buf += data
        head, self._buf = self._buf[: end.start()], self._buf[end.end() :]
        if len(head) > MAX_HEAD:
            raise BadRequest(431, "request head too long")
        request = _parse_head(head.decode("latin-1"))
        if "chunked" in request.headers.get("transfer-encoding", "").lower():
            raise BadRequest(501, "chunked request bodies are not read")
        length = request.headers.get("content-length", "0").strip() or "0"
        if not length.isdecimal():
            raise BadRequest(400, f"bad Content-Length {length!r}")
        if not await self._skip(int(length)):
            return None
        return request

    async def next_or_refuse(self) -> Request | None:
        """:meth:`next`, a request it cannot read answered (its status, the error as plain text)
        and taken for the end of the connection: None."""
        try:
            return await self.next()
        except BadRequest as exc:
            await self._conn.write(response(None, exc.status, TEXT, f"{exc}\n".encode())[0])
            return None

    async def _skip(self, length: int) -> bool:
        """Drops a body of ``length`` bytes; False if the client closed before its end."""
        while len(self._buf) < length:
            length -= len(self._buf)
            self._buf = await self._conn.read()
            if not self._buf:
                return False
        self._buf = self._buf[length:]
        return True


def _parse_head(text: str) -> Request:
    lines = re.split(r"\r?\n", text)
    parts = lines[0].split(" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not parts[1]:
        raise BadRequest(400, f"bad request line {lines[0]!r}")
    method, target, version = parts
    if not _VERSION.fullmatch(version):
        raise BadRequest(400, f"unsupported version {version!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not _TOKEN.fullmatch(name):
            raise BadRequest(400, f"bad header line {line!r}")
        key, value = name.lower(), value.strip(" \t")
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return Request(method, target, version, headers)


def response(
    request: Request | None,
    status: int,
    content_type: str,
    body: bytes,
    extra: Sequence[tuple[str, str]] = (),
) -> tuple[bytes, bool]:
    """An answer to ``request`` (None: to a request that could not be read) and whether the
    connection closes after it. A HEAD's answer has the headers of a GET's and no body."""
    close = request is None or not request.keep_alive
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}", *(f"{k}: {v}" for k, v in extra)]
    lines += [f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]
    if close:
        lines.append("Connection: close")
    elif request is not None and request.version == "HTTP/1.0":
        lines.append("Connection: keep-alive")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return (head if request is not None and request.method == "HEAD" else head + body), close
