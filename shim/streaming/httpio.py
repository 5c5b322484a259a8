"""The little HTTP/1.1 the streaming server needs: read one request head, answer it."""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.parse
from http import HTTPStatus

MAX_HEAD = 64 * 1024


class BadRequest(Exception):
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class HttpRequest:
    method: str
    target: str  # as sent: path and query
    version: str
    headers: tuple[tuple[str, str], ...]  # in order, names as sent

    @property
    def path(self) -> str:
        return urllib.parse.urlsplit(self.target).path

    @property
    def query(self) -> dict[str, list[str]]:
        return urllib.parse.parse_qs(urllib.parse.urlsplit(self.target).query)

    def get(self, name: str, default: str = "") -> str:
        name = name.lower()
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return default

    def get_all(self, name: str) -> list[str]:
        """Every value of ``name``, comma-separated lists split (as Go's net/http does for these)."""
        name = name.lower()
        values: list[str] = []
        for key, value in self.headers:
            if key.lower() == name:
                values += [v.strip() for v in value.split(",") if v.strip()]
        return values


async def read_request(reader: asyncio.StreamReader) -> HttpRequest | None:
    """The next request head; None at a clean EOF before any byte."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise BadRequest("truncated request") from exc
    except asyncio.LimitOverrunError as exc:
        raise BadRequest("request head too large") from exc
    try:
        lines = head[:-4].decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError as exc:
        raise BadRequest("malformed request line") from exc
    if not version.startswith("HTTP/1.") or not target.startswith("/"):
        raise BadRequest("unsupported request line")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest("malformed header line")
        headers.append((name, value.strip()))
    return HttpRequest(method.upper(), target, version, tuple(headers))


def response(status: int, headers: list[tuple[str, str]] | None = None, body: bytes = b"") -> bytes:
    phrase = HTTPStatus(status).phrase
    lines = [f"HTTP/1.1 {status} {phrase}"]
    all_headers = list(headers or [])
    if status != 101:
        all_headers += [
            ("Content-Type", "text/plain; charset=utf-8"),
            ("Content-Length", str(len(body))),
            ("Connection", "close"),
        ]
    lines += [f"{k}: {v}" for k, v in all_headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
