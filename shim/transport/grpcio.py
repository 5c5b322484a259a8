"""grpcio's aio server: the CRI servicer and the gRPC health service on a unix socket.

The only module of the shim that imports grpc (the server imports it only when
``[server] transport = "grpcio"``): it builds grpc's generic handlers from the
servicer's table and turns the servicer's :class:`Code` into ``grpc.StatusCode``.

grpcio cannot adopt a listening descriptor, so with a socket handed over by
systemd (``fd://``) it listens on a private socket and :func:`relay_from_fd`
splices every connection accepted on systemd's socket to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shim.cri.codes import Code
from shim.cri.servicer import IMAGE_SERVICE, RUNTIME_SERVICE, CriServicer, Rpc, Undecodable, serialize

_STATUS = {status.value[0]: status for status in grpc.StatusCode}


def status(code: Code) -> grpc.StatusCode:
    """grpc's own StatusCode of ``code``."""
    return _STATUS[int(code)]


class _Context:
    """The servicer's view of a grpcio call: abort with a :class:`Code`."""

    __slots__ = ("_context",)

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context

    async def abort(self, code: Code, details: str = "") -> None:
        await self._context.abort(status(code), details)


def _unary_handler(
    servicer: CriServicer, rpc: Rpc
) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def handle(req: Message | Undecodable, context: grpc.aio.ServicerContext) -> Any:
        outcome = servicer.begin(rpc, req)
        code, detail, resp = outcome if type(outcome) is tuple else await outcome  # type: ignore[misc]
        if code == Code.OK:
            return resp
        await context.abort(status(code), detail)

    return handle


def _stream_handler(
    servicer: CriServicer, rpc: Rpc
) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    inner = servicer.stream_handler(rpc)

    async def handle(req: Message | Undecodable, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        gen = inner(req, _Context(context))
        try:
            async for item in gen:
                yield item
        finally:
            # Closed at our yield (the call went away): close the servicer's
            # generator now, at its own yield, as grpcio would have.
            await gen.aclose()

    return handle


def handlers(servicer: CriServicer) -> list[grpc.GenericRpcHandler]:
    """grpc's generic handlers of the two CRI services, from the servicer's table."""
    return [
        grpc.method_handlers_generic_handler(RUNTIME_SERVICE, _table(servicer, servicer.runtime_rpcs)),
        grpc.method_handlers_generic_handler(IMAGE_SERVICE, _table(servicer, servicer.image_rpcs)),
    ]


def _table(servicer: CriServicer, rpcs: list[Rpc]) -> dict[str, grpc.RpcMethodHandler]:
    table = {}
    for rpc in rpcs:
        if rpc.stream:
            table[rpc.name] = grpc.unary_stream_rpc_method_handler(
                _stream_handler(servicer, rpc),
                request_deserializer=rpc.decode,
                response_serializer=serialize,
            )
        else:
            table[rpc.name] = grpc.unary_unary_rpc_method_handler(
                _unary_handler(servicer, rpc),
                request_deserializer=rpc.decode,
                response_serializer=serialize,
            )
    return table


class GrpcioServer:
    def __init__(self, servicer: CriServicer, max_message_bytes: int) -> None:
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.so_reuseport", 0),
            ],
        )
        self._server.add_generic_rpc_handlers(handlers(servicer))
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)

    async def start(self, path: str) -> bool:
        """Serve on a new unix socket at ``path``; False if grpcio cannot listen there."""
        if self._server.add_insecure_port(f"unix://{path}") == 0:
            return False
        await self._server.start()
        return True

    async def set_serving(self) -> None:
        """Health checks answer SERVING from now on: called once clients may use the socket."""
        for svc in ("", RUNTIME_SERVICE, IMAGE_SERVICE):
            await self._health.set(svc, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace: float) -> None:
        await self._server.stop(grace)


async def relay_from_fd(fd: int, target: str) -> asyncio.Server:
    """Serve a listening socket handed over by systemd by relaying each connection to ``target``."""
    listener = socket.socket(fileno=fd)
    listener.setblocking(False)

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(256 * 1024):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    return await asyncio.start_unix_server(relay, sock=listener)
