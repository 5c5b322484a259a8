"""What the streaming server is configured with and what it calls."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from backends.contract import PortStream, StreamIO


class StreamingRuntime(Protocol):
    """The three operations behind the streaming URLs (implemented by the shim)."""

    async def exec(self, container_id: str, cmd: Sequence[str], io: StreamIO) -> int: ...

    async def attach(self, container_id: str, io: StreamIO) -> None: ...

    async def port_forward(self, sandbox_id: str, port: int, stream: PortStream) -> None: ...


@dataclasses.dataclass(frozen=True)
class StreamingConfig:
    address: str = "127.0.0.1"
    port: int = 0  # 0: a random free port
    tls_cert: str = ""  # both set: serve HTTPS
    tls_key: str = ""
    token_ttl: float = 60.0  # seconds a URL stays valid unused
    max_streams: int = 100  # concurrent streaming sessions
    idle_timeout: float = 4 * 3600.0  # a session without traffic for this long is closed
    stream_creation_timeout: float = 30.0  # for the client to open all its SPDY streams
    max_tokens: int = 1000  # outstanding unused URLs
    max_handshakes: int = 128  # connections not yet past their request head
