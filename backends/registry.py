"""Runtime handler name → backend.

Backends are loaded lazily by type, so a node that only uses the fake
runtime never imports the Docker SDK (tests/rules/test_lazy_backends.py). Each configured handler gets its own
backend instance; several handler names may share one type with different
options, as RuntimeClass handlers do in containerd and CRI-O.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any

from backends.contract import Backend

# type name -> module exposing `create(name, options) -> Backend`
BACKEND_MODULES = {
    "fake": "backends.fake",
    "docker": "backends.docker",
    "runv": "backends.runv",
}


class UnknownHandlerError(LookupError):
    pass


def create_backend(kind: str, name: str, options: Mapping[str, Any]) -> Backend:
    module_name = BACKEND_MODULES.get(kind)
    if module_name is None:
        raise UnknownHandlerError(f"unknown backend type {kind!r}")
    module = importlib.import_module(module_name)
    backend: Backend = module.create(name, dict(options))
    return backend


class HandlerRegistry:
    """The backends of one shim, by runtime handler name."""

    def __init__(self, backends: Mapping[str, Backend], default: str) -> None:
        if default not in backends:
            raise UnknownHandlerError(f"default handler {default!r} is not configured")
        self._backends = dict(backends)
        self.default = default

    def __iter__(self) -> Iterator[Backend]:
        return iter(self._backends.values())

    def names(self) -> list[str]:
        return list(self._backends)

    def items(self) -> list[tuple[str, Backend]]:
        return list(self._backends.items())

    def resolve_name(self, handler: str) -> str:
        """`""` is the default handler; anything else must be configured."""
        name = handler or self.default
        if name not in self._backends:
            configured = ", ".join(sorted(self._backends))
            raise UnknownHandlerError(f"runtime handler {handler!r} is not configured ({configured} are)")
        return name

    def get(self, handler: str) -> Backend:
        return self._backends[self.resolve_name(handler)]
