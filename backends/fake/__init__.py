"""The fake runtime: in-memory CRI behaviour, call recording and fault injection."""

from __future__ import annotations

from typing import Any

from backends.fake.backend import FakeBackend, FakeRuntime
from backends.fake.faults import Call, FaultInjector, error_from_spec
from backends.fake.program import PROGRAM_ANNOTATION, Program

__all__ = [
    "PROGRAM_ANNOTATION",
    "Call",
    "FakeBackend",
    "FakeRuntime",
    "FaultInjector",
    "Program",
    "create",
    "error_from_spec",
]


def create(name: str, options: dict[str, Any]) -> FakeBackend:
    return FakeBackend(name, options)
