"""grpcio's aio server: the CRI servicer and the gRPC health service on a unix socket.

grpcio cannot adopt a listening descriptor, so with a socket handed over by
systemd (``fd://``) it listens on a private socket and :func:`relay_from_fd`
splices every connection accepted on systemd's socket to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shim.cri.servicer import IMAGE_SERVICE, RUNTIME_SERVICE, CriServicer


class GrpcioServer:
    def __init__(self, servicer: CriServicer, max_message_bytes: int) -> None:
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.so_reuseport", 0),
            ],
        )
        self._server.add_generic_rpc_handlers(servicer.handlers())
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
