"""The streaming HTTP server: one listener for SPDY/3.1 and WebSocket upgrades.

Exec/Attach/PortForward RPCs cache their request under a one-use token and
answer with ``{base}/{exec,attach,portforward}/{token}``; the client then
upgrades a request for that URL and the session runs on this event loop.

What a client can hold is bounded: ``max_handshakes`` connections that have not
sent their request head yet (each for REQUEST_TIMEOUT at most) and
``max_streams`` sessions; past either, 503 with Retry-After, at once. A request
is checked (path, method, Upgrade) before its token is spent, so only a dial
that starts a session uses it up.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Awaitable, Callable

import structlog

from cri_api import api_pb2 as pb
from shim.cri.errors import InvalidArgumentError
from shim.streaming import portforward, remotecommand, websocket
from shim.streaming import protocols as proto
from shim.streaming.config import StreamingConfig, StreamingRuntime
from shim.streaming.httpio import MAX_HEAD, BadRequest, HttpRequest, read_request, response
from shim.streaming.session import SpdySession
from shim.streaming.tokens import TokenCache
from shim.streaming.transport import ByteTransport, TcpTransport, close_writer

log = structlog.get_logger(__name__)

REQUEST_TIMEOUT = 10.0  # for the request head after the TCP accept

CachedRequest = tuple[str, pb.ExecRequest | pb.AttachRequest | pb.PortForwardRequest]


class StreamingServer:
    def __init__(self, runtime: StreamingRuntime, config: StreamingConfig) -> None:
        self.runtime = runtime
        self.config = config
        self._tokens: TokenCache[CachedRequest] = TokenCache(config.token_ttl, config.max_tokens)
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._spdy_sessions: set[SpdySession] = set()
        self._handshakes = 0
        self._sessions = 0
        self.base_url = ""

    # ---- lifecycle

    async def start(self) -> None:
        """Bind and listen on the running loop."""
        ssl_context = None
        if self.config.tls_cert or self.config.tls_key:
            if not (self.config.tls_cert and self.config.tls_key):
                raise ValueError("streaming TLS needs both tls_cert and tls_key")
            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(self.config.tls_cert, self.config.tls_key)
        self._server = await asyncio.start_server(
            self._on_connection,
            self.config.address,
            self.config.port,
            ssl=ssl_context,
            # a TLS handshake is held to the time a request head gets (asyncio's default: 60 s)
            ssl_handshake_timeout=REQUEST_TIMEOUT if ssl_context else None,
            limit=MAX_HEAD,
        )
        port = self._server.sockets[0].getsockname()[1]
        host = self.config.address
        if ":" in host:
            host = f"[{host}]"
        self.base_url = f"{'https' if ssl_context else 'http'}://{host}:{port}"
        log.info("streaming server listening", url=self.base_url)

    async def stop(self) -> None:
        """Close the listener and every session; returns when their tasks are gone."""
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5.0):
                await self._server.wait_closed()
        self._server = None

    @property
    def port(self) -> int:
        return int(self.base_url.rsplit(":", 1)[1]) if self.base_url else 0

    @property
    def open_sessions(self) -> int:
        return self._sessions

    @property
    def open_connections(self) -> int:
        """Connections being served: sessions, and dials not answered yet."""
        return len(self._connections)

    def buffered_bytes(self) -> int:
        """What the server holds for its connections: output not yet taken by the
        kernel, and SPDY input not yet consumed."""
        out = sum(w.transport.get_write_buffer_size() for w in self._connections.values())
        return out + sum(s.buffered for s in self._spdy_sessions)

    # ---- URLs

    def exec_url(self, req: pb.ExecRequest) -> str:
        if not req.cmd:
            raise InvalidArgumentError("cmd must not be empty")
        _validate_streams(req)
        return self._url("exec", req)

    def attach_url(self, req: pb.AttachRequest) -> str:
        _validate_streams(req)
        return self._url("attach", req)

    def portforward_url(self, req: pb.PortForwardRequest) -> str:
        if any(not 0 < p < 65536 for p in req.port):
            raise InvalidArgumentError("port must be in 1..65535")
        return self._url("portforward", req)

    def _url(self, kind: str, req: pb.ExecRequest | pb.AttachRequest | pb.PortForwardRequest) -> str:
        if not self.base_url:
            raise RuntimeError("streaming server not started")
        copy = type(req)()
        copy.CopyFrom(req)  # type: ignore[arg-type]
        return f"{self.base_url}/{kind}/{self._tokens.insert((kind, copy))}"

    # ---- connections

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        try:
            await self._serve(reader, writer)
        except asyncio.CancelledError:
            # stop() cancels connections; ending normally keeps asyncio's
            # start_server callback from reporting the cancellation as an error.
            pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception:
            log.exception("streaming connection failed")
        finally:
            self._connections.pop(task, None)
            if not writer.is_closing():
                writer.transport.abort()

    async def _reply(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        status: int,
        message: str,
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        """Answer and close. The close lingers (briefly) over what the client still
        sends: closing with its request unread would reset the connection, and a reset
        can destroy the answer before the client reads it."""
        writer.write(response(status, headers, (message + "\n").encode()))
        await close_writer(writer, timeout=2.0, reader=reader, linger=1.0)

    async def _busy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, what: str) -> None:
        """503: no room for the client now; it may try again in a second."""
        await self._reply(reader, writer, 503, f"{what}; try again later", [("Retry-After", "1")])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._handshakes >= self.config.max_handshakes:
            log.debug("streaming connection refused: too many handshakes", limit=self.config.max_handshakes)
            await self._busy(
                reader,
                writer,
                "too many connections waiting to start a streaming session "
                f"(at most {self.config.max_handshakes})",
            )
            return
        self._handshakes += 1
        try:
            try:
                async with asyncio.timeout(REQUEST_TIMEOUT):
                    request = await read_request(reader)
            finally:
                self._handshakes -= 1
        except TimeoutError:
            await self._reply(
                reader, writer, 400, f"bad request: no complete request head within {REQUEST_TIMEOUT:g}s"
            )
            return
        except BadRequest as exc:
            await self._reply(reader, writer, 400, f"bad request: {exc}")
            return
        if request is None:
            return
        kind, _, token = request.path.strip("/").partition("/")
        if kind not in ("exec", "attach", "portforward") or not token or "/" in token:
            await self._reply(reader, writer, 404, "not found")
            return
        if request.method not in ("GET", "POST"):
            await self._reply(reader, writer, 405, "method not allowed")
            return
        upgrade = [u.lower() for u in request.get_all("Upgrade")]
        websocket_upgrade = "websocket" in upgrade
        if not websocket_upgrade and proto.SPDY_UPGRADE.lower() not in upgrade:
            await self._reply(reader, writer, 400, "streaming needs an Upgrade to SPDY/3.1 or websocket")
            return
        if self._sessions >= self.config.max_streams:
            # The token is left unused: the client may try again.
            log.debug("streaming session refused: at the limit", limit=self.config.max_streams)
            await self._busy(
                reader, writer, f"too many streaming sessions (at most {self.config.max_streams})"
            )
            return
        entry = self._tokens.consume(token, lambda cached: cached[0] == kind)
        if entry is None:
            await self._reply(reader, writer, 404, "not found")
            return
        req = entry[1]
        started = time.monotonic()
        self._sessions += 1
        try:
            if websocket_upgrade:
                protocol = await self._serve_websocket(request, reader, writer, req)
            else:
                protocol = await self._serve_spdy(request, reader, writer, req)
        finally:
            self._sessions -= 1
        log.info(
            "streaming session ended",
            kind=kind,
            protocol=protocol,
            duration=round(time.monotonic() - started, 3),
        )

    async def _serve_spdy(
        self,
        request: HttpRequest,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        req: pb.ExecRequest | pb.AttachRequest | pb.PortForwardRequest,
    ) -> str | None:
        supported = (
            proto.SPDY_PORTFORWARD if isinstance(req, pb.PortForwardRequest) else proto.SPDY_REMOTECOMMAND
        )
        offered = request.get_all(proto.PROTOCOL_HEADER)
        chosen = proto.negotiate(offered, supported)
        if offered and chosen is None:
            await self._reply(
                reader,
                writer,
                403,
                f"unable to upgrade: unable to negotiate protocol: client supports {offered}, "
                f"server supports {list(supported)}",
                [(proto.ACCEPTED_PROTOCOLS_HEADER, p) for p in supported],
            )
            return None
        # No header at all is the oldest client: it speaks the first version.
        protocol = chosen or supported[-1]
        headers = [("Connection", "Upgrade"), ("Upgrade", proto.SPDY_UPGRADE)]
        if chosen:
            headers.append((proto.PROTOCOL_HEADER, chosen))
        writer.write(response(101, headers))
        await writer.drain()
        transport = TcpTransport(reader, writer)
        timeout = self.config.stream_creation_timeout
        if isinstance(req, pb.PortForwardRequest):
            await self._spdy_session(
                transport, lambda s: portforward.serve_spdy(s, req, self.runtime, timeout)
            )
        else:
            await self._spdy_session(
                transport, lambda s: remotecommand.serve_spdy(s, protocol, req, self.runtime, timeout)
            )
        return protocol

    async def _serve_websocket(
        self,
        request: HttpRequest,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        req: pb.ExecRequest | pb.AttachRequest | pb.PortForwardRequest,
    ) -> str | None:
        offered = request.get_all("Sec-WebSocket-Protocol")
        if isinstance(req, pb.PortForwardRequest):
            table = proto.WS_PORTFORWARD
            chosen = proto.negotiate(offered, [proto.WS_SPDY_TUNNEL, *table])
        else:
            table = proto.WS_REMOTECOMMAND
            chosen = proto.negotiate(offered, list(table))
        if offered and chosen is None:
            await self._reply(
                reader,
                writer,
                400,
                f"requested protocol(s) are not supported: {offered}; supports {list(table)}",
            )
            return None
        ports: list[int] | None = None
        if isinstance(req, pb.PortForwardRequest) and chosen != proto.WS_SPDY_TUNNEL:
            ports = portforward.ws_ports(req, request.query)
            if ports is None:
                await self._reply(
                    reader, writer, 400, "port-forward over WebSocket needs at least one valid port"
                )
                return None
        ws = await websocket.accept(request, reader, writer, chosen)
        if ws is None:
            await close_writer(writer, timeout=2.0)
            return None
        try:
            if chosen == proto.WS_SPDY_TUNNEL:
                assert isinstance(req, pb.PortForwardRequest)
                await self._spdy_session(
                    portforward.WsByteTransport(ws),
                    lambda s: portforward.serve_spdy(
                        s, req, self.runtime, self.config.stream_creation_timeout
                    ),
                )
            elif isinstance(req, pb.PortForwardRequest):
                assert ports is not None
                wsproto = table.get(chosen or "", proto.WS_LEGACY)
                await self._idle_guard(
                    portforward.serve_websocket(ws, wsproto, req, ports, self.runtime),
                    lambda: ws.last_activity,
                )
            else:
                wsproto = table.get(chosen or "", proto.WS_LEGACY)
                await self._idle_guard(
                    remotecommand.serve_websocket(ws, wsproto, req, self.runtime), lambda: ws.last_activity
                )
        finally:
            await ws.aclose()
        return chosen or "websocket"

    async def _spdy_session(
        self, transport: ByteTransport, serve: Callable[[SpdySession], Awaitable[None]]
    ) -> None:
        """A SPDY session over ``transport``, served by ``serve`` until it ends or idles out."""
        session = SpdySession(transport)
        session.start()
        self._spdy_sessions.add(session)
        try:
            await self._idle_guard(serve(session), lambda: transport.last_activity)
        finally:
            self._spdy_sessions.discard(session)
            await session.aclose()

    async def _idle_guard(self, handler: Awaitable[None], last_activity: Callable[[], float]) -> None:
        """Run ``handler``; cancel it once the connection saw no traffic for idle_timeout."""
        task = asyncio.ensure_future(handler)
        try:
            while True:
                remaining = last_activity() + self.config.idle_timeout - time.monotonic()
                if remaining <= 0:
                    log.info("streaming session idle, closing")
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    return
                done, _ = await asyncio.wait({task}, timeout=remaining)
                if done:
                    task.result()
                    return
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


def _validate_streams(req: pb.ExecRequest | pb.AttachRequest) -> None:
    if not (req.stdin or req.stdout or req.stderr):
        raise InvalidArgumentError("one of stdin, stdout, or stderr must be set")
    if req.tty and req.stderr:
        raise InvalidArgumentError("tty and stderr cannot both be true")
