"""HTTP(S) to registry hosts: one connection a request (http.client, stdlib), the host's own TLS
context, a dial timeout for the connection and a progress timeout for every socket read (a reply
is given up only when no byte arrived for that long, however long it takes in all), redirects
followed up to a cap.

Errors here are :class:`TransportError` with a reason that names no credential and no query
string (pre-signed blob URLs carry theirs there).
"""

from __future__ import annotations

import http.client
import io
import socket
import ssl
import urllib.parse
from collections.abc import Sequence

from backends.oci.hosts import RegistryHost

MAX_REDIRECTS = 5
_REDIRECTS = {301, 302, 303, 307, 308}
USER_AGENT = "cri-shim"


class PullError(Exception):
    """A pull cannot go on; the message names what (host, digest) and why."""


class TransportError(PullError):
    """The host could not be asked (connection, TLS, a silent host, a redirect loop)."""


class StalledError(TransportError):
    """No byte arrived for the progress timeout."""


class RedirectError(TransportError):
    """Too many redirects (a loop), or one that cannot be followed."""


class TooLargeError(TransportError):
    """An answer over the size allowed for it."""


def safe_url(url: str) -> str:
    """``url`` without its query (pre-signed URLs hold their signature there)."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


def check_header(value: str) -> None:
    # http.client's own check quotes the value in its error: a token must not reach a message.
    if any(ord(c) < 32 and c != "\t" for c in value) or any(ord(c) > 255 for c in value):
        raise PullError("a header value (credentials?) holds characters HTTP does not allow")


class Reply:
    """A response with the connection it came on; ``close`` closes both."""

    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, url: str) -> None:
        self.conn = conn
        self.resp = resp
        self.url = url  # where it finally came from (after redirects)
        self.status = resp.status
        self.headers = resp.headers

    @property
    def length(self) -> int | None:
        value = self.headers.get("Content-Length")
        return int(value) if value and value.isdigit() else None

    def read_all(self, limit: int, progress_timeout: float) -> bytes:
        """The whole body, at most ``limit`` bytes (TransportError beyond: it is not read)."""
        if (self.length or 0) > limit:
            raise TooLargeError(f"answer of {self.length} bytes is over the limit of {limit}")
        try:
            data = self.resp.read(limit + 1)
        except TimeoutError:
            raise StalledError(f"no byte for {progress_timeout:g}s") from None
        except (http.client.HTTPException, OSError) as exc:
            raise TransportError(f"connection broken: {describe(exc)}") from None
        if len(data) > limit:
            raise TooLargeError(f"answer is over the limit of {limit} bytes")
        return data

    def close(self) -> None:
        self.resp.close()
        self.conn.close()


class Transport:
    def __init__(self, progress_timeout: float) -> None:
        # 0 = off: a read then waits as long as the peer keeps the connection open.
        self.progress_timeout = progress_timeout

    def request(
        self,
        host: RegistryHost,
        url: str,
        headers: Sequence[tuple[str, str]],
        method: str = "GET",
        body: bytes | None = None,
        private: Sequence[tuple[str, str]] = (),
    ) -> Reply:
        """Send a request to ``url`` on ``host`` and follow redirects; ``private`` headers
        (Authorization, the host's configured ones) go only to ``host`` itself. A reply of any
        status is returned (the caller reads its status)."""
        seen: list[str] = []
        target = url
        for _ in range(MAX_REDIRECTS + 1):
            parts = urllib.parse.urlsplit(target)
            own = parts.netloc == host.netloc and parts.scheme == host.scheme
            sent = [*headers, *(private if own else ())]
            reply = self._once(host, parts, method, sent, body)
            if reply.status not in _REDIRECTS:
                return reply
            location = reply.headers.get("Location", "")
            reply.close()
            if not location:
                raise RedirectError(
                    f"HTTP {reply.status} redirect without a Location from {safe_url(target)}"
                )
            seen.append(safe_url(target))
            target = urllib.parse.urljoin(target, location)
            if reply.status == 303:
                method, body = "GET", None
            elif body is not None and urllib.parse.urlsplit(target).netloc != host.netloc:
                # A body (a refresh token's form) goes to the host it was meant for only.
                raise RedirectError(f"{method} to {seen[-1]} redirected to another host: not resent there")
        raise RedirectError(
            f"more than {MAX_REDIRECTS} redirects (a redirect loop?) from {seen[0]} through {seen[-1]}"
        )

    def _once(
        self,
        host: RegistryHost,
        parts: urllib.parse.SplitResult,
        method: str,
        headers: Sequence[tuple[str, str]],
        body: bytes | None,
    ) -> Reply:
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise RedirectError(f"cannot follow a redirect to {safe_url(parts.geturl())}")
        conn: http.client.HTTPConnection
        if parts.scheme == "https":
            # A redirect elsewhere (a blob store) is checked with the host's context too: it
            # trusts the system's CAs and the host's own.
            context = host.tls or ssl.create_default_context()
            conn = http.client.HTTPSConnection(parts.netloc, timeout=host.dial_timeout, context=context)
        else:
            conn = http.client.HTTPConnection(parts.netloc, timeout=host.dial_timeout)
        try:
            conn.connect()
        except TimeoutError:
            conn.close()
            raise TransportError(f"no connection in {host.dial_timeout:g}s (dial timeout)") from None
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise TransportError(describe(exc)) from None
        try:
            assert conn.sock is not None
            conn.sock.settimeout(self.progress_timeout or None)
            path = parts.path or "/"
            if parts.query:
                path += "?" + parts.query
            conn.putrequest(method, path, skip_accept_encoding=True)
            # One request a connection: the registry need not keep a thread or a socket for us.
            for name, value in (("User-Agent", USER_AGENT), ("Connection", "close"), *headers):
                check_header(value)
                conn.putheader(name, value)
            if body is not None:
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            resp = conn.getresponse()
        except TimeoutError:
            conn.close()
            raise TransportError(f"no answer in {self.progress_timeout:g}s (progress timeout)") from None
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise TransportError(describe(exc)) from None
        except BaseException:
            conn.close()
            raise
        return Reply(conn, resp, parts.geturl())


def describe(exc: BaseException) -> str:
    """A short reason for a connection error (never a header or a URL query)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS certificate not trusted: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return f"TLS error: {exc.reason or exc.__class__.__name__}"
    if isinstance(exc, socket.gaierror):
        return f"name not resolved: {exc.strerror}"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, http.client.IncompleteRead):
        return f"connection closed after {len(exc.partial)} bytes"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "connection closed without an answer"
    if isinstance(exc, OSError):
        return exc.strerror or exc.__class__.__name__
    return exc.__class__.__name__


class BlobStream(io.RawIOBase):
    """A blob's body to read: a read that waits longer than the progress timeout for a byte
    raises :class:`StalledError` naming the blob and the host; more bytes than ``limit``
    raise TransportError."""

    def __init__(
        self, reply: Reply, digest: str, host: str, progress_timeout: float, limit: int | None
    ) -> None:
        super().__init__()
        self.reply = reply
        self.headers = reply.headers
        self.length = reply.length
        self.digest = digest
        self.host = host
        self.received = 0
        self._timeout = progress_timeout
        self._limit = limit

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        try:
            n = self.reply.resp.readinto(buffer)
        except TimeoutError:
            raise StalledError(
                f"blob {self.digest} from {self.host}: no byte for {self._timeout:g}s "
                f"after {self.received} bytes (progress timeout)"
            ) from None
        except (http.client.HTTPException, OSError) as exc:
            raise TransportError(f"blob {self.digest} from {self.host}: {describe(exc)}") from None
        self.received += n
        if self._limit is not None and self.received > self._limit:
            raise TooLargeError(
                f"blob {self.digest} from {self.host}: "
                f"more than the {self._limit} bytes the manifest declares"
            )
        return n

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            chunks = []
            while chunk := self.read(1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)
        buffer = bytearray(size)
        n = self.readinto(buffer)
        return bytes(buffer[:n])

    def close(self) -> None:
        if not self.closed:
            self.reply.close()
        super().close()
