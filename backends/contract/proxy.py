"""A backend seen through a wrapper: the same parts, each of their calls going through one function.

``BackendProxy(inner, around)`` is a :class:`~backends.contract.protocols.Backend` whose
present parts are :class:`PartProxy` objects in front of ``inner``'s (an absent part stays
None) and whose name, capabilities and plain methods are ``inner``'s. ``around(method, fn)``
says what the public method ``fn`` of a part, by its name, becomes: the function to call
instead, or ``fn`` itself to leave it alone. Method names are unique across the parts, so the
name alone says which call it is (``run_sandbox``, ``pull_image``, ``exec_sync``...).

The fault injector (:mod:`backends.fake.faults`) and the shim's timing of backend calls
(``shim.prometheus``) are such wrappers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from backends.contract.pool import PoolFigures
from backends.contract.protocols import (
    Backend,
    Capability,
    Checkpoint,
    Exec,
    Images,
    Lifecycle,
    Metrics,
    Resources,
    Stats,
)

Around = Callable[[str, Callable[..., Any]], Callable[..., Any]]

_P = TypeVar("_P")


class PartProxy:
    """One part seen through ``around``: each public method as ``around`` makes it (made at its
    first use, and again after that name is written); other attributes are read and written
    through to the part."""

    def __init__(self, part: object, around: Around) -> None:
        object.__setattr__(self, "_part", part)
        object.__setattr__(self, "_around", around)

    def __getattr__(self, attr: str) -> Any:
        # Only for names not made yet: what is made is kept in this object's own dict.
        value = getattr(self._part, attr)
        if attr.startswith("_") or not callable(value):
            return value
        made = self._around(attr, value)
        if made is not value:
            self.__dict__[attr] = made
        return made

    def __setattr__(self, attr: str, value: Any) -> None:
        self.__dict__.pop(attr, None)
        setattr(self._part, attr, value)

    def __delattr__(self, attr: str) -> None:
        self.__dict__.pop(attr, None)
        delattr(self._part, attr)

    def __repr__(self) -> str:
        return f"PartProxy({self._part!r})"


def _through(part: _P, around: Around) -> _P:
    """``part`` seen through ``around``; None (an absent part) stays None."""
    return part if part is None else cast(_P, PartProxy(part, around))


class BackendProxy:
    """A Backend in front of ``inner``, its parts' calls going through ``around``."""

    def __init__(self, inner: Backend, around: Around) -> None:
        self._inner = inner
        self.lifecycle: Lifecycle = _through(inner.lifecycle, around)
        self.images: Images | None = _through(inner.images, around)
        self.exec: Exec | None = _through(inner.exec, around)
        self.stats: Stats | None = _through(inner.stats, around)
        self.metrics: Metrics | None = _through(inner.metrics, around)
        self.resources: Resources | None = _through(inner.resources, around)
        self.checkpoint: Checkpoint | None = _through(inner.checkpoint, around)

    @property
    def wrapped(self) -> Backend:
        return self._inner

    @property
    def name(self) -> str:
        return self._inner.name

    @name.setter
    def name(self, value: str) -> None:
        self._inner.name = value

    @property
    def capabilities(self) -> Capability:
        return self._inner.capabilities

    def why_not(self, capability: Capability) -> str:
        return self._inner.why_not(capability)

    def set_pod_cidr(self, cidr: str) -> None:
        self._inner.set_pod_cidr(cidr)

    def warm_figures(self) -> PoolFigures | None:
        return self._inner.warm_figures()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._inner!r})"


if TYPE_CHECKING:
    _: type[Backend] = BackendProxy  # the class is a Backend (mypy checks it here)
