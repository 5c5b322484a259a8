"""One-use, expiring tokens that stand for a cached streaming request."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from shim.cri.errors import ResourceExhaustedError

T = TypeVar("T")

TOKEN_BYTES = 24  # 192 bits of randomness, 32 URL-safe characters


class TokenCache(Generic[T]):
    def __init__(self, ttl: float, max_size: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.max_size = max_size
        self._clock = clock
        self._entries: dict[str, tuple[float, T]] = {}

    def __len__(self) -> int:
        self._purge()
        return len(self._entries)

    def insert(self, value: T) -> str:
        self._purge()
        if len(self._entries) >= self.max_size:
            raise ResourceExhaustedError("too many outstanding streaming requests")
        token = secrets.token_urlsafe(TOKEN_BYTES)
        self._entries[token] = (self._clock() + self.ttl, value)
        return token

    def consume(self, token: str, accept: Callable[[T], bool] | None = None) -> T | None:
        """The value, once: None for an unknown, reused or expired token, and for one
        whose value ``accept`` refuses (that token stays usable)."""
        entry = self._entries.get(token)
        if entry is None:
            return None
        if entry[0] <= self._clock():
            del self._entries[token]
            return None
        if accept is not None and not accept(entry[1]):
            return None
        del self._entries[token]
        return entry[1]

    def _purge(self) -> None:
        now = self._clock()
        # dicts keep insertion order and every entry has the same ttl
        for token, (expires, _) in list(self._entries.items()):
            if expires > now:
                break
            del self._entries[token]
