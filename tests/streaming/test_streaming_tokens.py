from __future__ import annotations

import base64

import pytest

from shim.cri.errors import ResourceExhaustedError
from shim.streaming.tokens import TokenCache


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_tokens_are_random_and_at_least_128_bits() -> None:
    cache: TokenCache[int] = TokenCache(60, 100)
    tokens = {cache.insert(i) for i in range(50)}
    assert len(tokens) == 50
    for token in tokens:
        assert len(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))) * 8 >= 128


def test_token_is_used_once() -> None:
    cache: TokenCache[str] = TokenCache(60, 100)
    token = cache.insert("req")
    assert cache.consume(token) == "req"
    assert cache.consume(token) is None
    assert cache.consume("never-issued") is None


def test_token_expires_unused() -> None:
    clock = Clock()
    cache: TokenCache[str] = TokenCache(60, 100, clock)
    early, late = cache.insert("a"), None
    clock.now += 30
    late = cache.insert("b")
    clock.now += 30.5
    assert cache.consume(early) is None
    assert len(cache) == 1
    assert cache.consume(late) == "b"


def test_outstanding_tokens_are_bounded() -> None:
    clock = Clock()
    cache: TokenCache[int] = TokenCache(10, 3, clock)
    for i in range(3):
        cache.insert(i)
    with pytest.raises(ResourceExhaustedError):
        cache.insert(4)
    clock.now += 11  # expired ones make room
    cache.insert(5)
