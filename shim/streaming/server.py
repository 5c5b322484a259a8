"""The streaming HTTP server: one listener for SPDY/3.1 and WebSocket upgrades.

Exec/Attach/PortForward RPCs cache their request under a one-use token and
answer with ``{base}/{exec,attach,portforward}/{token}``; the client then
upgrades a request for that URL and the session runs on this event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Awaitable, Callable

import structlog

from cri_api import api_pb2 as pb
from shim.errors import InvalidArgumentError
from shim.streaming import portforward, remotecommand, websocket
from shim.streaming import protocols as proto
from shim.streaming.config import StreamingConfig, StreamingRuntime
from shim.streaming.httpio import MAX_HEAD, BadRequest, HttpRequest, read_request, response
from shim.streaming.session import SpdySession
from shim.streaming.tokens import TokenCache
from shim.streaming.transport import TcpTransport, close_writer

log = structlog.get_logger(__name__)

REQUEST_TIMEOUT = 10.0  # for the request head after the TCP accept

CachedRequest = tuple[str, pb.ExecRequest | pb.AttachRequest | pb.PortForwardRequest]


class StreamingServer:
    def __init__(self, runtime: StreamingRuntime, config: StreamingConfig) -> None:
        self.runtime = runtime
        self.config = config
        self._tokens: TokenCache[CachedRequest] = TokenCache(config.token_ttl, config.max_tokens)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
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
            self._on_connection, self.config.address, self.config.port, ssl=ssl_context, limit=MAX_HEAD
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
        self._connections.add(task)
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
            self._connections.discard(task)
            if not writer.is_closing():
                writer.transport.abort()

    async def _reply(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        message: str,
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        writer.write(response(status, headers, (message + "\n").encode()))
        await close_writer(writer, timeout=2.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                request = await read_request(reader)
        except (BadRequest, TimeoutError) as exc:
            await self._reply(writer, 400, f"bad request: {exc}")
            return
        if request is None:
            return
        kind, _, token = request.path.strip("/").partition("/")
        if kind not in ("exec", "attach", "portforward") or not token or "/" in token:
            await self._reply(writer, 404, "not found")
            return
        if request.method not in ("GET", "POST"):
            await self._reply(writer, 405, "method not allowed")
            return
        if self._sessions >= self.config.max_streams:
            # The token is left unused: the client may try again.
            await self._reply(writer, 503, "too many streaming sessions")
            return
        entry = self._tokens.consume(token)
        if entry is None or entry[0] != kind:
            await self._reply(writer, 404, "not found")
            return
        req = entry[1]
        upgrade = [u.lower() for u in request.get_all("Upgrade")]
        started = time.monotonic()
        self._sessions += 1
        try:
            if "websocket" in upgrade:
                protocol = await self._serve_websocket(request, reader, writer, req)
            elif proto.SPDY_UPGRADE.lower() in upgrade:
                protocol = await self._serve_spdy(request, reader, writer, req)
            else:
                await self._reply(writer, 400, "streaming needs an Upgrade to SPDY/3.1 or websocket")
                return
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
        session = SpdySession(TcpTransport(reader, writer))
        session.start()
        try:
            if isinstance(req, pb.PortForwardRequest):
                handler = portforward.serve_spdy(
                    session, req, self.runtime, self.config.stream_creation_timeout
                )
            else:
                handler = remotecommand.serve_spdy(
                    session, protocol, req, self.runtime, self.config.stream_creation_timeout
                )
            await self._idle_guard(handler, lambda: session.transport.last_activity)
        finally:
            await session.aclose()
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
                writer, 400, f"requested protocol(s) are not supported: {offered}; supports {list(table)}"
            )
            return None
        ports: list[int] | None = None
        if isinstance(req, pb.PortForwardRequest) and chosen != proto.WS_SPDY_TUNNEL:
            ports = portforward.ws_ports(req, request.query)
            if ports is None:
                await self._reply(writer, 400, "port-forward over WebSocket needs at least one valid port")
                return None
        ws = await websocket.accept(request, reader, writer, chosen)
        if ws is None:
            await close_writer(writer, timeout=2.0)
            return None
        try:
            if chosen == proto.WS_SPDY_TUNNEL:
                assert isinstance(req, pb.PortForwardRequest)
                session = SpdySession(portforward.WsByteTransport(ws))
                session.start()
                try:
                    await self._idle_guard(
                        portforward.serve_spdy(
                            session, req, self.runtime, self.config.stream_creation_timeout
                        ),
                        lambda: ws.last_activity,
                    )
                finally:
                    await session.aclose()
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
