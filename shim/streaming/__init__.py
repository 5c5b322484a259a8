"""Exec, attach and port-forward over SPDY/3.1 and WebSocket (the CRI streaming server)."""

from shim.streaming.config import StreamingConfig, StreamingRuntime
from shim.streaming.server import StreamingServer

__all__ = ["StreamingConfig", "StreamingRuntime", "StreamingServer"]
