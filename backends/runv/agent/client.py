"""Host side of the agent channel: typed requests with deadlines, errors as shim conditions."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from backends.contract import errors
from backends.runv.agent.messages import R, Request
from backends.runv.agent.protocol import AgentError, Channel, ConnectionLost, Stream

_CODES: dict[str, type[errors.CriError]] = {
    "not_found": errors.NotFoundError,
    "invalid": errors.InvalidArgumentError,
    "exists": errors.AlreadyExistsError,
    "unimplemented": errors.UnimplementedError,
    "failed": errors.FailedPreconditionError,
}


class AgentClient:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_event: Callable[[str, dict[str, Any]], None],
        timeout: float,
    ) -> None:
        self.channel = Channel(reader, writer, on_event=on_event)
        self.timeout = timeout
        self.channel.start()

    @property
    def closed(self) -> bool:
        return self.channel.closed.is_set()

    def stream(self) -> Stream:
        return self.channel.new_stream()

    async def call(self, req: Request[R], timeout: float | None = -1.0) -> R:
        """One request, its typed result; ``timeout=None`` waits forever (e.g. for an exit),
        -1 is the client's default."""
        data = await self.raw(req.OP, req.to_dict(), timeout)
        try:
            return req.result(data)
        except AgentError as exc:
            raise errors.InternalError(f"agent {req.OP}: bad result: {exc.message}") from exc

    async def raw(self, op: str, args: dict[str, Any], timeout: float | None = -1.0) -> dict[str, Any]:
        """One request as plain JSON objects (``call`` is the typed form)."""
        limit = self.timeout if timeout == -1.0 else timeout
        try:
            return await self.channel.request(op, args, timeout=limit)
        except AgentError as exc:
            raise _CODES.get(exc.code, errors.InternalError)(f"agent {op}: {exc.message}") from exc
        except ConnectionLost as exc:
            raise errors.UnavailableError(f"agent channel lost during {op}") from exc
        except TimeoutError as exc:
            raise errors.UnavailableError(f"agent did not answer {op} within {limit}s") from exc

    async def close(self) -> None:
        await self.channel.aclose()
